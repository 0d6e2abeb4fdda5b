"""What a member announces to its group before averaging, the outcome of one attempt, and who takes part: pure
functions of the all-gathered list, so every member derives the same answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from p2p_diloco.net.consensus import majority_state
from p2p_diloco.net.averaging.screening import accused


@dataclass
class Contribution:
    """What a peer announces to its group before averaging (all-gathered, identical on every member)."""
    name: str
    round: int        # number of rounds committed so far: the version of θ_global the pseudo-gradient is relative to
    digest: str       # sha256 of θ_global (hex)
    tokens: int       # tokens processed since the last commit: the weight of this contribution
    steps_per_s: float = 0.0  # the member's inner-step speed: every member plans its next round from the same list
    suspects: list[str] = field(default_factory=list)  # peer ids this member leaves out (a reducer named them)
    proof: str = ""           # private runs: membership proof for the sender's PeerID, hex (net/security/gate.py)
    electorate: int = 0       # peers this member sees at its round, itself included (net/consensus.py has_quorum)


@dataclass
class AverageResult:
    """Outcome of one averaging attempt. When ``ok``, the pseudo-gradient buffers hold the canonical average."""
    ok: bool
    group_size: int = 0                       # members whose contribution is in the average
    peers: list[str] = field(default_factory=list)  # their names
    tokens: int = 0                           # tokens behind the average
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0                      # matchmaking and all-reduce
    allreduce_seconds: float = 0.0            # the all-reduce alone, once the group formed
    error: Optional[str] = None
    stale: bool = False                       # the group averaged a θ_global other than ours: repair before contributing
    group_round: Optional[int] = None         # the round the group's majority was at
    speeds: list[float] = field(default_factory=list)  # every group member's inner steps per second (DyLU)
    reducer_bytes: int = 0                    # the most bytes our reducer held at once to combine a part
    malformed: dict = field(default_factory=dict)  # peer id -> (name, why): members a reducer refused this round


def quorum_holders(contributions: Sequence[Contribution], peer_ids: Sequence[str] = ()) -> int:
    """How many members of the group hold the θ_global it averages (participants, and members of that state with
    nothing to add): each is in no other group of this round."""
    left_out = accused(peer_ids, [c.suspects for c in contributions]) if peer_ids else set()
    states = [(c.round, c.digest) for i, c in enumerate(contributions) if i not in left_out]
    if not states:
        return 0
    best = majority_state(states)
    return sum((c.round, c.digest) == best for c in contributions)


def choose_participants(contributions: Sequence[Contribution], peer_ids: Sequence[str] = ()) -> list[int]:
    """Indices of members whose pseudo-gradient enters the average: the largest class sharing one (round, digest).

    Pure and deterministic: every member evaluates it on the same gathered list and gets the same answer. Ties go to
    the higher round, then to the smaller digest. Members with no tokens contribute nothing, nor do members (with
    ``peer_ids`` given) that a majority of the others name as suspects.
    """
    left_out = accused(peer_ids, [c.suspects for c in contributions]) if peer_ids else set()
    states = [(c.round, c.digest) for i, c in enumerate(contributions) if i not in left_out]
    if not states:
        return []
    best = majority_state(states)
    return [i for i, c in enumerate(contributions)
            if (c.round, c.digest) == best and c.tokens > 0 and i not in left_out]
