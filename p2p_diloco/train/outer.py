"""PURE outer-loop math: pseudo-gradients and outer optimizers on θ_global. Imports torch only.

θ_global and the momentum buffer m live on the CPU in fp32. Every peer of a group applies the outer step to the
same averaged bytes; to get the same result bits on every CPU, each update below is a chain of single elementwise
ops (each correctly rounded) rather than fused multiply-adds, whose use varies between CPUs and kernels.
"""

from __future__ import annotations

import abc
import hashlib
from typing import Iterable, Optional, Sequence

import torch


@torch.no_grad()
def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Iterable[torch.Tensor],
                    out: Sequence[torch.Tensor]) -> None:
    """δ = θ_global − θ_local, written into ``out`` (fp32, CPU). Sign convention: δ acts like a gradient."""
    for g, l, o in zip(global_params, local_params, out, strict=True):
        o.copy_(l.detach(), non_blocking=False)  # device → CPU and dtype → fp32 in one copy
        torch.sub(g, o, out=o)


@torch.no_grad()
def rebase(local_params: Iterable[torch.Tensor], new_global: Sequence[torch.Tensor],
           pseudo_grads: Sequence[torch.Tensor]) -> None:
    """θ_local ← θ_global_new − δ, where ``pseudo_grads`` holds δ = θ_global_old − θ_local (taken with
    :func:`pseudo_gradient` before θ_global was replaced): the local work since the last commit, moved onto the new
    θ_global. Overwrites ``pseudo_grads``."""
    for l, g, d in zip(local_params, new_global, pseudo_grads, strict=True):
        torch.sub(g, d, out=d)
        l.detach().copy_(d)


@torch.no_grad()
def load_into(local_params: Iterable[torch.Tensor], global_params: Sequence[torch.Tensor]) -> None:
    """θ_local ← θ_global (the start of every round)."""
    for l, g in zip(local_params, global_params, strict=True):
        l.detach().copy_(g)


def params_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 (hex) of the raw bytes of ``tensors`` in order: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    _update(h, tensors)
    return h.hexdigest()


def state_digests(params: Sequence[torch.Tensor], optimizer_state: Sequence[torch.Tensor],
                  quorum: Sequence[str] = ()) -> tuple[str, str]:
    """(digest of θ_global, digest of θ_global followed by the outer optimizer state and, when known, ``quorum``:
    the peer ids of the group that committed this round, sorted), hashing θ only once. Peers holding the same
    digest agree on that group too, so the next round's quorum is counted over it (net/consensus.py)."""
    h = hashlib.sha256()
    _update(h, params)
    params_hex = h.hexdigest()
    _update(h, optimizer_state)
    if quorum:
        h.update(("\nquorum:" + ",".join(sorted(quorum))).encode())
    return params_hex, h.hexdigest()


def _update(h, tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())


class OuterOptimizer(abc.ABC):
    """Applies an averaged pseudo-gradient Δ to θ_global in place.

    ``num_contributions`` is how many peers' pseudo-gradients the round averaged (k), for rules such as Delayed
    Nesterov that count arrivals. The state (e.g. momentum) must be identical on every peer, so it is shared with
    joiners and checkpointed through :meth:`state_tensors`.
    """

    @abc.abstractmethod
    def step(self, params: Sequence[torch.Tensor], avg_pseudo_grads: Sequence[torch.Tensor],
             num_contributions: int = 1) -> None:
        ...

    @abc.abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        ...

    def step_response(self, extra: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """How much further θ the last step would have moved had the average been larger by ``extra`` (the outer
        step is linear in the average for a given state). Used by ``diloco.overlap = "eager"``."""
        raise NotImplementedError(f"{type(self).__name__} has no closed-form step response")

    def state_dict(self) -> dict:
        return {"tensors": [t.clone() for t in self.state_tensors()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for t, s in zip(self.state_tensors(), state["tensors"], strict=True):
            t.copy_(s)


class OuterSGD(OuterOptimizer):
    """θ ← θ − ε·Δ (with ε = 1: plain averaging of the replicas, i.e. federated averaging)."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float):
        self.lr = lr

    @torch.no_grad()
    def step(self, params, avg_pseudo_grads, num_contributions: int = 1) -> None:
        for p, d in zip(params, avg_pseudo_grads, strict=True):
            p.sub_(d * self.lr)

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    @torch.no_grad()
    def step_response(self, extra):
        return [e * -self.lr for e in extra]


class OuterNesterov(OuterOptimizer):
    """DiLoCo's outer step: m ← β·m + Δ;  θ ← θ − ε·(Δ + β·m).

    Same semantics as ``torch.optim.SGD(lr=ε, momentum=β, nesterov=True, dampening=0)`` applied to Δ as the gradient.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.buffers = [torch.zeros_like(p, dtype=torch.float32, device="cpu") for p in params]

    @torch.no_grad()
    def step(self, params, avg_pseudo_grads, num_contributions: int = 1) -> None:
        for p, d, m in zip(params, avg_pseudo_grads, self.buffers, strict=True):
            m.mul_(self.momentum).add_(d)
            update = m * self.momentum
            update.add_(d).mul_(self.lr)
            p.sub_(update)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.buffers

    @torch.no_grad()
    def step_response(self, extra):
        # θ moves by −ε·(Δ + β·(β·m + Δ)) = −ε·((1 + β)·Δ + β²·m): linear in Δ with slope −ε·(1 + β)
        return [e * -(self.lr * (1 + self.momentum)) for e in extra]


AUTO_OUTER = (0.5, 0.5)
"""(ε, β) of ``diloco.outer_lr = "auto"`` / ``outer_momentum = "auto"``: see :func:`auto_outer`."""


def auto_outer(peers: int, inner_steps: int) -> tuple[float, float]:
    """(outer lr ε, outer momentum β) of ``diloco.outer_lr = "auto"`` / ``outer_momentum = "auto"`` for a run that
    expects ``peers`` peers and runs H = ``inner_steps`` inner steps per round. Pure.

    ε = 0.5, β = 0.5 for every M and H: in our sweep (benchmarks/learning-quality.md 7.3: tiny preset, 600 steps,
    M 1, 2, 4, H 10, 30, 100, i.e. 6 to 60 rounds) this was the best point or within 0.3 % of it at every (M, H)
    measured but M = 4, H = 100 (6 rounds), where ε 0.7 ended 0.7 % lower. Its step on a steady pseudo-gradient,
    ε/(1 − β) = 1, is plain averaging's; the papers' β = 0.9 (tuned over hundreds to thousands of rounds) ended
    9-32 % above it. The scaling-laws paper's trend (arXiv 2503.09799: the best ε grows with M, at β = 0.9) did not
    hold here: at M = 4, ε 0.7 ended 1.8 % and ε 1.0 17 % above ε 0.5 (β 0.5). M > 4 and runs of hundreds of rounds
    were not measured. For one replica, β = 0 was 0.6 points better on the 3.48M preset (7.5) but not on the tiny one
    at each rule's best inner lr (7.6), so M = 1 keeps the same values. M and H
    stay arguments so that a rule measured over them can replace this one without changing callers.
    """
    if peers < 1 or inner_steps < 1:
        raise ValueError(f"auto_outer needs peers >= 1 and inner_steps >= 1, got {peers}, {inner_steps}")
    return AUTO_OUTER


def resolve_auto(diloco, peers: int) -> list[str]:
    """Replace ``"auto"`` in ``diloco.outer_lr`` / ``diloco.outer_momentum`` (a DiLoCoConfig, changed in place) by
    :func:`auto_outer` for ``peers`` expected peers and its H; return the keys replaced, as ``key=value``."""
    lr, momentum = auto_outer(peers, diloco.inner_steps)
    done = []
    if diloco.outer_lr == "auto":
        diloco.outer_lr = lr
        done.append(f"diloco.outer_lr={lr:g}")
    if diloco.outer_momentum == "auto":
        diloco.outer_momentum = momentum
        done.append(f"diloco.outer_momentum={momentum:g}")
    return done


class OuterDelayedNesterov(OuterOptimizer):
    """Delayed Nesterov (Asynchronous Local-SGD, arXiv 2401.09135, Alg. 3), N = ``delay``, c = ``c``.

    Per arrival g (t counts arrivals from 0)::

        buf ← buf + g
        if (t + 1) mod N == 0:  m ← β·m + buf/N;  θ ← θ − ε·((1 − c·N + c)·β·m + g/N);  buf ← 0
        else:                   θ ← θ − ε·(c·β·m + g/N)

    A committed round delivers only Δ, the (token-)weighted average of its k contributions, so **a round counts as k
    arrivals of Δ**: the rule above applied k times with g = Δ. The buffer thus gains k·Δ (with equal weights, the
    exact sum of the k pseudo-gradients), θ moves by k·Δ/N plus the momentum terms, and the momentum moves once per
    N arrivals whichever rounds they came in. With N = k in every round and c = 0 this is DiLoCo's Nesterov step.

    The k arrivals are applied in runs: the arrivals between two momentum updates all see the same m, so j of them
    are applied at once (θ ← θ − ε·j·(c·β·m + Δ/N), buf ← buf + j·Δ); the result equals k single arrivals up to float
    rounding (tests/test_outer.py compares it with a literal arrival-by-arrival reference) and costs at most
    2·(k/N + 1) passes over the parameters instead of k. The state is m, buf and t (a 0-dim int64 tensor), all in
    :meth:`state_tensors`, so the digests cover them and joiners and checkpoints carry them.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float, delay: int, c: float = 0.0):
        if delay is None or delay < 1 or not 0 <= c <= 1 / delay:
            raise ValueError(f"Delayed Nesterov needs N >= 1 and c in [0, 1/N], got N={delay}, c={c}")
        self.lr, self.momentum, self.delay, self.c = lr, momentum, delay, c
        self.buffers = [torch.zeros_like(p, dtype=torch.float32, device="cpu") for p in params]
        self.sums = [torch.zeros_like(p, dtype=torch.float32, device="cpu") for p in params]
        self.arrivals = torch.zeros((), dtype=torch.int64)

    @torch.no_grad()
    def step(self, params, avg_pseudo_grads, num_contributions: int = 1) -> None:
        t, left = int(self.arrivals), num_contributions
        while left:
            plain = min(left, self.delay - 1 - t % self.delay)  # arrivals before the next momentum update
            if plain:
                self._plain_arrivals(params, avg_pseudo_grads, plain)
                t, left = t + plain, left - plain
            if left:
                self._momentum_arrival(params, avg_pseudo_grads)
                t, left = t + 1, left - 1
        self.arrivals.fill_(t)

    def _plain_arrivals(self, params, deltas, j: int) -> None:
        """j arrivals of Δ with no momentum update: θ ← θ − ε·j·(c·β·m + Δ/N); buf ← buf + j·Δ."""
        for p, d, m, s in zip(params, deltas, self.buffers, self.sums, strict=True):
            update = d * (1.0 / self.delay)
            if self.c:
                update.add_(m * (self.c * self.momentum))
            update.mul_(self.lr * j)
            p.sub_(update)
            s.add_(d if j == 1 else d * j)

    def _momentum_arrival(self, params, deltas) -> None:
        """The arrival that completes N: buf ← buf + Δ; m ← β·m + buf/N; θ ← θ − ε·((1 − cN + c)·β·m + Δ/N)."""
        for p, d, m, s in zip(params, deltas, self.buffers, self.sums, strict=True):
            s.add_(d)
            m.mul_(self.momentum).add_(s * (1.0 / self.delay))
            update = m * ((1 - self.c * self.delay + self.c) * self.momentum)
            update.add_(d * (1.0 / self.delay))
            update.mul_(self.lr)
            p.sub_(update)
            s.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.buffers, *self.sums, self.arrivals]


def build_outer_optimizer(name: str, params: Sequence[torch.Tensor], lr: float, momentum: float,
                          delay: Optional[int] = None, c: float = 0.0) -> OuterOptimizer:
    if name == "nesterov":
        return OuterNesterov(params, lr, momentum)
    if name == "sgd":
        return OuterSGD(params, lr)
    if name == "delayed_nesterov":
        return OuterDelayedNesterov(params, lr, momentum, delay, c)
    raise ValueError(f"unknown outer optimizer {name!r}")
