"""A round's contribution out and its average back: at once (``diloco.overlap = "none"``), or behind the next
round's inner steps (``"delayed"``, ``"eager"``; the bookkeeping is train/overlap.py).

At the end of each round's inner steps the peer calls :meth:`Exchange.settle`: the all-reduce in flight, if any, is
waited for within its deadlines and committed if good; with overlap θ_local is then moved to where the next round
starts and the contribution that goes out next is set. Once caught up with the run, :meth:`Exchange.start` puts the
contribution into the averager's buffers and starts its all-reduce in the averager's process (which encodes,
decodes and reduces; the peer's process does not touch the buffers until the result is taken); without overlap the
peer settles it at once. With overlap the all-reduce of round t runs while round t+1 trains and is committed at
round t+1's end, so a peer's committed round lags its training by one round.

With ``diloco.overlap_steps`` τ > 0 (delayed only), the inner steps call :meth:`Exchange.settle_due` before each
step and the all-reduce in flight is settled after τ steps of round t+1 instead (the peer waits there, within the
same deadlines, if it has not ended): θ_global takes its step and θ_local follows it, keeping the τ steps' work,
which goes out at round t+1's end with the rest of that round's (overlap.py: its ``advance`` with nothing in flight
adds the rest). The settled outcome is kept and returned by the round-end :meth:`Exchange.settle`, so the round
loop logs and reports it where it always does.

Committing is the same in every mode: if the average is finite, θ_global and the outer state take the outer step
(bit-identical on every member) and error feedback keeps the residual of the committed contribution. Only θ_local
differs: without overlap it becomes θ_global; with overlap it goes on from θ_global + offset (overlap.py).

A failed all-reduce in flight (a member died, a deadline passed) commits nothing; its contribution stays owed and
goes out again, with the work of the round trained meanwhile, at the end of that round. While one is in flight the
buffers are the averager's: catching up with the run (a state download, rebasing) waits for the round's end, when
the all-reduce has been settled.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.net import consensus
from p2p_diloco.net.watches import LeaderWatch, RunWatch, StopWatch, Watches
from p2p_diloco.train.overlap import Overlap


@dataclass
class Settled:
    """An all-reduce's outcome, as the round loop logs it."""
    result: object          # net.averaging.AverageResult
    committed: bool
    waited_s: float         # how long the round loop was blocked on it
    ended: float            # time.perf_counter() when its result was taken
    after_steps: Optional[int] = None  # settled after this many inner steps of a round (diloco.overlap_steps);
    #                                    None: when the round's steps ended
    paused_s: float = 0.0  # settled after τ steps: how long the inner steps paused for it (the wait, the outer step)


class _SatOut:
    """A round this peer did not average in (:meth:`Exchange.start`): settled at once, as a failed attempt."""

    def __init__(self, result):
        self.outcome, self.waited, self.contribution = result, 0.0, None  # nothing sent: nothing to commit

    def done(self) -> bool:
        return True

    def exchanging(self) -> bool:
        return False

    def result(self):
        return self.outcome


RESTARTS = 3  # how many dead leaders one attempt passes over before it fails (Exchange.settle)


def _run_moved(pending) -> bool:
    """Our wait for a group ended because the run committed our round's successor without us (RunWatch)."""
    watch = getattr(pending, "watch", None)
    return bool(getattr(watch, "run_moved", False))


class Exchange:
    """The averaging step of one peer's rounds; ``peer`` is the :class:`~p2p_diloco.peer.Peer` it belongs to."""

    def __init__(self, peer, mode: str):
        self.peer = peer
        shapes = [p.shape for p in peer.state.params]
        self.overlap: Optional[Overlap] = Overlap(mode, shapes) if mode != "none" else None
        self.pending = None         # net.averaging.PendingAverage: the all-reduce in flight
        self.share = 0.0            # our share of the last committed average's weight (eager)
        self.peers = max(1, peer.cfg.run.expected_peers)  # the group we expect (eager's share before any commit)
        self.run_size = consensus.RunSize(floor=peer.cfg.run.expected_peers)  # the quorum's floor (net/consensus.py)
        self.announced_speed = 0.0  # the inner-step speed we announced with our last contribution (DyLU)
        self.last_group: tuple[int, frozenset] = (0, frozenset())  # (round, member names) of our last commit
        self.leaders = consensus.Leaders()  # the leaders we pass over after a window without a group
        self._renewal = None  # the future of our last relay reservation's renewal (relayed peers)
        self._live_modes: list[str] = []  # the live peers' reachability when it started (explanations)
        self.settle_after = peer.cfg.diloco.overlap_steps if self.overlap is not None else 0  # τ; 0: round's end
        self._early: Optional[Settled] = None  # settled after τ steps, returned by the round-end settle()
        self._live: list = []  # the live roster our last contribution went out with (start)

    @property
    def overlapped(self) -> bool:
        return self.overlap is not None

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    @property
    def averaging(self) -> bool:
        """An all-reduce is exchanging parts in the averager's process right now (its group formed, not yet done)."""
        return self.pending is not None and self.pending.exchanging()

    # ------------------------------------------------------------------------------------------------ the round
    def settle_due(self, steps: int) -> float:
        """Before an inner step, ``steps`` done in this round: after τ = ``diloco.overlap_steps`` of them the
        all-reduce in flight is settled now (waited for, committed if good, θ_local following θ_global). Returns the
        seconds the inner steps paused for it: the wait, the outer step, θ_local's move (0.0 when nothing was due)."""
        if self.pending is None or steps != self.settle_after or not steps:
            return 0.0
        begun = time.perf_counter()
        self._early = self.settle()
        self._early.after_steps, self._early.paused_s = steps, time.perf_counter() - begun
        return self._early.paused_s

    def settle(self) -> Optional[Settled]:
        """End of a round's inner steps: the all-reduce in flight, waited for (within its deadlines) and committed
        if good; with overlap, also where θ_local goes on from and what goes out next. Returns the all-reduce's
        outcome (or the one :meth:`settle_due` settled during this round), or None if none was in flight."""
        settled, self._early = self._early, None
        work = self._work() if self.overlap is not None else None  # against θ_global before any outer step
        arrived = False  # an average holding our ``sent`` was committed just now
        if self.pending is not None:
            pending, self.pending = self.pending, None
            result, waited = pending.result(), pending.waited
            for _ in range(RESTARTS):  # the leader we waited for is dead: the next one, within this attempt
                if not result.abandoned or self.overlap is not None or _run_moved(pending) \
                        or self.peer.stop_event.is_set():  # StopWatch ended it: no next leader either
                    break
                self.leaders.no_group()
                self.peer.log.info(f"round {self.peer.round + 1}: {result.error}; looking for a group under the "
                                   f"next leader")
                self.start(self._live)
                pending, self.pending = self.pending, None
                result = pending.result()
                waited += pending.waited
            if not isinstance(pending, _SatOut):
                self._explain(result)
            arrived = result.ok and self._commit(result, pending.contribution.tokens)
            if arrived:
                self.run_size.committed(result.group_size)
                self.last_group = (self.peer.round, frozenset(result.peers))
            elif result.abandoned or result.error and "could not find a group" in result.error:
                self.leaders.no_group()
            elif result.error and "NoQuorum" in result.error:
                rounds = self.peer.cfg.run.rounds
                self.run_size.no_quorum(final=rounds is not None and self.peer.round + 1 >= rounds)
            if not arrived and not isinstance(pending, _SatOut):
                self._renew_relay()
            settled = Settled(result, arrived, waited, time.perf_counter())
        if self.overlap is not None:
            share = self.share or 1.0 / self.peers  # before any commit: an equal share
            self.overlap.advance(work, arrived, share, self.peer.state.outer.step_response)
            self._restart()
        return settled

    def start(self, live: list) -> None:
        """This round's contribution into the buffers, and its all-reduce started; returns at once. A peer that knows
        the run reached a round past its θ_global (net/membership.py ``known_round``) sends nothing: whatever group
        it formed below that round could commit a second θ_global for a round the run already committed."""
        from p2p_diloco.net.averaging import AverageResult, Contribution

        peer = self.peer
        known = peer.membership.known_round if peer.membership is not None else 0
        if known > peer.round:  # the run is past our θ_global and we could not fetch its state yet: sit this one out
            error = (f"behind the run: it reached round {known}, we hold round {peer.round} and could not fetch its "
                     f"state yet; not averaging below it")
            self.pending = _SatOut(AverageResult(ok=False, error=error))
            return
        self._live = live  # for a restart under the next leader (settle)
        self._live_modes = [s.reachability for s in live]
        self.peers = max(1, len(live)) if live else self.peers
        with peer.averager.pseudo_grads() as buffers:
            if self.overlap is None:
                peer.replica.pseudo_gradient(peer.state.params, buffers)
            else:  # settle() has set what goes out
                for b, s in zip(buffers, self.overlap.sent, strict=True):
                    b.copy_(s)
            if peer.error_feedback is not None:
                peer.error_feedback.add_to(buffers)  # what the wire lost of our last committed contribution
        weight = peer.tokens_since_commit if peer.cfg.diloco.weight_by_tokens else 1.0
        self.announced_speed = peer.pace.steps_per_s
        electorate, alive, lead, watch = 0, 0, True, None  # outside a swarm (tests): hivemind's matchmaking
        quorum, rounds = peer.state.quorum, peer.cfg.run.rounds
        if peer.membership is not None:
            me = peer.membership.status()
            live = consensus.with_my_group(me, live, self.last_group)  # entries our commit has not reached yet
            electorate = self.run_size.electorate(consensus.electorate(me, live))
            alive = consensus.alive_of(quorum, me, live, final=rounds is not None and peer.round + 1 >= rounds)
            leader = self.leaders.name(me, live, peer.state.quorum)
            lead = leader == me.peer_id
            watches = [StopWatch(peer.stop_event)]  # a stop ends our wait for a group (no all-reduce holds us)
            if not lead and leader and peer.dht is not None:
                watches += [LeaderWatch(peer.dht, leader, peer.cfg.averaging.request_timeout),
                            RunWatch(peer.membership, peer.round)]
            watch = Watches(*watches)
            peer.averager.set_group_size(self._group_size(me, live, lead))
        contribution = Contribution(name=peer.name, round=peer.round, digest=peer.state.digest,
                                    tokens=peer.tokens_since_commit, steps_per_s=self.announced_speed,
                                    electorate=electorate, live_quorum=alive)
        self.pending = peer.averager.start_average(contribution, weight, lead=lead, quorum=quorum, watch=watch)

    def _group_size(self, me, live: list, lead: bool) -> int:
        """How many peers our group waits for (consensus.expected_group): the live roster, and the peers that
        committed our round that the read missed and that still answer a ping (asked only by the leader, whose
        group it is: a dead member of the list would cost the round the leader's whole window)."""
        peer = self.peer
        floor = peer.cfg.run.expected_peers if peer.round == 0 else 0  # round 1: the run's declared size
        listed = set(peer.state.quorum) - {s.peer_id for s in live} - set(peer.membership.left) - {me.peer_id}
        if not lead:
            return consensus.expected_group(me, live, floor=floor)
        # and the live entries that missed two heartbeats: a member killed since keeps its entry for roster_ttl, and
        # a group that counts it waits the leader's whole window for it (measured at 16 peers with a kill each
        # round: the wait did not change beyond noise, it is dominated by the rounds a sender died in: scale.md)
        stale = peer.membership.stale() & {s.peer_id for s in live} - {me.peer_id}
        if (listed or stale) and peer.dht is not None:
            from p2p_diloco.net.dht import answering

            answered = answering(peer.dht, sorted(listed | stale), min(2.0, peer.cfg.averaging.request_timeout))
            listed, live = listed & answered, [s for s in live if s.peer_id not in stale - answered]
        return consensus.expected_group(me, live, listed, floor=floor)

    def _renew_relay(self) -> None:
        """After a failed attempt, a relayed peer renews its reservation at its relay (net/nat.py
        ``renew_reservation``), in the background; a renewal that failed the time before is said."""
        peer = self.peer
        if getattr(peer, "relay", None) is None or peer.dht is None:
            return
        from p2p_diloco.net import nat

        last = self._renewal
        try:
            self._renewal = nat.renew_reservation(peer.dht, peer.relay)
        except Exception as e:  # noqa: BLE001 - a dead DHT process: the supervisor restarts the stack next round
            self._renewal = None
            peer.log.debug(f"relay: no renewal ({e!r})")
        if last is not None and last.done() and not last.cancelled() and last.exception() is None \
                and last.result() is None:
            peer.log.warning(f"relay: our reservation at {peer.relay.relay} could not be renewed; peers that cannot "
                             f"dial us directly may not reach us until it is")

    def _work(self) -> list[torch.Tensor]:
        work = [torch.empty_like(p) for p in self.peer.state.params]
        self.overlap.work(self.peer.state.params, self.peer.replica.params, work)
        return work

    def _restart(self) -> None:
        self.overlap.restart(self.peer.replica.params, self.peer.state.params)
        self.peer.replica.broadcast_local()  # θ_local changed on rank 0 only

    def _explain(self, result) -> None:
        """Name the cause and the fix of a failed round when it is reachability."""
        peer = self.peer
        if not result.ok and peer.membership is not None:
            from p2p_diloco.net.reachability import explain_no_group

            result.error = explain_no_group(peer.membership.reachability, self._live_modes,
                                            peer.relay_issue) or result.error

    def _commit(self, result, tokens: int) -> bool:
        """The outer step with the averaged Δ, unless Δ is not finite (then every member rejects it alike)."""
        peer = self.peer
        with peer.averager.pseudo_grads() as averaged:
            if not all(torch.isfinite(d).all() for d in averaged):
                result.error = "the averaged pseudo-gradient is not finite: round rejected"
                return False
            peer.state.apply(averaged, num_contributions=result.group_size, members=result.peers,
                             quorum=result.quorum)
            if peer.error_feedback is not None:
                peer.error_feedback.commit()
        if self.overlap is None:
            peer.replica.load(peer.state.params)
            peer.tokens_since_commit, peer.work_round = 0, peer.round
        else:  # the work of the round just trained is not in this average: it goes out next
            self.share = tokens / result.tokens if peer.cfg.diloco.weight_by_tokens and result.tokens else \
                1.0 / max(1, result.group_size)
            peer.tokens_since_commit -= tokens
            peer.work_round = peer.round - 1
        if peer.membership is not None:
            peer.membership.committed()
        return True

    # ------------------------------------------------------------------------------------------------ catching up
    def local_work(self, out) -> None:
        """All our work not yet in θ_global, into ``out``: θ_global − θ_local, or with overlap what goes out next
        plus what was trained since."""
        peer = self.peer
        if self.overlap is None:
            peer.replica.pseudo_gradient(peer.state.params, out)
            return
        self.overlap.work(peer.state.params, peer.replica.params, out)
        for o, s in zip(out, self.overlap.sent, strict=True):
            o.add_(s)

    def moved(self, work) -> None:
        """θ_global was replaced by the run's and ``work`` (from :meth:`local_work`) is rebased onto it
        (θ_local ← θ_global − work): it is what we contribute next. In both overlap modes θ_local then holds our
        whole work as plain DiLoCo would (eager's head start is not taken on a rebased round)."""
        if self.overlap is not None:
            for s, o, w in zip(self.overlap.sent, self.overlap.offset, work, strict=True):
                s.copy_(w)
                torch.neg(w, out=o)

    def dropped(self) -> None:
        """θ_global was replaced by the run's and our work dropped: θ_local is θ_global, nothing is owed."""
        if self.overlap is not None:
            self.overlap.drop()

    # ------------------------------------------------------------------------------------------------ θ_global
    @contextlib.contextmanager
    def global_in_model(self, shards: bool = False):
        """The model (rank 0's) holds θ_global inside this block (evaluation, export, samples); with overlap
        θ_local, which is θ_global + offset between rounds, is put back after (the same bytes: same operands).
        ``shards``: a sharded peer's shards hold it too (its evaluation runs through them): with overlap θ_global is
        scattered to them, and θ_local back after (without overlap they hold θ_global already)."""
        from p2p_diloco.train.transfer import load_params

        peer = self.peer
        if self.overlap is not None:
            load_params(peer.replica.params, peer.state.params)
            if shards:
                peer.replica.broadcast_local()
        try:
            yield
        finally:
            if self.overlap is not None and shards:
                self._restart()  # θ_local on the host, and scattered to the shards
            elif self.overlap is not None:
                self.overlap.restart(peer.replica.params, peer.state.params)

    def state_dict(self) -> Optional[dict]:
        return self.overlap.state_dict() if self.overlap is not None else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A resumed peer: the all-reduce that was in flight when the checkpoint was written counts as failed (its
        contribution is owed again; if the others committed it with us, catching up finds that and drops it)."""
        if self.overlap is not None and state is not None:
            self.overlap.load_state_dict(state)
