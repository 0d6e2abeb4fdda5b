"""Helpers shared by the benchmark scripts: the demo config, local swarm runs and their per-peer records."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from p2p_diloco.config import Config, load_config
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, run_swarm, write_peer_config


def demo_config(**overrides) -> Config:
    """The local swarm's demo config (tiny model, embedded corpus) with ``overrides`` ("section.key": value)."""
    return load_config(defaults={**DEMO_DEFAULTS, **overrides})


def swarm_records(num_peers: int, rounds: int, inner_steps: int, cfg: Config, tag: str,
                  timeout: float = 900, slowdowns: Optional[list[float]] = None) -> dict[str, list[dict]]:
    """Run a local swarm to completion (``slowdowns``: run_swarm's); return each peer's metrics records. Raises if
    the swarm failed."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{tag}-"))
    rc = run_swarm(num_peers, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg), timeout=timeout,
                   slowdowns=slowdowns, echo=lambda s: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    if rc != 0 or len(summary["rounds"]) < rounds:  # the run's folder stays, to read why
        raise RuntimeError(f"swarm {tag} failed (exit {rc}, {len(summary['rounds'])} of {rounds} rounds): {run_dir}")
    records = {p.name: read_jsonl(p / "metrics.jsonl") for p in sorted(run_dir.iterdir())
               if (p / "metrics.jsonl").is_file()}
    shutil.rmtree(run_dir)
    return records


def rounds_of(records: list[dict]) -> list[dict]:
    """The ``round`` records among a peer's metrics records."""
    return [r for r in records if r.get("event") == "round"]


def median(xs) -> float:
    return statistics.median(list(xs))


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
