"""What a follower watches while it waits in matchmaking for its leader's group (net/averaging/seam.py
``PendingAverage`` calls the watch about once a second and, when it says why, ends our matchmaking: only if no group
holds us yet, net/averaging/survive.py ``_abandon_matchmaking``)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from p2p_diloco.net.consensus import credible_rounds


class LeaderWatch:
    """A follower's watch on the leader it waits for (net/averaging/seam.py ``PendingAverage``): a ping every
    :attr:`PERIOD_S` seconds; after :attr:`MISSES` pings in a row without an answer, why to stop waiting.

    A leader killed during its inner steps never declares its group: its followers used to wait two whole matchmaking
    windows for it and fail the attempt (a 12-peer swarm with a member killed each round lost round 2 on all 11
    survivors so), and only its roster entry's expiry made them name another. A dead peer's DHT node does not
    answer (its p2pd died with it; on loopback the dial is refused at once, over the internet it times out): the
    followers stop looking, pass it over for the round (consensus.Leaders) and look for the next leader's group within
    the same attempt. A live leader still in its inner steps answers, and is waited for as before."""

    PERIOD_S, MISSES = 2.0, 2

    def __init__(self, dht, leader: str, timeout: float):
        self.dht, self.leader, self.timeout = dht, leader, timeout
        self.misses, self._next = 0, 0.0

    def __call__(self) -> Optional[str]:
        if time.monotonic() < self._next:
            return None
        from p2p_diloco.net.dht import answers

        alive = answers(self.dht, self.leader, self.timeout)
        self._next = time.monotonic() + self.PERIOD_S
        self.misses = self.misses + 1 if alive is False else 0
        if self.misses >= self.MISSES:
            return f"the leader …{self.leader[-6:]} does not answer ({self.misses} pings in a row)"
        return None


class RunWatch:
    """Whether the run committed the round we contribute to without us: then no group of our round is left to join
    and waiting on is a lost attempt (the round loop repairs instead, and joins the next round's group).

    Seen in a swarm with a member killed each round: a replacement that fetched round 1 while round 2's group was
    already averaging (a dead sender held it 17 s) waited for that group, alive and answering pings, for 24 s, and
    missed round 3's group too. After :attr:`AFTER_S` seconds of waiting (a healthy wait is shorter: nothing is read
    then), every :attr:`PERIOD_S` seconds the roster is read; once a round past ours is credible
    (consensus.credible_rounds: a stranger's claim is not), the wait ends and the round is remembered as the run's
    (Membership.known_round), so the peer fetches it before it contributes again."""

    AFTER_S, PERIOD_S = 5.0, 3.0

    def __init__(self, membership, round_: int):
        self.membership, self.round = membership, round_
        self.run_moved = False
        self._next = time.monotonic() + self.AFTER_S

    def __call__(self) -> Optional[str]:
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.PERIOD_S
        me = self.membership.status()
        others = [s for s in self.membership.live_roster() if s.peer_id != me.peer_id]
        latest = max(credible_rounds(me, others))
        if latest <= self.round:
            return None
        self.run_moved = True
        self.membership.known_round = max(self.membership.known_round, latest)
        return f"the run committed round {latest} while we waited for a group of round {self.round + 1}"


class StopWatch:
    """A peer asked to stop (a signal) stops looking for a group: nobody's all-reduce holds it yet, and it leaves
    (without it a peer whose partners left waited the whole matchmaking window, 2 × matchmaking_time +
    request_timeout, longer than a stop's 12 s grace: exit 143 in tests/test_ranks.py)."""

    def __init__(self, stop: threading.Event):
        self.stop = stop

    def __call__(self) -> Optional[str]:
        return "stopping: this peer leaves the run" if self.stop.is_set() else None


class Watches:
    """Several watches as one: the first reason any of them gives."""

    def __init__(self, *watches: Callable[[], Optional[str]]):
        self.watches = watches

    @property
    def run_moved(self) -> bool:
        return any(getattr(w, "run_moved", False) for w in self.watches)

    def __call__(self) -> Optional[str]:
        for watch in self.watches:
            why = watch()
            if why:
                return why
        return None
