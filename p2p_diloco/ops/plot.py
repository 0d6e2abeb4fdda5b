"""``p2p-diloco plot``: PNG figures of a run from its peers' ``metrics.jsonl`` files (needs matplotlib, an extra).

* ``loss.png``: train and eval loss of every peer against the tokens it trained and against wall time;
* ``timeline.png``: every round of every peer on a time axis, split into sync/repair, inner steps, matchmaking,
  all-reduce, outer step and evaluation (failed rounds hatched, state downloads marked);
* ``rounds.png``: group size and megabytes each peer moved (sent + received) per round.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from p2p_diloco.config import ConfigError
from p2p_diloco.ops.metrics import read_jsonl

PHASES = [  # (label, color): the parts of a round, in the order they happen
    ("sync / repair", "#9e9e9e"), ("inner steps", "#4c72b0"), ("matchmaking", "#dd8452"),
    ("all-reduce", "#c44e52"), ("outer step", "#8172b3"), ("eval", "#55a868")]
MISSING_MATPLOTLIB = "matplotlib is not installed: pip install 'p2p-diloco[plot]'"


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def read_peers(run_dir: str | os.PathLike) -> dict[str, list[dict]]:
    """peer name -> its records: a peer's run folder, or every peer folder of a swarm's run folder."""
    run_dir = Path(run_dir)
    peers = {}
    for path in sorted([run_dir / "metrics.jsonl", *run_dir.glob("*/metrics.jsonl")]):
        records = read_jsonl(path)
        if records:
            name = next((r["peer"] for r in records if r.get("peer")), path.parent.name)
            peers[name] = records
    return peers


def write_plots(run_dir: str | os.PathLike, out: Optional[str | os.PathLike] = None) -> list[Path]:
    """Write the figures for the run at ``run_dir`` into ``out`` (default: ``run_dir``); return their paths.
    ConfigError if the folder holds no metrics or matplotlib is missing."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run folder not found: {run_dir}")
    peers = read_peers(run_dir)
    if not peers:
        raise ConfigError(f"no metrics.jsonl in {run_dir} (nor in its peer folders)")
    if not matplotlib_available():
        raise ConfigError(MISSING_MATPLOTLIB)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = min(r["time"] for records in peers.values() for r in records if "time" in r)
    paths = []
    for name, draw in (("loss.png", _loss), ("timeline.png", _timeline), ("rounds.png", _rounds)):
        fig = draw(plt, peers, t0)
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(out / name)
    return paths


def _rounds_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "round"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---------------------------------------------------------------------------------------------- loss

def _loss(plt, peers: dict[str, list[dict]], t0: float):
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharey="row")
    for name, records in peers.items():
        train, evals, tokens = [], [], 0
        joined = any(r.get("event") == "join" for r in records)  # its initial θ_global was never the run's
        for r in records:
            if r.get("event") == "start" and _finite(r.get("eval/loss")) and not joined:
                evals.append((tokens, r["time"] - t0, r["eval/loss"]))
            if r.get("event") != "round":
                continue
            tokens += r.get("train/tokens", 0)
            if _finite(r.get("train/loss")):
                train.append((tokens, r["time"] - t0, r["train/loss"]))
            if _finite(r.get("eval/loss")):
                evals.append((tokens, r["time"] - t0, r["eval/loss"]))
        for row, points in ((0, evals), (1, train)):
            for col in (0, 1):
                if points:
                    axes[row][col].plot([p[col] for p in points], [p[2] for p in points], marker=".", label=name)
    for row, what in ((0, "eval loss of θ_global"), (1, "train loss (mean of the round's inner steps)")):
        axes[row][0].set_ylabel(f"{what}\n(nats/token)")
        for col, xlabel in ((0, "tokens trained by the peer"), (1, "wall time (s)")):
            axes[row][col].set_xlabel(xlabel)
            axes[row][col].grid(alpha=0.3)
    axes[0][1].legend(fontsize=8)
    fig.suptitle("Loss per peer")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------- timeline

def _segments(r: dict, t0: float) -> list[tuple[float, float, int]]:
    """(start, width, phase index) of one round record's parts, from its timings (older records: whole round)."""
    eval_s = r.get("time/eval_s") or 0.0
    end = r["time"] - t0 - eval_s
    total = r.get("time/round_s")
    if not _finite(total):
        return []
    averaging = r.get("outer/allreduce_s") or 0.0
    allreduce = r.get("outer/allreduce_only_s") or 0.0
    sync, inner = r.get("time/sync_s") or 0.0, r.get("time/inner_s") or 0.0
    widths = [sync, inner, max(0.0, averaging - allreduce), allreduce,
              max(0.0, total - sync - inner - averaging), eval_s]
    segments, at = [], end - total
    for phase, width in enumerate(widths):
        if width > 0:
            segments.append((at, width, phase))
        at += width
    return segments


def _timeline(plt, peers: dict[str, list[dict]], t0: float):
    from matplotlib.patches import Patch

    height = 1.2 + 0.55 * len(peers)
    fig, ax = plt.subplots(figsize=(12, height))
    names = list(peers)
    for y, name in enumerate(names):
        for r in _rounds_of(peers[name]):
            for start, width, phase in _segments(r, t0):
                ax.broken_barh([(start, width)], (y - 0.35, 0.7), facecolors=PHASES[phase][1],
                               hatch=None if r.get("committed") else "///", edgecolor="white", linewidth=0.3)
        for r in peers[name]:
            if r.get("event") in ("join", "repair") and _finite(r.get("seconds")):
                ax.broken_barh([(r["time"] - t0 - r["seconds"], r["seconds"])], (y + 0.38, 0.12), facecolors="black")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    handles = [Patch(color=color, label=label) for label, color in PHASES]
    handles += [Patch(facecolor="white", edgecolor="gray", hatch="///", label="not committed"),
                Patch(color="black", label="state download")]
    # about 0.55 inch below the axes, whatever the figure's height: under the x label
    ax.legend(handles=handles, ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.55 / (height - 0.9)))
    ax.set_title("Rounds of every peer")
    ax.grid(axis="x", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------- rounds

def _rounds(plt, peers: dict[str, list[dict]], t0: float):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    groups: dict[int, int] = {}
    moved: dict[str, dict[int, float]] = {}
    for name, records in peers.items():
        for r in _rounds_of(records):
            if r.get("committed"):
                groups[r["round"]] = max(groups.get(r["round"], 0), r.get("outer/group_size", 0))
                mb = (r.get("outer/bytes_sent", 0) + r.get("outer/bytes_received", 0)) / 1e6
                moved.setdefault(name, {})[r["round"]] = mb
    rounds = sorted(groups)
    top.bar(rounds, [groups[n] for n in rounds], color="#4c72b0")
    top.set_ylabel("group size (peers)")
    top.yaxis.get_major_locator().set_params(integer=True)
    bottom_acc = [0.0] * len(rounds)
    for name, by_round in moved.items():
        values = [by_round.get(n, 0.0) for n in rounds]
        bottom.bar(rounds, values, bottom=bottom_acc, label=name)
        bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    bottom.set_ylabel("MB sent + received")
    bottom.set_xlabel("round")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Committed rounds: group size and traffic per peer")
    fig.tight_layout()
    return fig
