"""θ_global, the outer optimizer's state and the round: what every peer holds bit-identical after a committed round.

They change together, under one lock, and the digests are refreshed with every change, so a donor serving its state
on another thread always serves a consistent (round, tensors, digest). Imports torch only.

Digested with them: ``quorum``, the peer ids of the group that committed the current round (its members holding
the round before); the next round commits only with more than half of them (net/consensus.py ``has_quorum``).

Alongside, not digested: the names of the peers whose contributions made each of the last ``HISTORY`` rounds, served
to joiners with the state, so that a peer that fetches the run's state can tell whether its own pseudo-gradient is
already in it (then its local work must not be contributed again).
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from p2p_diloco.train.outer import OuterOptimizer, state_digests

HISTORY = 16  # rounds whose members are remembered


class GlobalState:
    """θ_global (fp32, CPU), its outer optimizer and the number of rounds committed (the version of θ_global)."""

    def __init__(self, params: list[torch.Tensor], outer: OuterOptimizer):
        self.params = params
        self.outer = outer
        self.round = 0
        self.members: dict[int, list[str]] = {}  # round → names of the peers averaged into it (the last HISTORY)
        self.quorum: list[str] = []  # peer ids of the group that committed ``round`` (sorted; [] at round 0: unknown)
        self.lock = threading.Lock()
        self.params_digest = self.digest = ""
        self._refresh()

    def _refresh(self) -> None:
        # params_digest: θ_global alone (logged each round); digest: θ_global and the outer state (compared)
        self.params_digest, self.digest = state_digests(self.params, self.outer.state_tensors(), self.quorum)

    def tensors(self) -> list[torch.Tensor]:
        """θ_global followed by the outer optimizer's state tensors (what joiners download)."""
        return [*self.params, *self.outer.state_tensors()]

    def apply(self, averaged: Sequence[torch.Tensor], num_contributions: int, members: Sequence[str] = (),
              quorum: Sequence[str] = ()) -> None:
        """Commit a round: the outer step with the averaged pseudo-gradient of ``members`` (k = ``num_contributions``
        contributions), and the round number moves on; ``quorum``: the peer ids of the group that committed it."""
        with self.lock:
            self.outer.step(self.params, averaged, num_contributions=num_contributions)
            self.round += 1
            self.quorum = sorted(quorum)
            self._remember(self.round, members)
            self._refresh()

    def _remember(self, round_: int, members: Sequence[str]) -> None:
        self.members[round_] = list(members)
        for old in [r for r in self.members if r <= round_ - HISTORY]:
            del self.members[old]

    def included(self, name: str, round_: int) -> bool:
        """Whether ``name``'s contribution is in the average that made round ``round_`` (False if unknown)."""
        return name in self.members.get(round_, ())

    @torch.no_grad()
    def load(self, round_: int, tensors: Sequence[torch.Tensor], members: Sequence = (),
             quorum: Sequence[str] = ()) -> None:
        """Take a downloaded state (θ_global then the outer state, in :meth:`tensors` order), the donor's
        ``members`` history (``[(round, names), ...]``, as :meth:`member_history` gives it) and its round's
        ``quorum`` (checked against the digest by the caller: :func:`parse_quorum`)."""
        with self.lock:
            for mine, theirs in zip(self.tensors(), tensors, strict=True):
                mine.copy_(theirs)
            self.round = round_
            self.quorum = sorted(quorum)
            self.members = _parse_members(members)
            self._refresh()

    def member_history(self) -> list:
        return [[r, list(names)] for r, names in sorted(self.members.items())]

    def snapshot(self) -> tuple[int, str, list[torch.Tensor], list, list[str]]:
        """(round, digest, copies of :meth:`tensors`, member history, quorum), consistent with each other."""
        with self.lock:
            return self.round, self.digest, [t.clone() for t in self.tensors()], self.member_history(), \
                list(self.quorum)

    def state_dict(self) -> dict:
        return {"round": self.round, "global_params": self.params, "outer": self.outer.state_dict(),
                "members": self.member_history(), "quorum": list(self.quorum)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            for p, s in zip(self.params, state["global_params"], strict=True):
                p.copy_(s)
            self.outer.load_state_dict(state["outer"])
            self.round = int(state["round"])
            self.quorum = parse_quorum(state.get("quorum")) or []  # a checkpoint from before it: unknown
            self.members = _parse_members(state.get("members"))
            self._refresh()


def _parse_members(history) -> dict[int, list[str]]:
    """``[(round, names), ...]`` (from a donor or a checkpoint) → {round: names}; {} if malformed (it only decides
    whether late work is dropped, never what θ_global is)."""
    try:
        return {int(r): [str(n) for n in names] for r, names in history or ()}
    except (TypeError, ValueError):
        return {}


MAX_QUORUM = 4096  # peer ids a round's quorum may list (a donor's list longer than this is refused)


def parse_quorum(value) -> Optional[list[str]]:
    """A round's quorum from a donor or a checkpoint: a list of at most :data:`MAX_QUORUM` distinct peer ids
    (base58 strings of at most 128 characters), sorted; None if malformed. Whether it is the round's is then
    checked by the digest it is folded into."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or len(value) > MAX_QUORUM:
        return None
    if not all(isinstance(p, str) and 0 < len(p) <= 128 and p.isalnum() for p in value) or len(set(value)) != len(value):
        return None
    return sorted(value)
