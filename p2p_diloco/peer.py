"""A DiLoCo peer: start → run → close. ``Peer.run`` owns the round loop.

One round: check that our θ_global is the run's (else fetch it from a peer that has it); H inner AdamW steps on
θ_local; δ = θ_global − θ_local into the averager's buffers; canonical all-reduce; if the round is good, the outer
step on θ_global and θ_local ← θ_global (commit); otherwise θ_global is left untouched and training continues from
θ_local, so the next round's pseudo-gradient carries this round's work too (roll back).

The roster, sync and state transfers live in :mod:`p2p_diloco.net.membership`; θ_global, the outer state and the
round in :class:`~p2p_diloco.train.global_state.GlobalState`.
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

from p2p_diloco.config import Config, ConfigError
from p2p_diloco.ops.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.ops.faults import parse_fault
from p2p_diloco.ops.metrics import MetricsSink, build_sink
from p2p_diloco.train.data import build_data
from p2p_diloco.train.global_state import GlobalState
from p2p_diloco.train.inner import InnerTrainer, evaluate, resolve_device, schedule_total_steps
from p2p_diloco.train.model import build_model, count_parameters, model_fingerprint
from p2p_diloco.train.outer import build_outer_optimizer, load_into, pseudo_gradient

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
        self.membership = None  # net.membership.Membership once in a swarm; None with an injected averager
        self.tokens_since_commit = 0  # weight of the next contribution
        self.tokens_trained = 0  # tokens of all inner steps this peer has run in this run
        self.metrics: MetricsSink = MetricsSink()
        self._sampler = None  # ops.generate.Generator over self.model, made at the first text sample
        self._saved_error_feedback = None  # a resumed checkpoint's error-feedback residual
        self.log = logger
        self._closed = False

    # ------------------------------------------------------------------------------------------------ start
    def start(self) -> "Peer":
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = resolve_device(cfg.run.device)
        self.data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, self.name)
        self.model = build_model(cfg.model, self.data.vocab_size, cfg.run.seed).to(self.device)
        params = [p.detach().to("cpu", torch.float32).clone() for p in self.model.parameters()]
        outer = build_outer_optimizer(cfg.diloco.outer_optimizer, params, cfg.diloco.outer_lr,
                                      cfg.diloco.outer_momentum)
        self.state = GlobalState(params, outer)
        total = schedule_total_steps(cfg.inner, cfg.run.rounds, cfg.diloco.inner_steps)
        self.inner = InnerTrainer(self.model, cfg.inner, self.device, total)
        self.fingerprint = self._fingerprint()
        resumed = self._resume()
        self.metrics = build_sink(cfg, self.run_dir, self.name)
        if self.averager is None:
            self._join_swarm()
        if self._saved_error_feedback is not None and self.error_feedback is not None:
            self.error_feedback.load_state_dict(self._saved_error_feedback)
        self.log.info(f"model {count_parameters(self.model) / 1e6:.2f}M params, fingerprint {self.fingerprint}, "
                      f"device {self.device}, {'resumed at' if resumed else 'starting at'} round {self.round}")
        if not resumed:
            eval_loss = self._evaluate()
            self.metrics.log({"event": "start", "run_id": self.cfg.run.run_id, "peer": self.name,
                              "peer_id": self.peer_id, "round": self.round, "eval/loss": eval_loss,
                              "global_params_sha256": self.state.params_digest, "fingerprint": self.fingerprint})
            self.log.info(f"initial eval loss {eval_loss:.4f}")
        if self.membership is not None:
            self.membership.wait_for_expected_peers()
        return self

    def _fingerprint(self) -> str:
        """Everything that must match for two peers to average: model shape, wire codec, outer rule."""
        d = self.cfg.diloco
        key = (f"{model_fingerprint(self.model)}|{self._wire_formats()}|{d.outer_optimizer}|{d.outer_lr}|"
               f"{d.outer_momentum}|{d.weight_by_tokens}")
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def _wire_formats(self) -> str:
        a = self.cfg.averaging
        return a.codec if a.average_codec in (None, a.codec) else f"{a.codec}>{a.average_codec}"  # 16-bit: as before

    def _join_swarm(self) -> None:
        from p2p_diloco.net.averaging import Averager  # the only hivemind users; imported lazily for mocked tests
        from p2p_diloco.net.dht import run_prefix, start_dht, visible_maddrs
        from p2p_diloco.net.membership import Membership

        self.dht = start_dht(self.cfg.network)
        prefix = run_prefix(self.cfg.run.run_id, self.fingerprint)
        self.averager = Averager(self.dht, self.cfg.averaging, prefix, [p.shape for p in self.state.params],
                                 client_mode=self.cfg.network.client_mode, fault=self.fault)
        self.membership = Membership(self.cfg, self.dht, self.averager, prefix, self.name, self.state,
                                     self.fingerprint, self.metrics, self.stop_event, self.log)
        maddrs = visible_maddrs(self.dht)
        (self.run_dir / "maddrs.txt").write_text("\n".join(maddrs) + "\n")
        self.log.info(f"joined run {self.cfg.run.run_id!r} as {self.averager.peer_id} (group key prefix "
                      f"{prefix}); others can join through: {' '.join(maddrs)}")
        self.membership.wait_for_round(self.cfg.run.join_after_round)
        self.membership.enter()

    @property
    def peer_id(self) -> str:
        return getattr(self.averager, "peer_id", "")

    @property
    def error_feedback(self):
        """The averaging seam's :class:`~p2p_diloco.net.codecs.ErrorFeedback`, or None (off)."""
        return getattr(self.averager, "error_feedback", None)

    @property
    def round(self) -> int:
        """Rounds committed: the version of θ_global."""
        return self.state.round

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        """Train until ``run.rounds`` rounds are committed or a stop is requested."""
        while not self.stop_event.is_set():
            begun = time.perf_counter()
            roster = self.membership.roster() if self.membership else []  # one DHT read serves both checks
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
            self._report(result, tokens, timing["time/inner_s"])
            if committed:
                self._after_commit()

    def _after_commit(self) -> None:
        """What is due on the new θ_global: a checkpoint, an export, a text sample (each every K rounds)."""
        run = self.cfg.run
        for every, action in ((run.checkpoint_every, self.save), (run.export_every, self.export),
                              (run.sample_every, self.sample)):
            if every and self.round % every == 0:
                action()

    def _finished(self, roster) -> bool:
        if self.cfg.run.rounds is not None and self.round >= self.cfg.run.rounds:
            return True
        return self.membership is not None and self.membership.run_is_over(roster)

    def _sync(self, live_roster) -> None:
        """Fetch the run's state if we are behind it or in the minority; our local progress is then dropped."""
        fresh = self.round == 0 and self.inner.step_count == 0
        if self.membership is not None and self.membership.sync(live_roster, fresh):
            load_into(self.model.parameters(), self.state.params)
            self.tokens_since_commit = 0
            if self.error_feedback is not None:
                self.error_feedback.reset()

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

        if self.membership is not None:
            self.averager.set_group_size(len(self.membership.live_roster()))
        with self.averager.pseudo_grads() as buffers:
            pseudo_gradient(self.state.params, self.model.parameters(), buffers)
            if self.error_feedback is not None:
                self.error_feedback.add_to(buffers)  # what the wire lost of our last committed contribution
        weight = self.tokens_since_commit if self.cfg.diloco.weight_by_tokens else 1.0
        contribution = Contribution(name=self.name, round=self.round, digest=self.state.digest,
                                    tokens=self.tokens_since_commit)
        return self.averager.average(contribution, weight)

    def _commit(self, result) -> bool:
        """Apply the outer step with the averaged Δ, unless Δ is not finite (then every peer rejects it alike)."""
        with self.averager.pseudo_grads() as averaged:
            if not all(torch.isfinite(d).all() for d in averaged):
                result.error = "the averaged pseudo-gradient is not finite: round rejected"
                return False
            self.state.apply(averaged, num_contributions=result.group_size)
            if self.error_feedback is not None:
                self.error_feedback.commit()
        load_into(self.model.parameters(), self.state.params)
        self.tokens_since_commit = 0
        if self.membership is not None:
            self.membership.state_changed()
        return True

    def _log_round(self, result, committed: bool, train_loss: float, tokens: int, timing: dict) -> None:
        deadlines = getattr(self.averager, "deadlines", None)  # a mocked averager has none
        deadline = deadlines.allreduce_timeout if deadlines is not None else None
        record = {"event": "round", "peer": self.name, "round": self.round, "committed": committed,
                  "outer/group_size": result.group_size, "outer/peers": result.peers, "train/loss": train_loss,
                  "train/tokens": tokens, "outer/allreduce_s": result.seconds,
                  "outer/allreduce_only_s": result.allreduce_seconds, "outer/allreduce_timeout_s": deadline,
                  "outer/bytes_sent": result.bytes_sent, "outer/bytes_received": result.bytes_received,
                  "global_params_sha256": self.state.params_digest, "state_sha256": self.state.digest,
                  "error": result.error, **timing}
        eval_every = self.cfg.run.eval_every
        if committed and eval_every and self.round % eval_every == 0:
            begun = time.perf_counter()
            record["eval/loss"] = self._evaluate()
            record["time/eval_s"] = time.perf_counter() - begun
        self.metrics.log(record)
        if committed:
            ev = f", eval {record['eval/loss']:.4f}" if "eval/loss" in record else ""
            self.log.info(f"round {self.round}: group {result.group_size}, train loss {train_loss:.4f}{ev}, "
                          f"all-reduce {result.seconds:.2f} s, sent {result.bytes_sent / 1e6:.2f} MB")
        else:
            self.log.warning(f"round {self.round + 1} not committed ({result.error}); θ_global kept, "
                             f"training continues from θ_local")

    def _report(self, result, tokens: int, inner_s: float) -> None:
        """What the roster shows about our work (published with the next heartbeat or state change)."""
        self.tokens_trained += tokens
        if self.membership is not None:
            self.membership.work.update(tokens_per_s=tokens / inner_s if inner_s > 0 else 0.0,
                                        tokens_trained=self.tokens_trained, last_allreduce_s=result.seconds,
                                        last_bytes=result.bytes_sent + result.bytes_received)

    def _evaluate(self) -> float:
        """Held-out loss of θ_global (θ_local equals θ_global whenever this is called)."""
        return evaluate(self.model, self.data.eval_batches, self.device)

    # ------------------------------------------------------------------------------------------------ state
    def checkpoint_state(self) -> dict:
        return {**self.state.state_dict(), "name": self.name, "fingerprint": self.fingerprint,
                "model": self.model.state_dict(), "inner": self.inner.state_dict(),
                "data": self.data.train.state_dict(), "tokens_since_commit": self.tokens_since_commit,
                "tokens_trained": self.tokens_trained, "config": asdict(self.cfg),
                "error_feedback": self.error_feedback.state_dict() if self.error_feedback is not None else None}

    def save(self) -> None:
        with self.state.lock:
            save_checkpoint(self.run_dir, self.checkpoint_state())

    def export(self) -> None:
        """θ_global as a Hugging Face folder, ``run_dir/exports/round-NNNNNN`` (θ_local equals θ_global here)."""
        from p2p_diloco.ops.export import export_path, save_hf_folder

        path = export_path(self.run_dir, self.round)
        save_hf_folder(self.model, self.cfg, path, info={"round": self.round, "peer": self.name})
        self.metrics.log({"event": "export", "peer": self.name, "round": self.round, "path": str(path)})
        self.log.info(f"round {self.round}: θ_global exported to {path}")

    def sample(self) -> None:
        """A short continuation of ``run.sample_prompt`` by θ_global, as a metrics record (never fails the run)."""
        from p2p_diloco.ops.generate import SAMPLE_TOKENS, Generator, sample

        prompt = self.cfg.run.sample_prompt
        try:
            if self._sampler is None:
                from p2p_diloco.ops.export import hf_tokenizer

                self._sampler = Generator(self.model, hf_tokenizer(self.cfg, self.cfg.model.seq_len), self.name)
            text = sample(self._sampler, prompt, samples=1, max_new_tokens=SAMPLE_TOKENS, seed=0)[0]
        except Exception as e:  # noqa: BLE001 - a sample is for people watching: it must not stop training
            self.log.warning(f"round {self.round}: text sample failed: {e!r}")
            return
        self.metrics.log({"event": "sample", "peer": self.name, "round": self.round, "prompt": prompt, "text": text})

    def _resume(self) -> bool:
        saved = load_checkpoint(self.run_dir)
        if saved is None:
            return False
        if saved["fingerprint"] != self.fingerprint:
            raise ConfigError(f"run.run_dir: {self.run_dir} holds a checkpoint of another model or outer setup "
                              f"({saved['fingerprint']} != {self.fingerprint}); use another run.run_dir")
        self.state.load_state_dict(saved)
        self.model.load_state_dict(saved["model"])
        self.inner.load_state_dict(saved["inner"])
        self.data.train.load_state_dict(saved["data"])
        self.tokens_since_commit = saved["tokens_since_commit"]
        self.tokens_trained = saved.get("tokens_trained", 0)  # absent from checkpoints of earlier versions
        self._saved_error_feedback = saved.get("error_feedback")  # taken once the averager exists (_join_swarm)
        return True

    # ------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Leave gracefully: announce it, stop serving state, save a checkpoint, leave the swarm. Safe to call
        twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.membership is not None:
                self.membership.leave()  # others stop counting us and stop waiting for us
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
