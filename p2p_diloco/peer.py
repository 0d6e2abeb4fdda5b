"""A DiLoCo peer: start → run → close. ``Peer.run`` owns the round loop.

One round: check that our θ_global is the run's (else fetch it from a peer that has it); H inner AdamW steps on
θ_local; δ = θ_global − θ_local into the averager's buffers; canonical all-reduce; if the round is good, the outer
step on θ_global and θ_local ← θ_global (commit); otherwise θ_global is left untouched and training continues from
θ_local, so the next round's pseudo-gradient carries this round's work too (roll back).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.ops.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.config import Config, ConfigError
from p2p_diloco.net.consensus import PeerStatus, sync_target
from p2p_diloco.train.data import build_data
from p2p_diloco.ops.faults import parse_fault
from p2p_diloco.train.inner import InnerTrainer, evaluate, resolve_device, schedule_total_steps
from p2p_diloco.ops.metrics import JsonlSink, MetricsSink
from p2p_diloco.train.model import build_model, count_parameters, model_fingerprint
from p2p_diloco.train.outer import build_outer_optimizer, load_into, pseudo_gradient, state_digests

logger = logging.getLogger("p2p_diloco")


class Peer:
    """One replica of the run. ``averager`` may be injected (tests); otherwise ``start`` joins the swarm."""

    def __init__(self, cfg: Config, *, averager=None, stop_event: Optional[threading.Event] = None):
        self.cfg = cfg
        self.name = cfg.run.name or f"{socket.gethostname()}-{os.getpid()}"
        self.run_dir = Path(cfg.run.run_dir)
        self.stop_event = stop_event or threading.Event()
        self.averager = averager
        self.fault = parse_fault(cfg.fault.inject)
        self.dht = None
        self.prefix = ""
        self.round = 0                 # rounds committed: the version of θ_global
        self.tokens_since_commit = 0   # weight of the next contribution
        self.metrics: MetricsSink = MetricsSink()
        self.log = logger
        self._state_lock = threading.Lock()  # θ_global, momentum and round change together, under this lock
        self._closed = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------------------ start
    def start(self) -> "Peer":
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = resolve_device(cfg.run.device)
        self.data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, self.name)
        self.model = build_model(cfg.model, self.data.vocab_size, cfg.run.seed).to(self.device)
        self.global_params = [p.detach().to("cpu", torch.float32).clone() for p in self.model.parameters()]
        self.outer = build_outer_optimizer(cfg.diloco.outer_optimizer, self.global_params, cfg.diloco.outer_lr,
                                           cfg.diloco.outer_momentum)
        total = schedule_total_steps(cfg.inner, cfg.run.rounds, cfg.diloco.inner_steps)
        self.inner = InnerTrainer(self.model, cfg.inner, self.device, total)
        self.fingerprint = self._fingerprint()
        resumed = self._resume()
        self._refresh_digests()
        self.metrics = JsonlSink(self.run_dir / "metrics.jsonl")
        if self.averager is None:
            self._join_swarm()
        self.log.info(f"model {count_parameters(self.model) / 1e6:.2f}M params, fingerprint {self.fingerprint}, "
                      f"device {self.device}, {'resumed at' if resumed else 'starting at'} round {self.round}")
        if not resumed:
            eval_loss = self._evaluate()
            self.metrics.log({"event": "start", "run_id": self.cfg.run.run_id, "peer": self.name,
                              "peer_id": self.peer_id, "round": self.round, "eval/loss": eval_loss,
                              "global_params_sha256": self.global_digest, "fingerprint": self.fingerprint})
            self.log.info(f"initial eval loss {eval_loss:.4f}")
        if self.dht is not None:
            self._wait_for_expected_peers()
        return self

    def _fingerprint(self) -> str:
        """Everything that must match for two peers to average: model shape, wire codec, outer rule."""
        d = self.cfg.diloco
        key = (f"{model_fingerprint(self.model)}|{self.cfg.averaging.codec}|{d.outer_optimizer}|{d.outer_lr}|"
               f"{d.outer_momentum}|{d.weight_by_tokens}")
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def _join_swarm(self) -> None:
        from p2p_diloco.net.averaging import Averager  # the only hivemind users; imported lazily for mocked tests
        from p2p_diloco.net.dht import run_prefix, start_dht, visible_maddrs

        self.dht = start_dht(self.cfg.network)
        self.prefix = run_prefix(self.cfg.run.run_id, self.fingerprint)
        self.averager = Averager(self.dht, self.cfg.averaging, self.prefix, [p.shape for p in self.global_params],
                                 client_mode=self.cfg.network.client_mode, fault=self.fault)
        maddrs = visible_maddrs(self.dht)
        (self.run_dir / "maddrs.txt").write_text("\n".join(maddrs) + "\n")
        self.log.info(f"joined run {self.cfg.run.run_id!r} as {self.averager.peer_id} (group key prefix "
                      f"{self.prefix}); others can join through: {' '.join(maddrs)}")
        self._wait_for_round(self.cfg.run.join_after_round)
        self.averager.serve_state(self._donate_state, self.round)
        self._publish_status()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="roster-heartbeat", daemon=True)
        self._heartbeat.start()

    def _wait_for_round(self, round_: Optional[int]) -> None:
        """``run.join_after_round``: watch the roster, unseen by others, until the run reaches ``round_``."""
        while round_ is not None and not self.stop_event.is_set():
            if max((s.round for s in self._live_roster()), default=0) >= round_:
                return
            self.stop_event.wait(0.5)  # the roster lives in the DHT: there is no event to wait on, so poll

    def _wait_for_expected_peers(self) -> None:
        """Roster: before round 1, wait (bounded) until ``run.expected_peers`` peers are in the run."""
        expected = self.cfg.run.expected_peers
        if expected <= 1 or self.round > 0:
            return
        deadline = time.monotonic() + self.cfg.run.expected_peers_timeout
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            roster = self._live_roster()
            if len(roster) >= expected or any(s.round > 0 for s in roster):
                return  # everyone is here, or the run started without us: join it
            self.log.info(f"waiting for peers: {len(roster)} of {expected} present")
            self.stop_event.wait(1.0)  # the roster lives in the DHT: there is no event to wait on, so poll
        self.log.warning(f"starting without the {expected} expected peers")

    @property
    def peer_id(self) -> str:
        return getattr(self.averager, "peer_id", "")

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        """Train until ``run.rounds`` rounds are committed or a stop is requested."""
        while not self.stop_event.is_set():
            begun = time.perf_counter()
            roster = self._roster()  # one DHT read serves both checks at the start of a round
            if self._finished(roster):
                break
            self._sync([s for s in roster if not s.leaving])
            started = time.perf_counter()
            train_loss, tokens = self._inner_steps(self.cfg.diloco.inner_steps)
            if self.stop_event.is_set():
                break
            inner_done = time.perf_counter()
            result = self._average()
            self.averager.observe_round(time.perf_counter() - started)
            committed = result.ok and self._commit(result)
            # wall time of this round by part: sync (roster read, state repair), inner steps, and the rest
            # (pseudo-gradient, matchmaking, all-reduce, outer step); evaluation is not counted
            timing = {"time/sync_s": started - begun, "time/inner_s": inner_done - started,
                      "time/round_s": time.perf_counter() - begun}
            self._log_round(result, committed, train_loss, tokens, timing)
            if committed and self.cfg.run.checkpoint_every and self.round % self.cfg.run.checkpoint_every == 0:
                self.save()

    def _finished(self, roster: list[PeerStatus]) -> bool:
        if self.cfg.run.rounds is not None and self.round >= self.cfg.run.rounds:
            return True
        return self._run_is_over(roster)

    def _run_is_over(self, roster: list[PeerStatus]) -> bool:
        """True if every other peer has left the run after training all of ``run.rounds``: nobody is left to
        average with, and the run's result exists elsewhere (a lone peer otherwise keeps training and waits)."""
        if self.dht is None or self.cfg.run.rounds is None:
            return False
        others = [s for s in roster if s.peer_id != self.peer_id]
        finished = [s for s in others if s.leaving and s.round >= self.cfg.run.rounds]
        if finished and all(s.leaving for s in others):
            self.log.warning(f"the run finished without us: {', '.join(s.name for s in finished)} left after "
                             f"round {self.cfg.run.rounds}; stopping at round {self.round}")
            return True
        return False

    def _inner_steps(self, steps: int) -> tuple[float, int]:
        """H inner steps on θ_local; returns (mean loss, tokens). Stops early, between steps, if asked to."""
        losses, tokens = [], 0
        bar = _progress(steps, f"{self.name} r{self.round + 1}", self.cfg.run.progress)
        for step in range(steps):
            if self.stop_event.is_set():
                break
            if self.fault is not None and step == steps // 2 and self.fault.due("inner", self.round + 1):
                self.fault.strike()
            out = self.inner.step(self.data.train.next_batch)
            losses.append(out.loss)
            tokens += out.tokens
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{out.loss:.3f}", refresh=False)
        if bar is not None:
            bar.close()
        self.tokens_since_commit += tokens
        return (sum(losses) / len(losses) if losses else float("nan")), tokens

    def _average(self):
        from p2p_diloco.net.averaging import Contribution

        if self.dht is not None:
            self.averager.set_group_size(len(self._live_roster()))
        with self.averager.pseudo_grads() as buffers:
            pseudo_gradient(self.global_params, self.model.parameters(), buffers)
        weight = self.tokens_since_commit if self.cfg.diloco.weight_by_tokens else 1.0
        contribution = Contribution(name=self.name, round=self.round, digest=self.state_digest,
                                    tokens=self.tokens_since_commit)
        return self.averager.average(contribution, weight)

    def _commit(self, result) -> bool:
        """Apply the outer step with the averaged Δ, unless Δ is not finite (then every peer rejects it alike)."""
        with self.averager.pseudo_grads() as averaged:
            if not all(torch.isfinite(d).all() for d in averaged):
                result.error = "the averaged pseudo-gradient is not finite: round rejected"
                return False
            with self._state_lock:
                self.outer.step(self.global_params, averaged, num_contributions=result.group_size)
                self.round += 1
                self._refresh_digests()
        load_into(self.model.parameters(), self.global_params)
        self.tokens_since_commit = 0
        self._state_changed()
        return True

    def _log_round(self, result, committed: bool, train_loss: float, tokens: int, timing: dict) -> None:
        deadlines = getattr(self.averager, "deadlines", None)  # a mocked averager has none
        deadline = deadlines.allreduce_timeout if deadlines is not None else None
        record = {"event": "round", "peer": self.name, "round": self.round, "committed": committed,
                  "outer/group_size": result.group_size, "outer/peers": result.peers, "train/loss": train_loss,
                  "train/tokens": tokens, "outer/allreduce_s": result.seconds,
                  "outer/allreduce_only_s": result.allreduce_seconds, "outer/allreduce_timeout_s": deadline,
                  "outer/bytes_sent": result.bytes_sent, "outer/bytes_received": result.bytes_received,
                  "global_params_sha256": self.global_digest, "state_sha256": self.state_digest,
                  "error": result.error, **timing}
        eval_every = self.cfg.run.eval_every
        if committed and eval_every and self.round % eval_every == 0:
            record["eval/loss"] = self._evaluate()
        self.metrics.log(record)
        if committed:
            ev = f", eval {record['eval/loss']:.4f}" if "eval/loss" in record else ""
            self.log.info(f"round {self.round}: group {result.group_size}, train loss {train_loss:.4f}{ev}, "
                          f"all-reduce {result.seconds:.2f} s, sent {result.bytes_sent / 1e6:.2f} MB")
        else:
            self.log.warning(f"round {self.round + 1} not committed ({result.error}); θ_global kept, "
                             f"training continues from θ_local")

    def _evaluate(self) -> float:
        """Held-out loss of θ_global (θ_local equals θ_global whenever this is called)."""
        return evaluate(self.model, self.data.eval_batches, self.device)

    # ------------------------------------------------------------------------------------------------ agreement
    def _refresh_digests(self) -> None:
        self.global_digest, self.state_digest = state_digests(self.global_params, self.outer.state_tensors())

    def _status(self, leaving: bool = False) -> PeerStatus:
        return PeerStatus(name=self.name, peer_id=self.peer_id, round=self.round, digest=self.state_digest,
                          leaving=leaving, donor=not self.cfg.network.client_mode)

    def _publish_status(self, leaving: bool = False) -> None:
        from p2p_diloco.net.dht import publish_status

        publish_status(self.dht, self.prefix, self._status(leaving), ttl=self.cfg.averaging.roster_ttl,
                       timeout=self.cfg.averaging.request_timeout)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.cfg.averaging.roster_ttl / 3):
            self._publish_status()

    def _roster(self) -> list[PeerStatus]:
        """Every unexpired roster entry, leavers included; [] without a swarm (mocked averaging)."""
        if self.dht is None:
            return []
        from p2p_diloco.net.dht import read_roster

        return read_roster(self.dht, self.prefix, self.cfg.averaging.request_timeout)

    def _live_roster(self) -> list[PeerStatus]:
        return [s for s in self._roster() if not s.leaving]

    def _state_changed(self) -> None:
        if self.dht is not None:
            self._publish_status()
            self.averager.serve_state(self._donate_state, self.round)

    def _sync(self, live_roster: list[PeerStatus]) -> None:
        """Before contributing: if the run has moved past our θ_global, or most peers hold other bytes for our
        round, fetch the run's state from a peer that holds it (digest-checked). Our local progress is dropped."""
        if self.dht is None:
            return
        target = sync_target(self._status(), live_roster)
        if target is None:
            return
        if not target.donors:
            self.log.warning(f"behind the run (round {target.round}) but no donor serves that state yet")
            return
        kind = "join" if self.round == 0 and self.inner.step_count == 0 else "repair"
        self.log.info(f"{kind}: our round {self.round} ({self.state_digest[:12]}) vs the run's round "
                      f"{target.round} ({target.digest[:12]}); fetching state")
        self._fetch_state(target, kind)

    def _fetch_state(self, target, kind: str) -> bool:
        start = time.perf_counter()
        got = self.averager.download_state(target.donors)
        if got is None:
            self.log.warning(f"{kind}: no donor delivered the state; retrying next round")
            return False
        metadata, tensors, donor = got
        problem = self._check_state(metadata, tensors, target)
        if problem:
            self.log.warning(f"{kind}: state from {donor} rejected: {problem}")
            return False
        n = len(self.global_params)
        with self._state_lock, torch.no_grad():
            for p, t in zip(self.global_params, tensors[:n]):
                p.copy_(t)
            for m, t in zip(self.outer.state_tensors(), tensors[n:]):
                m.copy_(t)
            self.round = metadata["round"]
            self._refresh_digests()
        load_into(self.model.parameters(), self.global_params)
        self.tokens_since_commit = 0
        self._state_changed()
        seconds = time.perf_counter() - start
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.metrics.log({"event": kind, "peer": self.name, "round": self.round, "donor": metadata.get("name"),
                          "state_bytes": size, "seconds": seconds, "global_params_sha256": self.global_digest,
                          "state_sha256": self.state_digest})
        self.log.info(f"{kind}: got round {self.round} from {metadata.get('name')} ({size / 1e6:.1f} MB in "
                      f"{seconds:.2f} s); digest verified")
        return True

    def _check_state(self, metadata, tensors, target) -> Optional[str]:
        """Why a downloaded state is unusable, or None: shapes, the donor's own digest, and the run's round."""
        expected = [p.shape for p in self.global_params] + [m.shape for m in self.outer.state_tensors()]
        if not isinstance(metadata, dict) or metadata.get("fingerprint") != self.fingerprint:
            return "not a state of this run's model"
        if [t.shape for t in tensors] != expected:
            return "tensor shapes differ"
        n = len(self.global_params)
        _, digest = state_digests(tensors[:n], tensors[n:])
        if digest != metadata.get("digest"):
            return "bytes do not match the donor's digest (corrupted in transit)"
        if metadata.get("round", -1) < target.round or (metadata["round"] == target.round
                                                        and digest != target.digest):
            return f"round {metadata.get('round')} is not the run's round {target.round}"
        return None

    def _donate_state(self):
        """Called on hivemind's state thread when a peer downloads from us: a consistent snapshot."""
        with self._state_lock:
            metadata = {"round": self.round, "digest": self.state_digest, "fingerprint": self.fingerprint,
                        "name": self.name}
            tensors = [t.clone() for t in (*self.global_params, *self.outer.state_tensors())]
        return metadata, tensors

    # ------------------------------------------------------------------------------------------------ state
    def state(self) -> dict:
        return {"round": self.round, "name": self.name, "fingerprint": self.fingerprint,
                "global_params": self.global_params, "outer": self.outer.state_dict(),
                "model": self.model.state_dict(), "inner": self.inner.state_dict(),
                "data": self.data.train.state_dict(), "tokens_since_commit": self.tokens_since_commit,
                "config": asdict(self.cfg)}

    def save(self) -> None:
        with self._state_lock:
            save_checkpoint(self.run_dir, self.state())

    def _resume(self) -> bool:
        state = load_checkpoint(self.run_dir)
        if state is None:
            return False
        if state["fingerprint"] != self.fingerprint:
            raise ConfigError(f"run.run_dir: {self.run_dir} holds a checkpoint of another model or outer setup "
                              f"({state['fingerprint']} != {self.fingerprint}); use another run.run_dir")
        with torch.no_grad():
            for p, s in zip(self.global_params, state["global_params"], strict=True):
                p.copy_(s)
        self.outer.load_state_dict(state["outer"])
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        self.data.train.load_state_dict(state["data"])
        self.round, self.tokens_since_commit = state["round"], state["tokens_since_commit"]
        return True

    # ------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Leave gracefully: announce it, stop serving state, save a checkpoint, leave the swarm. Safe to call
        twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            if self.dht is not None and self.averager is not None:
                self._publish_status(leaving=True)  # others stop counting us and stop waiting for us
                self.averager.stop_serving()
            if hasattr(self, "inner") and self.cfg.run.checkpoint_every:
                self.save()
        finally:
            if self.averager is not None and hasattr(self.averager, "close"):
                self.averager.close()
            if self.dht is not None:
                self.dht.shutdown()
            self.metrics.close()


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
