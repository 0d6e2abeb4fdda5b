"""The averaging seam a peer uses (:class:`Averager`): shared pseudo-gradient buffers, one ``average()`` (or
``start_average()``, for overlap) per round, state serving and downloads; the all-reduce itself runs in
averager.py's process."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import time
from dataclasses import asdict, replace
from concurrent.futures import InvalidStateError
from typing import Iterator, Optional, Sequence

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import MPFuture, get_dht_time

from p2p_diloco.net.averaging.aggregators import Aggregator
from p2p_diloco.config import AveragingConfig
from p2p_diloco.net.averaging.codecs import ErrorFeedback
from p2p_diloco.net.deadlines import DeadlineEstimator
from p2p_diloco.net.averaging.wire import WireCodec, payload_bytes
from p2p_diloco.net.averaging.contribution import AverageResult, Contribution
from p2p_diloco.net.averaging.averager import CanonicalAverager
from p2p_diloco.net.averaging.survive import ABANDONED
from p2p_diloco.net.averaging.state_pipe import receive_tensors
from p2p_diloco.net.failfast import GuardedPipe, HelperDied, close_host_side
from p2p_diloco.ops.faults import AVERAGER_PHASES


logger = logging.getLogger(__name__)


class Averager:
    """The averaging seam used by a peer: shared pseudo-gradient buffers and one ``average()`` call per round.

    The buffers are allocated once (in shared memory) with the shapes of the model's parameters. A round writes the
    pseudo-gradient into them inside ``with averager.pseudo_grads() as bufs:``, then calls :meth:`average`; if the
    result is ``ok``, the buffers hold the canonical weighted average, bit-identical on every peer of the group.
    ``error_feedback`` (an :class:`~p2p_diloco.net.codecs.ErrorFeedback`, or None when off) is the peer's to use:
    add its residual to the pseudo-gradient before averaging, commit it with the round.
    """

    def __init__(self, dht, cfg: AveragingConfig, prefix: str, shapes: Sequence[torch.Size], *,
                 client_mode: bool = False, expected_group_size: Optional[int] = None, fault=None,
                 weight_by_tokens: bool = True, attack=None, access=None, equivocate_from: Optional[int] = None):
        self.cfg = cfg
        self.access = access  # net/auth.Access of a private run, None in an open run
        self.client_mode = client_mode
        self.fault = fault
        self.suspects: dict[str, int] = {}  # peer id -> the last round we leave it out of (a reducer named it)
        self._offenses: dict[str, int] = {}
        buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        # error feedback's pending residual is written by the averager's process: allocate it (shared) before the fork
        self.error_feedback = ErrorFeedback(shapes) if cfg.error_feedback else None
        codec = self._codec = WireCodec(cfg.codec, cfg.part_size_bytes,
                                        residuals=self.error_feedback.pending if self.error_feedback else None)
        self._averager = CanonicalAverager(
            buffers, dht, start=True, prefix=prefix, codec=codec, min_participants=cfg.min_group_size,
            average_codec=WireCodec(cfg.average_codec or cfg.codec, cfg.part_size_bytes),
            fault=fault if fault is not None and fault.phase in AVERAGER_PHASES else None, attack=attack,
            aggregator=Aggregator(cfg.aggregator, cfg.clip_multiple, cfg.centered_clip_iters, cfg.trim_fraction),
            weight_by_tokens=weight_by_tokens, max_weight_ratio=cfg.max_weight_ratio,
            access_keys=access.keys if access else None, revoked=access.revoked if access else frozenset(),
            verify_parts=cfg.verify_parts, max_share=cfg.max_share, equivocate_from=equivocate_from,
            survive_losses=cfg.survive_losses,
            target_group_size=expected_group_size or cfg.target_group_size, min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time, request_timeout=cfg.request_timeout,
            allreduce_timeout=cfg.allreduce_timeout, next_chunk_timeout=cfg.next_chunk_timeout,
            part_size_bytes=cfg.part_size_bytes, client_mode=client_mode, allow_state_sharing=False,
            shutdown_timeout=5)
        # every command to its process fails at once once it is gone, and what waits on it stops waiting (abandon)
        self._averager._outer_pipe = GuardedPipe(self._averager._outer_pipe, self)
        self._group_size = expected_group_size or cfg.target_group_size
        payload = payload_bytes(sum(b.numel() for b in buffers), cfg.codec, cfg.average_codec)
        self._estimator = DeadlineEstimator(cfg.allreduce_timeout, cfg.next_chunk_timeout, cfg.part_size_bytes,
                                            payload_bytes=payload,
                                            matchmaking_floor=cfg.matchmaking_time)
        self.deadlines = self._estimator.deadlines(self._group_size)
        self._pending: Optional[PendingAverage] = None  # an all-reduce under way (start_average)
        self._leading = True  # whether this peer declares itself as a leader in matchmaking (start_average)
        self._quorum: list[str] = []  # what the averager's process counts the quorum over (start_average)
        self.gone: Optional[str] = None  # why this averager can no longer work (net/supervise.py): calls fail at once

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    @contextlib.contextmanager
    def pseudo_grads(self) -> Iterator[Sequence[torch.Tensor]]:
        """The shared buffers; the averager does not touch them while this context is open."""
        if self._pending is not None:
            raise RuntimeError("the buffers belong to an all-reduce under way: take its result() first")
        lock = self._averager.lock_averaged_tensors  # what get_tensors() takes, without waiting forever for it
        while not lock.acquire(timeout=1.0):
            if not self._averager.is_alive():  # it died holding the lock (mid all-reduce): the buffers are ours alone
                yield self._averager._averaged_tensors
                return
        try:
            yield self._averager._averaged_tensors
        finally:
            lock.release()

    @property
    def matchmaking_timeout(self) -> float:
        """How long a peer may look for a group (s): two matchmaking windows plus a request round trip."""
        return 2 * self.deadlines.matchmaking_time + self.cfg.request_timeout

    def _scheduled_time(self, lead: bool) -> float:
        """When this round's group starts at the latest (DHT time). The leader gathers for one matchmaking window
        (a full group, every live peer, starts at once); a follower accepts a leader whose window ends up to two
        windows from its own arrival (hivemind refuses a follower whose own deadline is earlier than the leader's),
        so the leader may arrive up to one window after it."""
        return get_dht_time() + self.deadlines.matchmaking_time * (1 if lead else 2)

    def observe_round(self, seconds: float) -> None:
        """A whole round's wall time (inner steps and averaging), for the matchmaking window."""
        self._estimator.observe_round(seconds)

    def average(self, contribution: Contribution, weight: float) -> AverageResult:
        """Find a group and all-reduce the buffers; never raises, never waits beyond the configured timeouts."""
        return self.start_average(contribution, weight).result()

    def start_average(self, contribution: Contribution, weight: float, lead: bool = True,
                      quorum: Sequence[str] = (), watch=None) -> "PendingAverage":
        """Start :meth:`average` in the averager's process and return at once (``diloco.overlap``). Until the
        pending average's ``result()`` is taken, the buffers belong to the averager: :meth:`pseudo_grads` refuses.

        ``lead``: this peer is the round's designated leader (net/consensus.py designated_leader) and gathers the
        group; otherwise it only joins the leader's group, so that one group forms per round, not several racing
        ones. Every peer leading (the default) is hivemind's own matchmaking. ``quorum``: the peer ids of the group
        that committed our θ_global's round (GlobalState.quorum), which the group's quorum is counted over.
        ``watch``: called about once a second while we look for a group, returns why to stop looking (the leader we
        wait for is dead) or None (:class:`PendingAverage`)."""
        self._update_deadlines()
        if lead != self._leading:
            self._leading = lead
            self._averager._outer_pipe.send(("_set_leading", [], dict(leading=lead)))
        if list(quorum) != self._quorum:
            self._quorum = list(quorum)
            self._averager._outer_pipe.send(("_set_quorum", [], dict(quorum=self._quorum)))
        contribution = replace(contribution, suspects=[p for p, last in self.suspects.items()
                                                       if last > contribution.round])
        pending = PendingAverage(self, contribution, watch)
        if self.down_reason() is not None:
            pending.error = f"HelperDied: {self.down_reason()}"
            self._pending = pending
            return pending
        try:
            contribution = replace(contribution, proof=self._proof())
            pending.control = self._averager.step(gather=asdict(contribution), weight=float(weight), wait=False,
                                                  scheduled_time=self._scheduled_time(lead),
                                                  timeout=self.matchmaking_timeout, allow_retries=False)
            if self.fault is not None and self.fault.due("matchmaking", contribution.round + 1):
                self._strike_in_matchmaking(pending.control)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            pending.error = _one_line(e)
        self._pending = pending
        return pending

    def _finish(self, out: dict, seconds: float, round_: int) -> AverageResult:
        result = AverageResult(ok=out["member_of"] and "error" not in out, group_size=len(out["members"]),
                               peers=out["members"], tokens=out["tokens"], bytes_sent=out.get("bytes_sent", 0),
                               bytes_received=out.get("bytes_received", 0), seconds=seconds,
                               allreduce_seconds=out["allreduce_seconds"], group_round=out["group_round"],
                               speeds=out["speeds"], reducer_bytes=out.get("reducer_bytes", 0),
                               malformed=out.get("malformed", {}), quorum=out.get("quorum", []),
                               check_s=out.get("check_s", 0.0), check_messages=out.get("check_messages", 0),
                               check_bytes=out.get("check_bytes", 0))
        if "error" in out:
            result.error = out["error"]
            self._suspect(result.malformed, round_)
            return result
        self._estimator.observe(out["bytes_sent"] + out["bytes_received"], out["allreduce_seconds"])
        if not out["member_of"]:
            result.stale, result.error = True, f"the group averaged round {out['group_round']} of another θ_global"
        return result

    def _suspect(self, malformed: dict, round_: int) -> None:
        """Members a reducer refused: left out of our averages for suspect_rounds committed rounds after round_ − 1
        (doubled at each repeat), by naming them in our contributions (a majority of members must agree)."""
        for peer in malformed:
            if peer == self.peer_id or not self.cfg.suspect_rounds:
                continue
            self._offenses[peer] = self._offenses.get(peer, 0) + 1
            self.suspects[peer] = round_ - 1 + self.cfg.suspect_rounds * 2 ** (self._offenses[peer] - 1)
            logger.warning(f"member {malformed[peer][0]} ({peer}) sent a malformed contribution "
                           f"({malformed[peer][1]}): left out of our averages through round {self.suspects[peer]}")

    def serve_state(self, provider, round_: int) -> None:
        """Offer our state to joiners: ``provider() -> (metadata, tensors)``; donors of later rounds are preferred."""
        if self.client_mode:
            return  # unreachable peers cannot serve
        self._averager.state_provider = provider
        self._averager.state_sharing_priority = float(round_ + 1)
        self._averager.allow_state_sharing = True
        if self.fault is not None and self.fault.phase == "serving" and round_ + 1 >= self.fault.round:
            # the averager process holds its own copy of the fault: arm it there for this round only
            self._averager._outer_pipe.send(("_arm_fault", [], dict(fault=self.fault)))

    def stop_serving(self) -> None:
        if self._averager.allow_state_sharing:
            self._averager.allow_state_sharing = False

    def download_state(self, donors: Sequence[str]):
        """Fetch (metadata, tensors, donor) from the first of ``donors`` that answers; None if none did.

        Each donor gets ``averaging.state_timeout`` seconds; at most ``averaging.state_attempts`` donors are tried.
        """
        donors = list(donors)[: self.cfg.state_attempts]
        if not donors or self.down_reason() is not None:
            return None
        future, (reader, sink) = MPFuture(), mp.Pipe(duplex=False)  # the tensors come through the pipe (state_pipe.py)
        self._averager._outer_pipe.send(("_download_state", [], dict(future=future, donors=donors, sink=sink,
                                                                       timeout=self.cfg.state_timeout)))
        sink.close()  # the averager's process holds the only writing end now: its death reads as EOF
        try:
            got = future.result(timeout=self.cfg.state_timeout * len(donors) + 10)
            if got is None:
                return None
            metadata, specs, donor = got
            return metadata, receive_tensors(reader, specs, self.cfg.state_timeout), donor
        except Exception as e:
            logger.warning(f"state download failed: {_one_line(e)}")
            return None
        finally:
            reader.close()

    def _proof(self) -> str:
        return self.access.keys.proof(self._averager.peer_id.to_bytes()).hex() if self.access else ""

    def access_changed(self) -> None:
        """A new secret or revocations (net/auth.Access.refresh): tell the averager's process."""
        self._averager._outer_pipe.send(("_set_access", [], dict(keys=self.access.keys,
                                                                 revoked=self.access.revoked)))

    def set_group_size(self, size: int) -> None:
        """Start each round's all-reduce as soon as ``size`` peers (the live roster) have gathered. Not capped at
        ``averaging.target_group_size``: a round's group is every live peer, since two groups of one round could
        not both commit (net/consensus.py has_quorum); the butterfly moves 2(N−1)/N × payload per peer whatever N."""
        size = max(self.cfg.min_group_size, size)
        if size != self._group_size:
            self._group_size = size
            self._averager._outer_pipe.send(("_set_target_group_size", [], dict(size=size)))

    def _update_deadlines(self) -> None:
        """Deadlines for the coming round from measurements (p2p_diloco/net/deadlines.py); sent to the averager."""
        deadlines = self._estimator.deadlines(self._group_size)
        if deadlines != self.deadlines:
            self.deadlines = deadlines
            # step() reads the matchmaking window in this process, the matchmaker in the averager process
            self._averager.matchmaking_kwargs["min_matchmaking_time"] = deadlines.matchmaking_time
            self._averager._outer_pipe.send(("_set_deadlines", [], asdict(deadlines)))

    def _strike_in_matchmaking(self, control) -> None:
        """Fault injection: fail while the averager looks for a group (declared in the DHT, or being joined)."""
        while control.stage == AveragingStage.IDLE and not control.done():
            time.sleep(0.01)  # the stage lives in the averager process; it changes within milliseconds
        time.sleep(0.2)  # let the declaration reach the DHT, so that others may be grouping with us
        self.fault.strike()

    def abandon(self, reason: str) -> None:
        """A helper this averager depends on died (net/supervise.py; any thread): the all-reduce and the state
        download under way fail now, later calls at once. :meth:`close` then ends its process."""
        self.gone = self.gone or reason
        self._averager._outer_pipe.fail_all(self.gone)  # step(), its result, a state download: all stop waiting
        pending = self._pending
        if pending is not None and pending.control is not None and not pending.control.done():
            try:
                pending.control.set_exception(HelperDied(reason))
            except Exception:  # noqa: BLE001 - it was answered meanwhile
                pass

    def down_reason(self) -> Optional[str]:
        """Why this averager can no longer work, or None (for its GuardedPipe)."""
        if self.gone is None and not self._averager.is_alive():
            return f"the averager process died (exit {self._averager.exitcode})"
        return self.gone

    def close(self, timeout: Optional[float] = None) -> None:
        """End the averager's process: gracefully within ``timeout`` seconds (its own 5 s if None), else killed."""
        if self._averager.is_alive():
            if self.gone is not None:  # its p2pd or DHT is gone: a graceful shutdown could only time out
                self._averager.kill()
                self._averager.join(5)
            else:
                if timeout is not None:
                    self._averager.shutdown_timeout = timeout
                self._averager.shutdown()

    def release(self) -> None:
        """After :meth:`close`, before a new network stack is forked (net/joining.py rejoin): drop this averager's
        shared buffers (the averaging tensors, error feedback's pending residual). Helper processes forked while
        they are alive inherit their /dev/shm descriptors and keep them for life: one model copy per restart
        (benchmarks/soak.md). The object is unusable afterwards."""
        self._averager._averaged_tensors = ()
        self._averager._state_pipe.close()
        close_host_side(self._averager)  # its command and sentinel pipes, and the thread reading them
        self._codec.residuals = None
        if self.error_feedback is not None:
            self.error_feedback.pending = []


class PendingAverage:
    """An all-reduce under way in the averager's process (:meth:`Averager.start_average`)."""

    def __init__(self, averager: Averager, contribution: Contribution, watch=None):
        self.averager, self.contribution = averager, contribution
        self.watch = watch  # () -> why to stop looking for a group, or None (Averager.start_average)
        self.abandoned: Optional[str] = None  # why we asked to stop looking (the step then fails with it: nothing sent)
        self.control = None  # hivemind's StepControl, once the step has started
        self.error: Optional[str] = None  # the step failed to start
        self.started = time.perf_counter()
        self.waited = 0.0  # seconds result() blocked its caller
        self._result: Optional[AverageResult] = None

    def done(self) -> bool:
        return self._result is not None or self.control is None or self.control.done()

    def exchanging(self) -> bool:
        """Its group has formed and the averager's process is encoding, sending, reducing and decoding parts now
        (matchmaking, the wait for the group, is not counted)."""
        return self._result is None and self.control is not None and not self.control.done() \
            and self.control.stage == AveragingStage.RUNNING_ALLREDUCE

    def result(self) -> AverageResult:
        """The outcome; waits at most for the matchmaking and all-reduce deadlines. Never raises; frees the buffers."""
        if self._result is None:
            begun = time.perf_counter()
            self._result = self._wait()
            self.waited = time.perf_counter() - begun
            if self._result.error and "NoQuorum" in self._result.error:  # averager.py: the group was too small
                self.averager._estimator.no_quorum()
            if self.averager._pending is self:
                self.averager._pending = None
        return self._result

    def _wait(self) -> AverageResult:
        if self.control is None:
            return AverageResult(ok=False, seconds=time.perf_counter() - self.started, error=self.error)
        budget = self.averager.matchmaking_timeout + self.averager.deadlines.allreduce_timeout + 10
        until = time.perf_counter() + max(5.0, self.started + budget - time.perf_counter())
        try:  # the budget runs from the start: a round that trained meanwhile does not extend it
            out = self._result_until(until)
        except BaseException as e:
            if not self.control.done():
                with contextlib.suppress(InvalidStateError):  # it ended meanwhile
                    self.control.cancel()
            if isinstance(e, KeyboardInterrupt):
                raise
            abandoned = bool(self.abandoned) and ABANDONED in str(e)  # averaging/survive.py ended our matchmaking
            return AverageResult(ok=False, seconds=time.perf_counter() - self.started, abandoned=abandoned,
                                 error=f"{ABANDONED}: {self.abandoned}" if abandoned else _one_line(e))
        return self.averager._finish(out, time.perf_counter() - self.started, self.contribution.round + 1)

    def _result_until(self, until: float) -> dict:
        """The step's output, waited for in slices: a helper found dead meanwhile ends the wait at once."""
        while True:
            try:
                return self.control.result(timeout=min(1.0, max(0.0, until - time.perf_counter())))
            except TimeoutError:
                reason = self.averager.down_reason()
                if reason is not None:
                    raise HelperDied(reason) from None
                if time.perf_counter() >= until:
                    raise
                self._look_out()

    def _look_out(self) -> None:
        """While we look for a group: if ``watch`` says why to stop, ask the averager's process to end our
        matchmaking (it does only if no group holds us yet: averaging/survive.py ``_abandon_matchmaking``)."""
        if self.watch is None or self.abandoned or self.control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return
        why = self.watch()
        if why:
            self.abandoned = why
            self.averager._averager._outer_pipe.send(("_abandon_matchmaking", [], dict(reason=why)))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]
