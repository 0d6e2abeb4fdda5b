"""PURE decisions about agreement between peers; no network, no torch.

Every peer evaluates these functions on the same inputs (the group's gathered contributions, or the roster read
from the DHT) and so reaches the same verdict without further messages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class PeerStatus:
    """What a peer publishes about itself in the DHT roster."""
    name: str
    peer_id: str
    round: int            # rounds committed: the version of θ_global
    digest: str           # sha256 of θ_global and the outer optimizer state, as bytes
    leaving: bool = False  # announced a graceful leave: not counted, not a donor
    donor: bool = True     # serves its state to joiners (client-mode peers cannot)
    # what this peer reports about its work, for scheduling and for anyone watching the run (not for agreement)
    tokens_per_s: float = 0.0       # inner-step throughput over its recent rounds (averaging excluded)
    tokens_trained: int = 0         # tokens of inner steps this peer has trained in the run (all rounds)
    last_allreduce_s: float = 0.0   # its last averaging attempt, matchmaking included
    last_bytes: int = 0             # bytes it sent and received in that attempt
    reachability: str = "unknown"   # how it takes part (net/reachability.py): public | relayed | client
    steps_per_s: float = 0.0        # inner steps per second over its recent rounds (DyLU plans from it; 0: unknown)


@dataclass
class SyncTarget:
    """The state a peer must fetch before it contributes again."""
    round: int
    digest: str
    donors: list[str] = field(default_factory=list)  # peer ids holding exactly that state, in order of name


def _best(keys: Counter) -> tuple[int, str]:
    # most holders first, then the higher round, then the smaller digest: a total order, the same on every peer
    return max(keys, key=lambda k: (keys[k], k[0], [-ord(ch) for ch in k[1]]))


def majority_state(states: Sequence[tuple[int, str]]) -> tuple[int, str]:
    """The (round, digest) held by most members; ties go to the higher round, then the smaller digest."""
    return _best(Counter(states))


def sync_target(me: PeerStatus, roster: Sequence[PeerStatus]) -> Optional[SyncTarget]:
    """None if ``me`` holds the run's current state, else the state to fetch and who can serve it.

    The current state is the latest round any live peer committed; if peers disagree about that round's bytes
    (a round half-committed when a reducer died), the digest held by most of them, ties broken as in
    :func:`majority_state`. A peer never repairs towards an older round.
    """
    live = [s for s in roster if not s.leaving and s.peer_id != me.peer_id] + [me]
    latest = max(s.round for s in live)
    at_latest = Counter((s.round, s.digest) for s in live if s.round == latest)
    target_round, target_digest = _best(at_latest)
    if (me.round, me.digest) == (target_round, target_digest):
        return None
    holders = [s for s in live
               if s.peer_id != me.peer_id and s.donor and (s.round, s.digest) == (target_round, target_digest)]
    # one order on every peer (by name, relayed donors last: their state would cross a relay): predictable, and a
    # failed donor is simply skipped by the next attempt
    holders.sort(key=lambda s: (s.reachability == "relayed", s.name))
    return SyncTarget(target_round, target_digest, [s.peer_id for s in holders])
