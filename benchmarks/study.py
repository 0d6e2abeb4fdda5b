"""The convergence study's runs: one spec (method, size, budget, hyperparameters) -> one eval-loss curve.

Protocol (scaling-laws paper, arXiv 2503.09799): a global batch of ``batch`` sequences and ``steps`` steps.

  * ``peers = 0``: AdamW on one model with the whole batch, ``steps`` steps. This is data parallelism with any number
    of workers (a mean all-reduce of gradients every step computes exactly this update) and plain AdamW with the
    same steps;
  * ``peers = M >= 1``: DiLoCo, M replicas of batch/M sequences each, ``steps`` inner steps each, an outer step every
    ``h`` steps. Equal tokens to the above. ``engine`` 'sim' runs it in this process
    (:class:`p2p_diloco.train.reference.ReferenceDiLoCo`), 'swarm' as a real local swarm (``p2p-diloco swarm``).

Every run is evaluated on the same ``eval_windows`` held-out windows (however its batches are sized) at about
``eval_points`` points along the run and at its end. Results are appended to a JSONL file as each run finishes, so
a study that is stopped resumes where it was (runs already in the file are skipped).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from common import demo_config, rounds_of, swarm_records

from p2p_diloco.config import Config
from p2p_diloco.train.data import build_data, load_tokenizer
from p2p_diloco.train.inner import InnerTrainer, evaluate
from p2p_diloco.train.model import build_model, count_parameters
from p2p_diloco.train.reference import ReferenceDiLoCo


LATER_FIELDS = {"plain_rounds": 0, "device": "cpu"}


@dataclass(frozen=True)
class Spec:
    """One run of the study. Two specs with equal fields are the same run (the results file's key)."""
    peers: int = 4                   # 0: AdamW with the whole batch (data parallelism); M >= 1: DiLoCo replicas
    h: int = 30                      # inner steps per round (DiLoCo)
    outer: str = "nesterov"          # outer optimizer
    outer_lr: float = 0.7
    momentum: float = 0.9
    lr: float = 1e-3                 # peak inner AdamW lr
    warmup: int = 100                # inner lr warm-up steps
    steps: int = 2400                # inner steps per replica (= AdamW steps)
    batch: int = 32                  # global batch (sequences); a DiLoCo replica gets batch / peers
    seq_len: int = 128
    preset: str = "tiny"
    corpus: str = "stdlib"
    seed: int = 0
    engine: str = "sim"              # DiLoCo only: 'sim' (in-process reference) or 'swarm' (real peer processes)
    codec: Optional[str] = None      # sim: wire codec emulated (None: exact fp32); swarm: the run's codec
    eval_windows: int = 512          # held-out windows of seq_len tokens
    eval_points: int = 16
    extra: tuple = field(default_factory=tuple)  # further ("section.key", value) config overrides
    plain_rounds: int = 0            # sim: rounds of plain averaging before the outer optimizer takes over
    device: str = "cpu"              # AdamW and sim: where the models train ('cuda': bf16 autocast, see inner.py)

    def key(self) -> str:
        fields = asdict(self)
        for name, default in LATER_FIELDS.items():  # fields added after results were recorded: absent = default
            if fields[name] == default:
                del fields[name]
        return json.dumps(fields, sort_keys=True)

    def config(self) -> Config:
        """The peer config of this run (a DiLoCo replica's, or the AdamW model's with the whole batch)."""
        per = self.batch // max(1, self.peers)
        if self.batch % max(1, self.peers) or self.eval_windows % per:
            raise ValueError(f"batch {self.batch} must split into {self.peers} replicas and eval_windows into "
                             f"batches of {per}")
        rounds = self.steps // self.h if self.peers else 1
        outer = {"diloco.outer_optimizer": self.outer, "diloco.outer_lr": self.outer_lr,
                 "diloco.outer_momentum": self.momentum} if self.peers else {}
        return demo_config(**{
            "model.name": self.preset, "model.seq_len": self.seq_len, "data.dataset": self.corpus,
            "data.seed": self.seed, "run.seed": self.seed, "data.eval_batches": self.eval_windows // per,
            "inner.lr": self.lr, "inner.warmup_steps": self.warmup, "inner.batch_size": per,
            "inner.cosine_steps": self.steps - self.warmup, "diloco.inner_steps": self.h if self.peers else 1,
            "run.rounds": rounds, **outer, **dict(self.extra)})

    def label(self) -> str:
        if self.peers == 0:
            return f"AdamW / data parallel (batch {self.batch})"
        outer = f"{self.outer} {self.outer_lr:g}" + (f"/{self.momentum:g}" if self.outer == "nesterov" else "")
        return f"DiLoCo M={self.peers} H={self.h} {outer}"


def run(spec: Spec) -> dict:
    """Train ``spec``; return {"spec", "curve": [(tokens, eval loss)], "final", "seconds", ...}."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    if spec.peers == 0:
        out = _adamw(spec)
    elif spec.engine == "sim":
        out = _sim(spec)
    else:
        out = _swarm(spec)
    return {"spec": asdict(spec), **out, "final": out["curve"][-1][1], "seconds": time.perf_counter() - start}


def _eval_marks(steps: int, every: int, points: int) -> set[int]:
    """Step counts (multiples of ``every``, the round length) at which to evaluate: about ``points`` of them."""
    stride = max(every, round(steps / points / every) * every)
    return set(range(stride, steps, stride)) | {steps}


def _adamw(spec: Spec) -> dict:
    cfg = spec.config()
    data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, "peer0")
    device = torch.device(spec.device)
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed).to(device)
    trainer = InnerTrainer(model, cfg.inner, device, total_steps=spec.steps)
    curve, tokens = [(0, evaluate(model, data.eval_batches, device))], 0
    marks = _eval_marks(spec.steps, 1, spec.eval_points)
    for step in range(1, spec.steps + 1):
        tokens += trainer.step(data.train.next_batch).tokens
        if step in marks:
            curve.append((tokens, evaluate(model, data.eval_batches, device)))
    return {"curve": curve, "params": count_parameters(model)}


def _sim(spec: Spec) -> dict:
    ref = ReferenceDiLoCo(spec.config(), spec.peers, codec=spec.codec, plain_rounds=spec.plain_rounds,
                          device=spec.device)
    curve = [(0, ref.evaluate())]
    marks = _eval_marks(spec.steps, spec.h, spec.eval_points)
    for r in range(1, spec.steps // spec.h + 1):
        ref.run_round()
        if r * spec.h in marks:
            curve.append((ref.tokens, ref.evaluate()))
    return {"curve": curve, "params": count_parameters(ref.replicas[0][0]), "stats": ref.stats}


def _swarm(spec: Spec) -> dict:
    rounds = spec.steps // spec.h
    stride = min(_eval_marks(spec.steps, spec.h, spec.eval_points)) // spec.h
    cfg = spec.config()
    cfg.run.eval_every, cfg.run.checkpoint_every = stride, 0
    cfg.averaging.codec = spec.codec or "scaled_fp16"
    cfg.averaging.min_group_size = spec.peers  # every round averages all peers, or fails for all (then retried)
    cfg.diloco.dylu = False  # H steps per round on every peer: equal tokens, whatever the machine's load
    everything = swarm_records(spec.peers, rounds, spec.h, cfg, f"study-m{spec.peers}h{spec.h}", timeout=6 * 3600)
    records = {name: rounds_of(recs) for name, recs in everything.items()}
    committed = [r for recs in records.values() for r in recs if r["committed"]]
    tokens_by_round: dict[int, int] = {}
    for r in committed:
        tokens_by_round[r["round"]] = tokens_by_round.get(r["round"], 0) + r["train/tokens"]
    start = next(r for r in everything["peer0"] if r.get("event") == "start")
    curve = [(0, start["eval/loss"])]
    for r in records["peer0"]:
        if r["committed"] and "eval/loss" in r and (r["round"] % stride == 0 or r["round"] == rounds):
            curve.append((sum(v for k, v in tokens_by_round.items() if k <= r["round"]), r["eval/loss"]))
    if curve[-1][0] != spec.steps * spec.batch * spec.seq_len:  # a failed round's work rolls into the next
        curve[-1] = (spec.steps * spec.batch * spec.seq_len, curve[-1][1])
    params = count_parameters(build_model(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size, 0))
    return {"curve": curve, "params": params, "min_group": min(r["outer/group_size"] for r in committed),
            "failed_rounds": sum(not r["committed"] for recs in records.values() for r in recs),
            "bytes_sent_per_peer": sum(r["outer/bytes_sent"] for r in committed) / spec.peers}


# ---------------------------------------------------------------------------------------------- results file

def load_results(path: str | Path) -> dict[str, dict]:
    """Spec key -> result, from a JSONL results file (missing file: none)."""
    path = Path(path)
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().split("\n")[:-1]:  # a line still being written by another process has no newline
        if line.strip():
            rec = json.loads(line)
            out[Spec(**{**rec["spec"], "extra": tuple(map(tuple, rec["spec"]["extra"]))}).key()] = rec
    return out


def run_all(specs: list[Spec], path: str | Path, shard: tuple[int, int] = (0, 1), echo=print) -> dict[str, dict]:
    """Run every spec not yet in the results file (this process's ``shard`` of them: index, count), appending each
    result as it finishes; return all results of ``specs`` found in the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Shards split ``specs`` by position, not the runs missing when a process started: processes started at different
    # moments see different missing runs, and splitting those let two of them pick the same run.
    for i, spec in enumerate(specs):
        if i % shard[1] != shard[0]:
            continue
        if spec.key() in load_results(path):  # done before, or by another shard meanwhile
            continue
        result = run(spec)
        _append_line(path, json.dumps(result))
        echo(f"{spec.label()} lr {spec.lr:g} seed {spec.seed}: final eval {result['final']:.4f} ({result['seconds']:.0f} s)")
    done = load_results(path)
    return {s.key(): done[s.key()] for s in specs if s.key() in done}


def _append_line(path: Path, line: str) -> None:
    """Append ``line`` in one write on an O_APPEND descriptor: processes sharing the file never interleave lines."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def with_(spec: Spec, **changes) -> Spec:
    return replace(spec, **changes)
