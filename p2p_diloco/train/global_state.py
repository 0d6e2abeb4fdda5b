"""θ_global, the outer optimizer's state and the round: what every peer holds bit-identical after a committed round.

They change together, under one lock, and the digests are refreshed with every change, so a donor serving its state
on another thread always serves a consistent (round, tensors, digest). Imports torch only.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from p2p_diloco.train.outer import OuterOptimizer, state_digests


class GlobalState:
    """θ_global (fp32, CPU), its outer optimizer and the number of rounds committed (the version of θ_global)."""

    def __init__(self, params: list[torch.Tensor], outer: OuterOptimizer):
        self.params = params
        self.outer = outer
        self.round = 0
        self.lock = threading.Lock()
        self.params_digest = self.digest = ""
        self._refresh()

    def _refresh(self) -> None:
        # params_digest: θ_global alone (logged each round); digest: θ_global and the outer state (compared)
        self.params_digest, self.digest = state_digests(self.params, self.outer.state_tensors())

    def tensors(self) -> list[torch.Tensor]:
        """θ_global followed by the outer optimizer's state tensors (what joiners download)."""
        return [*self.params, *self.outer.state_tensors()]

    def apply(self, averaged: Sequence[torch.Tensor], num_contributions: int) -> None:
        """Commit a round: the outer step with the averaged pseudo-gradient, and the round number moves on."""
        with self.lock:
            self.outer.step(self.params, averaged, num_contributions=num_contributions)
            self.round += 1
            self._refresh()

    @torch.no_grad()
    def load(self, round_: int, tensors: Sequence[torch.Tensor]) -> None:
        """Take a downloaded state (θ_global then the outer state, in :meth:`tensors` order)."""
        with self.lock:
            for mine, theirs in zip(self.tensors(), tensors, strict=True):
                mine.copy_(theirs)
            self.round = round_
            self._refresh()

    def snapshot(self) -> tuple[int, str, list[torch.Tensor]]:
        """(round, digest, copies of :meth:`tensors`), consistent with each other."""
        with self.lock:
            return self.round, self.digest, [t.clone() for t in self.tensors()]

    def state_dict(self) -> dict:
        return {"round": self.round, "global_params": self.params, "outer": self.outer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            for p, s in zip(self.params, state["global_params"], strict=True):
                p.copy_(s)
            self.outer.load_state_dict(state["outer"])
            self.round = int(state["round"])
            self._refresh()
