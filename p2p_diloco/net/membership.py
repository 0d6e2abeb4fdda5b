"""A peer's place in the run: its roster entry, the roster of the others, and the state transfers that keep its
θ_global the run's.

* Roster: every peer publishes its :class:`PeerStatus` under ``{prefix}.roster`` and refreshes it every
  ``averaging.roster_ttl`` / 3 seconds (heartbeat thread); an entry expires ``roster_ttl`` seconds after the last one.
  The heartbeat also refreshes the run index (``{safe_run_id}.runs``) through which ``p2p-diloco status`` finds
  the run's prefix knowing only its run_id.
* Sync: before contributing, a peer compares itself with the live roster (:func:`consensus.sync_target`); if the
  run moved past its θ_global, or most peers hold other bytes for its round, it downloads the run's state from a
  peer that holds it and checks it against the donor's digest and the roster's. What happens to the peer's local
  work then (rebased or dropped) is the peer's decision, between :meth:`Membership.behind` and :meth:`fetch`.
* Run settings: with every heartbeat the peer also publishes the run's shared settings it trains with
  (net/run_settings.py), which joiners adopt or are checked against.
* Donating: a peer that is not in client mode serves a consistent snapshot of its state to joiners.
* Reachability: each entry says how its peer takes part (public, relayed or client; net/reachability.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Optional

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import Config, ConfigError, shared_settings
from p2p_diloco.net.adoption import Adoption
from p2p_diloco.net.certificate import remember
from p2p_diloco.net.consensus import (PeerStatus, SyncTarget, credible_rounds, finished_without, majority_state,
                                      remembered, sync_target)
from p2p_diloco.net.dht import reconnect, redial
from p2p_diloco.net.keys import (commits_bytes, publish_commits, publish_finished, publish_run_index,
                                 publish_run_settings, publish_status, read_finished, read_roster_expiring)
from p2p_diloco.net.security import schema
from p2p_diloco.ops.metrics import MetricsSink
from p2p_diloco.train.global_state import GlobalState

logger = logging.getLogger("p2p_diloco")
COMMITS_REFRESH = 600.0  # s between stores of an unchanged commit record (it lasts an hour: net/keys.py)
FINISHED_TTL = 3600.0  # s a "finished the run" entry lasts: a peer that comes late still learns the run is over


class Membership(Adoption):
    """Roster, heartbeat, sync and state serving for one peer. ``state`` is the peer's :class:`GlobalState`."""

    def __init__(self, cfg: Config, dht, averager, prefix: str, name: str, state: GlobalState, fingerprint: str,
                 metrics: MetricsSink, stop_event: threading.Event, log: logging.Logger = logger,
                 reachability: str = "public"):
        self.cfg, self.dht, self.averager, self.prefix = cfg, dht, averager, prefix
        self.name, self.state, self.fingerprint = name, state, fingerprint
        self.metrics, self.stop_event, self.log = metrics, stop_event, log
        self.reachability = reachability  # how this peer takes part: public | relayed | client (net/reachability.py)
        self._closed = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._last_reconnect = 0.0
        self._known: dict[str, tuple[PeerStatus, float]] = {}  # peer id -> (its newest entry read, expiration)
        # the round's costs since take_costs: roster reads, the entries they returned, their seconds (DHT and
        # validation), and storing our commit record after a commit (seconds, bytes of the value)
        self._costs = dict.fromkeys(("roster_reads", "roster_entries", "roster_read_s", "certificate_store_s",
                                     "certificate_bytes"), 0)
        self.left: set[str] = set()  # peer ids whose entries announced a leave, as of the last read
        self._last_redial = time.monotonic()
        self._saw_others = False  # after an outage (not at start), reconnecting is worth a log line
        # a round the run reached past ours (0: none): we do not average until we hold it (:meth:`behind`,
        # Exchange.start), even when the roster no longer makes it credible (its holders died; who is left moved past
        # it or is below it): a group below it would commit a second θ_global for a round the run already has
        self.known_round = 0
        self._access_changed = threading.Event()  # a private run's secret or revocations changed (heartbeat)
        # what we report about our work in the roster (PeerStatus fields of the same names); the peer updates it
        self.work = {"tokens_per_s": 0.0, "tokens_trained": 0, "last_allreduce_s": 0.0, "last_bytes": 0,
                     "steps_per_s": 0.0}
        self.settings = shared_settings(cfg)
        # the (round, digest) pairs we committed as a member of the group, signed in our name (net/certificate.py);
        # a peer resuming a round it committed signs it again (its record may have expired)
        self.commits: list[tuple[int, str]] = []
        if getattr(state, "round", 0) > 0 and self.peer_id in getattr(state, "quorum", ()):
            self.commits = remember([], state.round, state.digest)
        self._commits_stored = -math.inf  # monotonic time of the last confirmed store of our commit record
        self.certificate_read_s = 0.0  # the last certificate check's DHT read (and validation), seconds

    @property
    def peer_id(self) -> str:
        return self.averager.peer_id

    # ------------------------------------------------------------------------------------------------ roster
    def status(self, leaving: bool = False) -> PeerStatus:
        return PeerStatus(name=self.name, peer_id=self.peer_id, round=self.state.round, digest=self.state.digest,
                          leaving=leaving, donor=self.reachability != "client", reachability=self.reachability,
                          **self.work)

    def publish(self, leaving: bool = False, commits_first: bool = False) -> None:
        """Our roster entry and run settings; our commit record too when it changed or is 10 minutes old.
        ``commits_first``: wait for the commit record's store before the roster entry's (after a commit: whoever
        sees the new round in the roster finds its certificate)."""
        ttl, timeout = self.cfg.averaging.roster_ttl, self.cfg.averaging.request_timeout
        if not leaving and (commits_first or time.monotonic() - self._commits_stored > COMMITS_REFRESH):
            self._store_commits(timeout if commits_first else None)
        publish_status(self.dht, self.prefix, self.status(leaving), ttl=ttl, timeout=timeout)
        if not leaving:
            publish_run_settings(self.dht, self.cfg.run.run_id, self.peer_id, self.settings, self.fingerprint, ttl=ttl)

    def _store_commits(self, timeout: Optional[float]) -> None:
        begun = time.perf_counter()
        future = publish_commits(self.dht, self.prefix, self.peer_id, self.commits)
        if future is None:
            return
        if timeout is None:  # the heartbeat: it must stay on time; the next one checks again
            future.add_done_callback(self._commits_done)
            return
        try:
            self._commits_done(future, future.result(timeout=timeout))
        except Exception as e:  # the heartbeat stores it again
            self.log.debug(f"storing our commit record failed: {e!r}")
        self._count(certificate_store_s=time.perf_counter() - begun, certificate_bytes=commits_bytes(self.commits))

    def _commits_done(self, future, result=None) -> None:
        try:
            if result if result is not None else future.result():
                self._commits_stored = time.monotonic()
        except Exception as e:
            self.log.debug(f"storing our commit record failed: {e!r}")

    def committed(self) -> None:
        """We committed the round our state now holds as a member of its group: sign it, then announce it."""
        self.commits = remember(self.commits, self.state.round, self.state.digest)
        self._commits_stored = -math.inf
        self.state_changed(commits_first=True)

    def roster(self) -> list[PeerStatus]:
        """Every unexpired roster entry, leavers included. Seeing nobody else, first dial the initial peers again
        (at most every roster_ttl): after a network outage this node's DHT may have dropped all its neighbours."""
        self._push_access()
        begun = time.perf_counter()
        read = read_roster_expiring(self.dht, self.prefix, self.cfg.averaging.request_timeout)
        alone = not any(s.peer_id != self.peer_id for s, _ in read)
        if alone and self.cfg.network.initial_peers and self._may_reconnect():
            answered = reconnect(self.dht, self.cfg.network.initial_peers, self.cfg.averaging.request_timeout)
            if answered:
                (self.log.info if self._saw_others else self.log.debug)(
                    f"no other peer in the roster: reached {answered} initial peer(s) again")
                read = read_roster_expiring(self.dht, self.prefix, self.cfg.averaging.request_timeout)
        self._saw_others = self._saw_others or not alone
        self._count(roster_reads=1, roster_entries=len(read), roster_read_s=time.perf_counter() - begun)
        roster = self._members(self._remember(read))
        self.left = {s.peer_id for s in roster if s.leaving}
        return roster

    def stale(self) -> set[str]:
        """Peer ids whose newest entry we read missed two heartbeats (it expires within one heartbeat period): dead,
        frozen or very late. The leader pings them before it sizes its group (net/exchange.py)."""
        now, period = get_dht_time(), self.cfg.averaging.roster_ttl / 3
        return {pid for pid, (_, expires) in self._known.items() if expires - now < period}

    def _count(self, **costs) -> None:
        for name, value in costs.items():
            self._costs[name] += value

    def take_costs(self) -> dict:
        """The round's costs since the last call (the round's record, ``net/...``): roster reads, the entries they
        returned and their seconds; the store of our commit record (seconds on the round's path, value bytes)."""
        costs, self._costs = self._costs, dict.fromkeys(self._costs, 0)
        return costs

    def _remember(self, read: list[tuple[PeerStatus, float]]) -> list[PeerStatus]:
        """This read merged with the entries earlier reads returned that have not expired yet, the newest entry of
        each peer: a loaded DHT answers a read in part (at 16 peers on 2 cores a peer saw 15, then 8, then 14 of
        16), and an entry it did not return this time is still the run's until its own expiration time."""
        now = get_dht_time()
        known = {pid: (s, expires) for pid, (s, expires) in self._known.items() if expires > now}
        for status, expires in read:
            if expires > now and expires >= known.get(status.peer_id, (None, 0.0))[1]:
                known[status.peer_id] = (status, expires)
        self._known = known
        return [status for status, _ in sorted(known.values(), key=lambda entry: entry[0].peer_id)]

    def _refresh_access(self) -> None:
        """Private runs, on the heartbeat thread (off the round's path): a new secret in network.secret_file, new
        revocations (net/security/auth.py). The DHT's process learns them at once, the averager's at the next round."""
        access = getattr(self.averager, "access", None)
        if access is not None and access.refresh(self.dht, self.cfg.averaging.request_timeout):
            self._access_changed.set()

    def _push_access(self) -> None:
        """On the round's thread (the averager's pipe is not for two threads): hand over what the heartbeat read."""
        if self._access_changed.is_set():
            self._access_changed.clear()
            self.averager.access_changed()

    def _members(self, roster: list[PeerStatus]) -> list[PeerStatus]:
        """The roster without revoked peers' entries (they may have written them before being revoked)."""
        access = getattr(self.averager, "access", None)
        return roster if access is None else [s for s in roster if s.peer_id not in access.revoked]

    def _may_reconnect(self) -> bool:
        now = time.monotonic()
        if now - self._last_reconnect < self.cfg.averaging.roster_ttl:
            return False
        self._last_reconnect = now
        return True

    def live_roster(self) -> list[PeerStatus]:
        return [s for s in self.roster() if not s.leaving]

    def announce_run(self) -> None:
        """Keep this prefix in the run index (for ``p2p-diloco status``), for one roster TTL."""
        publish_run_index(self.dht, self.cfg.run.run_id, self.prefix, self.fingerprint,
                          ttl=self.cfg.averaging.roster_ttl)

    def enter(self) -> None:
        """Appear in the roster and the run index, serve our state, and keep both fresh until :meth:`leave`."""
        schema.install(self.dht, self.prefix, self.cfg.run.run_id)  # refuse malformed records under the run's keys
        self.announce_run()
        self.state_changed()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="roster-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.cfg.averaging.roster_ttl / 3):
            self.publish()
            self.announce_run()
            self._refresh_access()
            # once per roster TTL, dial the initial peers: a restarted bootstrap node knows nobody until dialed
            if self.cfg.network.initial_peers and time.monotonic() - self._last_redial >= self.cfg.averaging.roster_ttl:
                self._last_redial = time.monotonic()
                redial(self.dht, self.cfg.network.initial_peers, self.cfg.averaging.request_timeout)

    def state_changed(self, commits_first: bool = False) -> None:
        """Our θ_global moved (commit or download): tell the roster, and serve the new state."""
        self.publish(commits_first=commits_first)
        self.averager.serve_state(self.donate_state, self.state.round)

    def stop(self) -> None:
        """Stop the heartbeat without announcing a leave: the network stack is restarting (net/supervise.py) and a
        new membership takes over under the same peer id."""
        self._closed.set()

    def leave(self) -> None:
        """Announce a graceful leave (others stop counting and waiting for us) and stop serving state; if we trained
        all of ``run.rounds``, say so for longer than a roster entry lives, for peers that finish later."""
        self._closed.set()
        self.publish(leaving=True)
        rounds = self.cfg.run.rounds
        if rounds is not None and self.state.round >= rounds:
            publish_finished(self.dht, self.prefix, self.peer_id, self.name, self.state.round, ttl=FINISHED_TTL,
                             timeout=self.cfg.averaging.request_timeout)
        self.averager.stop_serving()

    # ------------------------------------------------------------------------------------------------ waiting
    def wait_for_round(self, round_: Optional[int]) -> None:
        """``run.join_after_round``: watch the roster, unseen by others, until the run reaches ``round_``."""
        while round_ is not None and not self.stop_event.is_set():
            if max((s.round for s in self.live_roster()), default=0) >= round_:
                return
            self.stop_event.wait(0.5)  # the roster lives in the DHT: there is no event to wait on, so poll

    def wait_for_expected_peers(self) -> None:
        """Before round 1, wait (bounded) until ``run.expected_peers`` peers are in the run, or most of them are
        past round 0 (the run started without us). Not as soon as one entry is: a stranger's claim of round 10^9
        would be all the roster holds, and a peer that looked then would follow it (CI's roster-attack test)."""
        expected = self.cfg.run.expected_peers
        if expected <= 1 or self.state.round > 0:
            return
        deadline = time.monotonic() + self.cfg.run.expected_peers_timeout
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            roster = self.live_roster()
            # only entries at a round we could follow: with a stranger's claim of round 10^9 counted as present,
            # two of three peers started the run without the third, which then waited out its whole timeout (CI)
            credible = credible_rounds(self.status(), [s for s in roster if s.peer_id != self.peer_id])
            present = [s for s in roster if s.round in credible]
            started = {s.peer_id for s in present if s.round > 0}
            if len(present) >= expected or 2 * len(started) > expected:
                return  # everyone is here, or most of the run started without us: join it
            self.log.info(f"waiting for peers: {len(present)} of {expected} present")
            self.stop_event.wait(1.0)  # the roster lives in the DHT: there is no event to wait on, so poll
        self.log.warning(f"starting without the {expected} expected peers")

    def check_initial_state(self, source: str) -> None:
        """``model.init_from``: before round 1, compare our θ_global with that of the other peers at round 0.
        Raises ConfigError (exit 2) if most of them (ties as in :func:`majority_state`) start from other bytes: a
        checkpoint that differs between machines (another hub revision, other files) must not be averaged in."""
        others = [s for s in self.live_roster() if s.round == 0 and s.peer_id != self.peer_id]
        if not others:
            return
        _, run_digest = majority_state([(0, s.digest) for s in others] + [(0, self.state.digest)])
        if run_digest != self.state.digest:
            raise ConfigError(f"model.init_from: '{source}' gives us initial weights {self.state.digest[:12]}, but "
                              f"the run starts from {run_digest[:12]}: every peer must load the same checkpoint "
                              f"(same hub revision, same files)")
        differ = sorted(s.name for s in others if s.digest != self.state.digest)
        self.log.info(f"initial θ_global ({self.state.digest[:12]}, from {source}) agrees with "
                      f"{len(others) - len(differ)} other peer(s)" + (f"; {', '.join(differ)} start from other "
                                                                     f"weights and will stop" if differ else ""))

    def run_is_over(self, roster: list[PeerStatus]) -> bool:
        """True if the run finished without us (:func:`consensus.finished_without`): every other peer left after
        training all of ``run.rounds``, or more than half of the group that committed our θ_global did. The
        finished list is read every round (one DHT read): the finishers' roster entries expire
        ``averaging.roster_ttl`` after they left, while a straggler's failing attempts can take longer than that."""
        rounds = self.cfg.run.rounds
        if rounds is None:
            return False
        others = [s for s in roster if s.peer_id != self.peer_id]
        # those that left after the last round: in the roster, or (entries expired) in the finished list
        recorded = read_finished(self.dht, self.prefix, self.cfg.averaging.request_timeout)
        group = [p for p in getattr(self.state, "quorum", ()) if p != self.peer_id]
        finished = finished_without(rounds, others, recorded, group)
        if finished:
            self.log.warning(f"the run finished without us: {len(finished)} peer(s) ({', '.join(finished[:8])}"
                             f"{', …' if len(finished) > 8 else ''}) left after round {rounds}; stopping at round "
                             f"{self.state.round}")
            return True
        return False

    # ------------------------------------------------------------------------------------------------ state
    def behind(self, live_roster: list[PeerStatus]) -> Optional[SyncTarget]:
        """The run's state to fetch before contributing, if the run moved past our θ_global or most peers hold other
        bytes for our round and some donor serves it; else None. A round the run reached is remembered
        (:attr:`known_round`) until we hold it or no live peer holds it or a later one."""
        me = self.status()
        others = [s for s in live_roster if s.peer_id != me.peer_id and not s.leaving]
        if self.known_round <= me.round or not remembered(self.known_round, max(credible_rounds(me, others)), others):
            self.known_round = 0
        target = sync_target(me, live_roster, self.known_round)
        if target is None:
            return None
        if target.round > me.round:
            self.known_round = max(self.known_round, target.round)
        if not target.donors:
            self.log.warning(f"behind the run (round {target.round}) but no donor serves that state yet")
            return None
        return target
