"""A DiLoCo peer: start → run → close. ``Peer.run`` owns the round loop.

One round: check that our θ_global is the run's (else fetch it from a peer that has it, rebasing our local work
onto it); H_i inner AdamW steps on θ_local (DyLU: H_i from our measured speed against the fastest live peer's, so
that rounds end together); if the run moved on while we trained, catch up again (rebase) so our work still counts;
δ = θ_global − θ_local into the averager's buffers; canonical all-reduce; if the round is good, the outer step on
θ_global and θ_local ← θ_global (commit); otherwise θ_global is left untouched and training continues from θ_local,
so the next round's pseudo-gradient carries this round's work too (roll back).

Overlap (``diloco.overlap``, net/exchange.py): the all-reduce of round t runs in the background while round t+1
trains and is settled (committed if good) at round t+1's end, or with ``diloco.overlap_steps`` τ after τ of its
inner steps (train/rounds.py asks the exchange before each step; the outcome is logged at the round's end as
always); catching up with the run waits for the round's end (the buffers are the averager's until the settle);
leaving or finishing waits for the all-reduce in flight.

Rebasing (``diloco.max_staleness``): when the peer replaces its θ_global by the run's (it missed rounds, was frozen,
resumed from an old checkpoint, or was in the minority), its local work δ = θ_global_old − θ_local is kept:
θ_local ← θ_global_new − δ, with its tokens still counted for the next contribution, unless the work began more than
``max_staleness`` rounds before the run's round, or the fetched state's history shows that our contribution of that
round is already in the run's average; then it is dropped. θ_global itself is only ever the run's.

Entering the swarm lives in :mod:`p2p_diloco.net.joining`; the roster, sync and state transfers in
:mod:`p2p_diloco.net.membership`; θ_global, the outer state and the round in
:class:`~p2p_diloco.train.global_state.GlobalState`; checkpoints, exports and text samples in
:mod:`p2p_diloco.ops.outputs`; a round's metrics record, log line and roster report in :mod:`p2p_diloco.ops.records`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.config import Config
from p2p_diloco.net import consensus, joining
from p2p_diloco.net.exchange import Exchange
from p2p_diloco.ops import outputs, records
from p2p_diloco.ops.faults import HOLD_FILE, parse_fault
from p2p_diloco.ops.stop import grace_left
from p2p_diloco.ops.metrics import MetricsSink, build_sink
from p2p_diloco.ops.standing import StandingSink
from p2p_diloco.train.global_state import GlobalState
from p2p_diloco.train.model import count_parameters, model_fingerprint
from p2p_diloco.train.outer import build_outer_optimizer, rebase, resolve_auto
from p2p_diloco.train.replica import Replica, build_training, join_ranks, share_setup
from p2p_diloco.train.rounds import InnerRounds
from p2p_diloco.train.transfer import host_copy

logger = logging.getLogger("p2p_diloco")


class Peer:
    """One replica of the run. ``averager`` may be injected (tests); otherwise ``start`` joins the swarm."""

    def __init__(self, cfg: Config, *, averager=None, stop_event: Optional[threading.Event] = None,
                 given: Optional[set[str]] = None):
        self.cfg = cfg
        self.given = given  # the config keys this peer set itself; the run's settings complete the others
        self.name = cfg.run.name or f"{socket.gethostname()}-{os.getpid()}"
        self.run_dir = Path(cfg.run.run_dir)
        self.stop_event = stop_event or threading.Event()
        self.averager = averager
        self.fault = parse_fault(cfg.fault.inject, hold_path=str(self.run_dir / HOLD_FILE))
        self.dht = None
        self.supervisor = None  # net.supervise.Supervisor once in a swarm: restarts a network stack whose helper died
        self.membership = None  # net.membership.Membership once in a swarm; None with an injected averager
        self.relay_issue: Optional[str] = None  # why our relay cannot serve us (client mode only), for explanations
        self.relay = None  # net.reachability.RelayInfo: our reservation, when we take part as relayed
        self.tokens_since_commit = 0  # weight of the next contribution
        self.work_round = 0  # the round of θ_global our uncommitted local work began from (its staleness)
        self.tokens_trained = 0  # tokens of all inner steps this peer has run in this run
        self.rounds = InnerRounds(self, self._publish_pace)  # each round's inner steps, planned by DyLU
        self.metrics: MetricsSink = MetricsSink()
        self._sampler = None  # ops.generate.Generator over self.model, made at the first text sample
        self.log = logger
        self._closed = self._ready = False
        self._last_loss = float("nan")  # the last round's mean training loss (logged with a drained all-reduce)
        self.run_round = 0  # the run's round at the round's last roster read (ops/standing.py, _run_round)

    # ------------------------------------------------------------------------------------------------ start
    def start(self) -> "Peer":
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.ranks = join_ranks(cfg.run)  # None unless torchrun started this peer as one process per GPU
        self._resolve_auto()
        if self.averager is None:
            joining.open_dht(self)  # before the model: the run's published settings may complete ours
            cfg = self.cfg
        share_setup(self.name, cfg, self.ranks)  # ranks > 0 take rank 0's name and (completed) config
        training = build_training(cfg, self.name, self.ranks)
        self.device, self.data, self.model, self.inner = training.device, training.data, training.model, training.inner
        self.replica = Replica(training, self.ranks, cfg)  # θ_local and the inner steps, on every rank
        params = host_copy(self.model.parameters(), pin=self.device.type == "cuda")  # θ_global: fp32, host
        outer = build_outer_optimizer(cfg.diloco.outer_optimizer, params, cfg.diloco.outer_lr,
                                      cfg.diloco.outer_momentum, cfg.diloco.dn_delay, cfg.diloco.dn_c)
        self.state = GlobalState(params, outer)
        self.exchange = Exchange(self, cfg.diloco.overlap)  # the averaging step, at once or behind the next round
        self.fingerprint = self._fingerprint()
        self.metrics = build_sink(cfg, self.run_dir, self.name)
        if self.averager is None:
            joining.join_swarm(self)  # stays out of the run until run.join_after_round
        resumed = outputs.resume(self)  # after that wait: a peer restarted in place takes its newest checkpoint
        self._ready = True  # our state is this run_dir's: close() may save it
        origin = f" from {cfg.model.init_from}" if cfg.model.init_from else ""
        self.log.info(f"model {count_parameters(self.model) / 1e6:.2f}M params{origin}, fingerprint "
                      f"{self.fingerprint}, device {self.device} x {self.replica.world} process(es)"
                      f"{', sharded' if self.replica.shards is not None else ''}, "
                      f"{'resumed at' if resumed else 'starting at'} round {self.round}")
        if not resumed:
            eval_loss = self._evaluate()
            self.metrics.log({"event": "start", "run_id": self.cfg.run.run_id, "peer": self.name,
                              "peer_id": self.peer_id, "round": self.round, "eval/loss": eval_loss,
                              "global_params_sha256": self.state.params_digest, "fingerprint": self.fingerprint})
            self.log.info(f"initial eval loss {eval_loss:.4f}")
        if self.membership is not None:
            self.membership.enter()
            joining.watch_network(self)  # a dead DHT process, p2pd or averager is found within seconds
            self.membership.wait_for_expected_peers()
            if cfg.model.init_from is not None and not resumed:
                self.membership.check_initial_state(cfg.model.init_from)
        return self

    def _resolve_auto(self) -> None:
        """Outer lr and momentum 'auto' -> numbers (train/outer.py auto_outer), before the run's settings are settled:
        the first peers publish the numbers and joiners adopt them, whatever their own run.expected_peers."""
        d = self.cfg.diloco
        auto = {f"diloco.{k}" for k in ("outer_lr", "outer_momentum") if getattr(d, k) == "auto"}
        resolved = resolve_auto(d, self.cfg.run.expected_peers)
        if self.given is not None:
            self.given = self.given - auto  # 'auto' given explicitly is not a value to insist on against the run's
        if resolved:
            self.log.info(f"auto outer step for {self.cfg.run.expected_peers} expected peers, H="
                          f"{d.inner_steps}: " + ", ".join(resolved))

    def _fingerprint(self) -> str:
        """Everything that must match for two peers to average: model shape, wire codec, outer rule."""
        d = self.cfg.diloco
        key = (f"{model_fingerprint(self.model)}|{self._wire_formats()}|{d.outer_optimizer}|{d.outer_lr}|"
               f"{d.outer_momentum}|{d.weight_by_tokens}")
        if d.outer_optimizer == "delayed_nesterov":
            key += f"|{d.dn_delay}|{d.dn_c}"
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def _wire_formats(self) -> str:
        a = self.cfg.averaging
        return a.codec if a.average_codec in (None, a.codec) else f"{a.codec}>{a.average_codec}"  # 16-bit: as before

    @property
    def peer_id(self) -> str:
        return getattr(self.averager, "peer_id", "")

    @property
    def error_feedback(self):
        """The averaging seam's :class:`~p2p_diloco.net.averaging.codecs.ErrorFeedback`, or None (off)."""
        return getattr(self.averager, "error_feedback", None)

    @property
    def round(self) -> int:
        """Rounds committed: the version of θ_global."""
        return self.state.round

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        """Train until ``run.rounds`` rounds are committed or a stop is requested."""
        while not self.stop_event.is_set():
            if self.supervisor is not None:
                self.supervisor.ensure()  # a helper died: a new network stack, rejoining (net/supervise.py)
            begun = time.perf_counter()
            roster = self.membership.roster() if self.membership else []  # one DHT read serves both checks
            if self._finished(roster):
                break
            live = [s for s in roster if not s.leaving]
            if not self.exchange.in_flight:  # with overlap, catching up waits for the round's end (buffers busy)
                self._catch_up(live)
            started = time.perf_counter()
            train_loss, tokens, steps = self._inner_steps(live, begun)
            if self.stop_event.is_set():
                break
            inner_done = time.perf_counter()
            settled = self.exchange.settle()  # overlap: the last round's all-reduce, committed now if good
            live = self._live_roster()  # one read: did the run move on while we trained, and the group to expect
            self.run_round = self._run_round(live)
            self._catch_up(live)  # if so, rebase onto it now: our work still enters this round
            if self._last_round_held() and settled is None:
                break  # caught up to the run's last round just now: no round is left to contribute to
            caught_up = time.perf_counter()
            self.exchange.start(live)  # this round's contribution goes out
            if not self.exchange.overlapped:
                settled = self.exchange.settle()  # no overlap: wait for it now
            self.averager.observe_round(time.perf_counter() - started)
            # wall time of this round by part: sync (roster reads, state repairs), inner steps, waiting for an average
            # (matchmaking and all-reduce, or with overlap what the inner steps did not hide), and the whole round
            # (the rest: pseudo-gradient, outer step); evaluation is not counted
            timing = {"time/sync_s": started - begun + caught_up - inner_done,
                      "time/inner_s": inner_done - started - (settled.paused_s if settled else 0.0),
                      "time/wait_s": settled.waited_s if settled else 0.0, "time/round_s": time.perf_counter() - begun}
            self._end_round(settled, train_loss, tokens, steps, timing)

    def _end_round(self, settled, train_loss: float, tokens: int, steps: int, timing: dict) -> None:
        self.tokens_trained += tokens
        self._last_loss = train_loss
        if settled is None:  # overlap, first round: nothing was in flight
            return
        result, committed = settled.result, settled.committed
        # DyLU plans the next round from what the group shares: the moment its all-reduce ended and its speeds (with
        # overlap that moment falls inside the next round: each peer plans from its own clock instead)
        shared = committed and result.speeds and not self.exchange.overlapped
        self.rounds.group_clock = (settled.ended, result.speeds) if shared else None
        after = steps if settled.after_steps is None else settled.after_steps  # where the loop took the result
        records.log_round(self, result, committed, train_loss, tokens, steps,
                          {**timing, "outer/settled_after_steps": after})
        records.report(self, result, train_loss, steps, committed)
        if committed:
            self._after_commit()

    def _drain(self) -> None:
        """Overlap: the all-reduce still in flight (at the last round, or when leaving), waited for and committed."""
        begun = time.perf_counter()
        settled = self.exchange.settle()
        if settled is not None:
            self._end_round(settled, self._last_loss, 0, 0, {"time/sync_s": 0.0, "time/inner_s": 0.0,
                                                             "time/wait_s": settled.waited_s,
                                                             "time/round_s": time.perf_counter() - begun})

    def _after_commit(self) -> None:
        """What is due on the new θ_global: a checkpoint, an export, a text sample (each every K rounds)."""
        if self.supervisor is not None:
            self.supervisor.served()  # the network stack works: its restart, if any, held
        run = self.cfg.run
        for every, action in ((run.checkpoint_every, outputs.save), (run.export_every, outputs.export),
                              (run.sample_every, outputs.sample)):
            if every and self.round % every == 0:
                action(self)

    def _finished(self, roster) -> bool:
        rounds = self.cfg.run.rounds
        if rounds is not None and self.round + self.exchange.in_flight >= rounds:
            self._drain()  # overlap: the last round's all-reduce; if it fails, one more round goes out
        if self._last_round_held():
            return True
        if self.exchange.run_size.given_up:  # net/consensus.py RunSize: no second final θ_global
            self.log.warning(f"the run's last round found no quorum in {consensus.FORGET_AFTER} attempts (it needs "
                             f"more than half of the {len(self.state.quorum)} peers that committed round "
                             f"{self.round}): the others finished without us or are gone; stopping at round "
                             f"{self.round}")
            return True
        return self.membership is not None and self.membership.run_is_over(roster)

    def _last_round_held(self) -> bool:
        return self.cfg.run.rounds is not None and self.round >= self.cfg.run.rounds

    def _live_roster(self) -> list:
        return self.membership.live_roster() if self.membership else []

    # ------------------------------------------------------------------------------------------------ catching up
    def _catch_up(self, live_roster) -> None:
        """Fetch the run's state if we are behind it or in the minority; rebase our local work onto it, or drop it
        if it is too old (``diloco.max_staleness``) or already in the run's average."""
        target = self.membership.behind(live_roster) if self.membership is not None else None
        if target is None:
            return
        base, work_round, tokens = self.round, self.work_round, self.tokens_since_commit
        max_staleness = self.cfg.diloco.max_staleness
        keep = tokens > 0 and max_staleness > 0 and target.round - work_round <= max_staleness
        if keep:  # δ = our work not in θ_global_old, into the (idle) averaging buffers, before it is replaced
            with self.averager.pseudo_grads() as buffers:
                self.exchange.local_work(buffers)
        if not self.membership.fetch(target, fresh=base == 0 and self.inner.step_count == 0):
            return  # nothing changed: θ_local still holds our work
        already_in = self.state.included(self.name, base + 1)  # our last attempt was averaged after all
        if keep and not already_in:
            with self.averager.pseudo_grads() as buffers:
                self.exchange.moved(buffers)  # it is what we contribute next
                rebase(self.replica.params, self.state.params, buffers)
            self.replica.broadcast_local()  # θ_local changed on rank 0 only
            self._log_work("rebase", base, work_round, tokens)
            return
        self.replica.load(self.state.params)
        self.exchange.dropped()
        self.tokens_since_commit, self.work_round = 0, self.round
        if self.error_feedback is not None:
            self.error_feedback.reset()  # its residual belongs to work that is gone
        if tokens:
            self._log_work("drop_work", base, work_round, tokens, "already averaged" if already_in else "too old")

    def _log_work(self, event: str, base: int, work_round: int, tokens: int, why: str = "") -> None:
        self.metrics.log({"event": event, "peer": self.name, "round": self.round, "from_round": base,
                          "work_round": work_round, "staleness": self.round - work_round, "tokens": tokens,
                          "reason": why or None})
        verb = "rebased onto" if event == "rebase" else f"dropped ({why}) at"
        self.log.info(f"{event}: our local work since round {work_round} ({tokens} tokens) {verb} round "
                      f"{self.round}'s θ_global (staleness {self.round - work_round})")

    # ------------------------------------------------------------------------------------------------ inner steps
    def _inner_steps(self, live_roster, round_start: float) -> tuple[float, int, int]:
        """This round's inner steps (train/rounds.py); returns (mean loss, tokens, steps)."""
        work = self.rounds.run(live_roster, round_start)
        self.tokens_since_commit += work.tokens
        return work.mean_loss, work.tokens, work.steps

    def _publish_pace(self, pace) -> None:
        self.membership.work.update(steps_per_s=pace.steps_per_s, tokens_per_s=pace.tokens_per_s)
        self.membership.publish()

    @property
    def pace(self):
        return self.rounds.pace

    def _run_round(self, live: list) -> int:
        """The run's round as the roster shows it (ops/standing.py): the latest round credible to us, so that a
        stranger's entry claiming round 10^9 does not make us say the run went on without us."""
        if self.membership is None:
            return max((s.round for s in live), default=0)
        me = self.membership.status()
        return max(consensus.credible_rounds(me, [s for s in live if s.peer_id != me.peer_id]))

    def _missed_rounds(self) -> int:
        """Rounds the run committed since our last committed round, as our log counts them (ops/standing.py)."""
        return next((s.standing.missed for s in getattr(self.metrics, "sinks", ()) if isinstance(s, StandingSink)), 0)

    def _evaluate(self) -> float:
        """Held-out loss of θ_global."""
        with self.exchange.global_in_model(shards=self.replica.shards is not None):
            return self.replica.evaluate(self.data.eval_batches)

    # ------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Leave gracefully: announce it, stop serving state, save a checkpoint, leave the swarm. Safe to call
        twice."""
        if self._closed:
            return
        self._closed = True
        closing = time.monotonic()
        if self.supervisor is not None:
            self.supervisor.close()  # what follows shuts the helpers down on purpose
        try:
            if self._ready:  # overlap: an all-reduce in flight is finished (others need our parts), committed if good
                try:
                    self._drain()
                except Exception as e:  # noqa: BLE001 - a rank of ours died: we must still announce that we leave
                    self.log.warning(f"the all-reduce in flight could not be settled on leaving: {e!r}")
            if self._ready and self.cfg.run.checkpoint_every:
                outputs.save(self)  # first: a stop has 12 s (ops/stop.py), and the network below may be dead
            if self.membership is not None:
                _step(self.log, "announcing that we leave", self.membership.leave)  # others stop waiting for us
        finally:
            if hasattr(self, "replica"):
                self.replica.close()  # ranks > 0 of a multi-GPU peer stop
                self.data.train.close()
            # the helpers' graceful shutdowns share what is left of the stop's time (ops/stop.py): each waits up to
            # its own grace and is then killed, and the averager's 5 s plus the DHT's 3 + 3 s after a slow leave
            # could pass the 12 s, ending the process (exit 143) before its DHT was shut down
            if self.averager is not None and hasattr(self.averager, "close"):
                grace = grace_left(closing, 0.4, 5.0)
                _step(self.log, "the averager's shutdown", lambda: self.averager.close(timeout=grace))
            if self.dht is not None:
                self.dht.shutdown_timeout = grace_left(closing, 0.4, 3.0)
                _step(self.log, "the DHT's shutdown", self.dht.shutdown)
            self.metrics.close()


def _step(log, what: str, action) -> None:
    """One step of :meth:`Peer.close` that may meet a dead helper (a signal to our whole process group ends p2pd
    at once): said in one line, and the rest of the close goes on. One that took long is said too: a stop that ran
    past its grace shows where its time went."""
    began = time.monotonic()
    try:
        action()
    except Exception as e:  # noqa: BLE001 - whatever a dead network stack raises
        log.warning(f"{what} failed: {e!r}")
    took = time.monotonic() - began
    if took >= 1.0:
        log.info(f"{what} took {took:.1f} s")

