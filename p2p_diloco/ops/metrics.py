"""One metrics sink interface: records are flat dicts with namespaced keys (``train/loss``, ``outer/allreduce_s``).

A peer logs through one :class:`MetricsSink` (:func:`build_sink`): the JSONL file always, and TensorBoard, Weights &
Biases and the Prometheus endpoint when configured (``run.tensorboard``, ``run.wandb_project``, ``metrics.port``),
behind one :class:`FanOut`.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence


class MetricsSink:
    """Receives one record per event; the base class drops everything (the null sink)."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


ROTATE_BYTES = 32 * 1024 * 1024  # metrics.jsonl is rotated past this (about 30,000 rounds of records)


class JsonlSink(MetricsSink):
    """Appends one JSON line per record to ``path``, flushed at once so a crash loses nothing already logged.

    Bounded: a record that would take the file past ``rotate_bytes`` first moves it to ``path.1`` (replacing the
    older one), so a peer that runs for months keeps at most twice that; :func:`read_jsonl` reads both."""

    def __init__(self, path: str | os.PathLike, rotate_bytes: int = ROTATE_BYTES):
        self.path, self.rotate_bytes = Path(path), rotate_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), **record}) + "\n"
        if self._file.tell() and self._file.tell() + len(line) > self.rotate_bytes:
            self._file.close()
            os.replace(self.path, rotated(self.path))
            self._file = open(self.path, "a", buffering=1)
        self._file.write(line)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class FanOut(MetricsSink):
    """Every record to every sink, in order; closing closes them all even if one fails."""

    def __init__(self, sinks: Sequence[MetricsSink]):
        self.sinks = list(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # the others must still be closed (files flushed, services ended)
                errors.append(e)
        if errors:
            raise errors[0]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's namespaced numbers (``train/loss``, ``outer/bytes_sent``...): what curves are drawn from."""
    return {k: float(v) for k, v in record.items()
            if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardSink(MetricsSink):
    """Scalars of every record as TensorBoard events in ``log_dir`` (torch's SummaryWriter), step = round."""

    def __init__(self, log_dir: str | os.PathLike, flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (an extra)

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record.get("round"))
        if record.get("event") == "sample":  # text samples (run.sample_every) under TensorBoard's Text tab
            text = f"{record['prompt']}{record['text']}"
            self.writer.add_text("sample", f"```\n{text}\n```", global_step=record.get("round"))

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricsSink):
    """Scalars of every record to a Weights & Biases run (x axis: ``round``); files under ``run_dir/wandb``.

    ``mode="offline"`` writes locally only and never touches the network (``wandb sync`` uploads later)."""

    def __init__(self, project: str, mode: str, run_dir: str | os.PathLike, name: str, group: str,
                 config: Optional[dict] = None):
        import wandb  # an extra

        settings = wandb.Settings(console="off", quiet=True, disable_git=True, save_code=False)
        self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), name=name, group=group,
                              config=config or {}, settings=settings)
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log({"round": record.get("round", 0), **values})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # ends W&B's service process now, not when this process exits


def build_sink(cfg, run_dir: str | os.PathLike, name: str) -> MetricsSink:
    """The peer's sink: ``run_dir/metrics.jsonl`` (rotated) and its standing in the run (ops/standing.py), plus
    TensorBoard and W&B as ``cfg.run`` asks, and the Prometheus endpoint (ops/telemetry.py) with ``metrics.port``."""
    import logging

    from p2p_diloco.ops.standing import StandingSink

    run_dir = Path(run_dir)
    # the log says when this peer falls out of the run and comes back (ops/standing.py)
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl"), StandingSink(logging.getLogger("p2p_diloco"))]
    if cfg.metrics.port:
        from p2p_diloco.ops.telemetry import PrometheusSink

        sinks.append(PrometheusSink(cfg.metrics.host, cfg.metrics.port, peer=name, run_id=cfg.run.run_id))
    if cfg.run.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.run.wandb_project:
        from p2p_diloco.config.secrets import redacted

        sinks.append(WandbSink(cfg.run.wandb_project, cfg.run.wandb_mode, run_dir, name, group=cfg.run.run_id,
                               config=redacted(cfg.to_dict())))  # the secret is never uploaded
    return FanOut(sinks)


def rotated(path: str | os.PathLike) -> Path:
    """Where :class:`JsonlSink` moves a full file: ``metrics.jsonl`` → ``metrics.jsonl.1``."""
    return Path(f"{path}.1")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file and, first, of its rotated predecessor (:class:`JsonlSink`); a torn
    line, from a killed writer, is skipped."""
    records = []
    for part in (rotated(path), Path(path)):
        if not part.is_file():
            continue
        for line in part.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def throughput_text(record: dict) -> str:
    """'12,345 tokens/s, MFU 41.2 %, peak 17.3 GiB' from a round record (the parts the device can tell)."""
    text = f"{record['train/tokens_per_s']:,.0f} tokens/s"
    if record.get("train/mfu") is not None:
        text += f", MFU {100 * record['train/mfu']:.1f} %"
    if record.get("device/peak_memory_gb") is not None:
        text += f", peak {record['device/peak_memory_gb']:.1f} GiB"
    return text
