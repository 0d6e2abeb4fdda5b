"""What a member announces to its group before averaging, the outcome of one attempt, and who takes part: pure
functions of the all-gathered list, so every member derives the same answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from p2p_diloco.net.consensus import has_quorum, majority_state, quorum_size
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
    live_quorum: int = 0      # members of its round's quorum group it sees alive, itself included (count_quorum)


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
    quorum: list[str] = field(default_factory=list)  # peer ids of the members that commit it (GlobalState.quorum)
    abandoned: bool = False                   # we stopped looking for a group (its leader is dead): nothing was sent
    check_s: float = 0.0                      # the reducer checks (verify.py): seconds, digest messages, their bytes
    check_messages: int = 0
    check_bytes: int = 0


@dataclass
class Quorum:
    """May this group commit the round after its members' θ_global? Counted as :func:`count_quorum` does."""
    ok: bool
    holders: int   # the members counted
    size: int      # the peers they are counted against
    over: str      # what ``size`` counts, for the reason a group did not commit

    def why_not(self, members: int, round_) -> str:
        return (f"no quorum: this group ({members} members) holds {self.holders} of the {self.size} {self.over} "
                f"at round {round_}; it does not commit round {None if round_ is None else round_ + 1}")


def count_quorum(contributions: Sequence[Contribution], peer_ids: Sequence[str], me: int,
                 quorum: Sequence[str] = ()) -> Quorum:
    """The quorum verdict, the same on every member that holds the group's θ_global (round t).

    ``quorum``: the peer ids of the group that committed round t, as our state holds them (folded into its digest,
    so every member at that digest holds the same list; [] when unknown: round 0, or a state from before it). With
    it, the group commits round t + 1 only if more than half of them are members holding θ_t: two groups of one
    round are disjoint, so at most one can, and nobody's roster entries move the count (a stranger publishing
    entries under many keys at the run's round stalled it through the roster rule: benchmarks/quorum_inflation.py).
    Members outside that group (joiners since) hold θ_t too but are not counted.

    If some of that group died or left, the group may also commit with more than half of that group's members
    **still alive**: those whose roster entries live and announce no leave, as each counted member sees them
    (``live_quorum``, the upper median of their views). Entries under a stranger's keys do not count there; members
    alive but slow do, so two groups of a run that fragmented (members missing the leader's window) cannot both
    commit while their members see each other. A dead member stops counting once its roster entry expires. A
    group holding none of that group commits only once its members see none of it alive (a run restarted from its
    checkpoints by peers with new keys), by the roster rule (:func:`~p2p_diloco.net.consensus.has_quorum`), which
    also decides without ``quorum``. Where members' views differ (a DHT partition, reads answered in part under
    heavy load), the alive count can be too small: the limit the roster rule has too."""
    left_out = accused(peer_ids, [c.suspects for c in contributions]) if peer_ids else set()
    states = [(c.round, c.digest) for i, c in enumerate(contributions) if i not in left_out]
    if not states:
        return Quorum(False, 0, 0, "peers")
    best = majority_state(states)
    at_best = [i for i, c in enumerate(contributions) if (c.round, c.digest) == best]
    if quorum and me in at_best:
        group = set(quorum)
        counted = [i for i in at_best if peer_ids[i] in group]
        if 2 * len(counted) > len(group):
            return Quorum(True, len(counted), len(group), "peers that committed it")
        alive = quorum_size([contributions[i].live_quorum for i in counted])
        if alive:
            return Quorum(2 * len(counted) > alive, len(counted), alive, "peers that committed it still alive")
        if counted:  # no view of who is alive (outside a swarm): the whole group counts
            return Quorum(False, len(counted), len(group), "peers that committed it")
        alive = quorum_size([contributions[i].live_quorum for i in at_best])
        if alive:  # none of that group is here, but some is alive: it may be committing this round elsewhere
            return Quorum(False, 0, alive, "peers that committed it still alive")
    views = [c.electorate for c in contributions]
    return Quorum(has_quorum(len(at_best), views), len(at_best), quorum_size(views), "peers")


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
