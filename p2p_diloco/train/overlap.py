"""PURE: a round's all-reduce hidden behind the next round's inner steps (``diloco.overlap``). Imports torch only.

With overlap, the all-reduce of round t runs in the background while round t+1's inner steps run; its average is
committed at the end of round t+1 (one round late). θ_global and the outer state still take the canonical step with
the true average, bit-identical on every peer; only where θ_local goes on from differs by mode. A peer keeps:

  * ``offset``: θ_local − θ_global at the start of the current round's inner steps;
  * ``sent``: our work inside the all-reduce in flight (zero when none is in flight).

At the end of each round's inner steps, w = θ_global + offset − θ_local is the work of this round. If the average in
flight arrived, θ_global has just taken its outer step with it (our ``sent`` is in it), and our work not yet in
θ_global is ``pending = w``; otherwise (the all-reduce failed, or none was in flight) it is ``pending = sent + w``.
``pending`` is the next contribution (sent ← pending), and θ_local ← θ_global + offset with:

  * ``delayed``: offset = −pending. θ_local follows the change of θ_global in place of our stale contribution and
    keeps the work not yet averaged: no work is dropped (on a failure θ_local simply goes on where it is);
  * ``eager`` (Kale et al., arXiv 2502.12996): our fresh contribution takes the place of our stale one in the
    average, Δ̃ = Δ + s·(w − sent) with s our share of the average's weight, and θ_local starts from the outer step
    taken with Δ̃. Relative to the canonical θ_global (which took Δ, our stale contribution included), that is
    offset = response(s·pending): the move of θ_global's step per unit of average (``OuterOptimizer.step_response``)
    applied to our share of the work it does not hold yet. For an SGD outer step this is the paper's rule exactly (its
    workers' θ telescopes to the canonical θ plus their own fresh share); with Nesterov, θ_global's momentum stays
    canonical where the paper's workers fold Δ̃ into momenta of their own.

With ``none`` (no Overlap object) this is plain DiLoCo: the all-reduce of round t is waited for at its end.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

MODES = ("none", "delayed", "eager")


class Overlap:
    """The per-peer state of an overlapped round loop: ``offset`` and ``sent`` (fp32, CPU), see the module doc."""

    def __init__(self, mode: str, shapes: Sequence[torch.Size]):
        if mode not in ("delayed", "eager"):
            raise ValueError(f"overlap mode must be 'delayed' or 'eager', got {mode!r}")
        self.mode = mode
        self.offset = [torch.zeros(s, dtype=torch.float32) for s in shapes]
        self.sent = [torch.zeros(s, dtype=torch.float32) for s in shapes]
        self.in_flight = False  # whether ``sent`` is in an all-reduce that may still commit

    @torch.no_grad()
    def work(self, global_params: Sequence[torch.Tensor], local_params: Iterable[torch.Tensor],
             out: Sequence[torch.Tensor]) -> None:
        """w = θ_global + offset − θ_local: this round's work, into ``out`` (fp32, CPU)."""
        for g, o, l, w in zip(global_params, self.offset, local_params, out, strict=True):
            w.copy_(l.detach())  # device → CPU and dtype → fp32 in one copy
            torch.sub(g + o, w, out=w)

    @torch.no_grad()
    def advance(self, work: Sequence[torch.Tensor], arrived: bool, share: float,
                response: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]) -> None:
        """End of a round: ``work`` from :meth:`work`; ``arrived``: the average holding ``sent`` was committed
        (θ_global has taken its step). Sets ``sent`` (the next contribution) and ``offset``."""
        for s, w in zip(self.sent, work, strict=True):
            if arrived:
                s.copy_(w)
            else:
                s.add_(w)
        if self.mode == "delayed":
            for o, s in zip(self.offset, self.sent, strict=True):
                torch.neg(s, out=o)
        else:
            for o, r in zip(self.offset, response([s * share for s in self.sent]), strict=True):
                o.copy_(r)

    @torch.no_grad()
    def restart(self, local_params: Iterable[torch.Tensor], global_params: Sequence[torch.Tensor]) -> None:
        """θ_local ← θ_global + offset: where the next round's inner steps start."""
        for l, g, o in zip(local_params, global_params, self.offset, strict=True):
            l.detach().copy_(g + o)

    @torch.no_grad()
    def drop(self) -> None:
        """Our θ_global was replaced and our local work dropped: θ_local is θ_global, nothing is owed."""
        for t in (*self.offset, *self.sent):
            t.zero_()
        self.in_flight = False

    def state_dict(self) -> dict:
        return {"offset": [t.clone() for t in self.offset], "sent": [t.clone() for t in self.sent]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for mine, saved in zip((*self.offset, *self.sent), (*state["offset"], *state["sent"]), strict=True):
            mine.copy_(saved)
        self.in_flight = False  # an all-reduce does not survive a restart: its outcome shows as a miss
