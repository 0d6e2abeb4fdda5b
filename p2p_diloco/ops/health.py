"""``p2p-diloco health``: is this peer alive and in the run? For a container's HEALTHCHECK and a Kubernetes probe.

Read from the peer's own run folder only (no DHT, well under a second): its process, named by ``peer.pid``, which the
peer writes when it starts (the pid and the start time) and removes when it stops; and the end of its
``metrics.jsonl``. Healthy when the process lives and its last committed round (or, before its first one, its start)
is younger than a bound: ``--max-age``, else ``HEALTHY_ROUNDS`` of its recent rounds' median wall time, at least
``MIN_AGE_S``; ``START_AGE_S`` before it has timed a round. A peer that trains alone, or whose rounds all fail, turns
unhealthy after that many rounds: its supervisor (Docker, Kubernetes) can then restart it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from p2p_diloco.ops.metrics import rotated

PID_FILE = "peer.pid"
HEALTHY_ROUNDS = 5  # rounds without a commit before a peer counts as out of the run
MIN_AGE_S = 120.0  # the bound never goes below this: a short round's jitter must not flap the probe
START_AGE_S = 900.0  # before any timed round: start-up, joining and the first state download may take this long
TAIL_BYTES = 256 * 1024  # the end of metrics.jsonl read (hundreds of rounds): the probe stays fast on a months-long run


@dataclass
class Health:
    healthy: bool
    reason: str  # one line, said either way


@contextmanager
def pid_file(run_dir: str | os.PathLike) -> Iterator[None]:
    """``run_dir/peer.pid`` while the block runs: {"pid", "started"} (unix time), written atomically; removed after.
    A peer killed hard leaves it behind: :func:`check` then finds no such live process."""
    path = Path(run_dir) / PID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{PID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "started": time.time()}) + "\n")
    os.replace(tmp, path)
    try:
        yield
    finally:
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():  # not a newer peer's file
                path.unlink()
        except (OSError, ValueError):
            pass


def check(run_dir: str | os.PathLike, max_age: Optional[float] = None, now: Optional[float] = None) -> Health:
    """The verdict on the peer of ``run_dir`` (an existing folder). ``max_age`` in seconds, None: derived."""
    now = time.time() if now is None else now
    run_dir = Path(run_dir)
    started = _live_peer(run_dir)
    if isinstance(started, str):
        return Health(False, started)
    records = tail_records(run_dir / "metrics.jsonl")
    rounds = [r for r in records if r.get("event") == "round" and _number(r.get("time")) is not None]
    commits = [r for r in rounds if r.get("committed") is True]
    bound = max_age if max_age is not None else derived_bound(rounds)
    last = _number(commits[-1]["time"]) if commits else None
    since = max(last or 0.0, started)  # a restarted peer counts from its start, not from its old commits
    age = now - since
    what = (f"round {commits[-1].get('round')} committed {age:.0f} s ago" if last is not None and last >= started
            else f"no round committed since it started {age:.0f} s ago")
    if age > bound:
        failed = sum(1 for r in rounds if _number(r["time"]) > since)
        tried = f" ({failed} rounds tried since, none committed)" if failed else ""
        return Health(False, f"unhealthy: {what}{tried}; bound {bound:.0f} s")
    return Health(True, f"healthy: {what}; bound {bound:.0f} s")


def derived_bound(rounds: list[dict]) -> float:
    """HEALTHY_ROUNDS x the median wall time of the last 20 rounds (committed or not), at least MIN_AGE_S;
    START_AGE_S if none was timed."""
    times = [t for t in (_number(r.get("time/round_s")) for r in rounds[-20:]) if t is not None and t > 0]
    if not times:
        return START_AGE_S
    return max(MIN_AGE_S, HEALTHY_ROUNDS * statistics.median(times))


def _live_peer(run_dir: Path):
    """The live peer's start time (unix), or why there is none (a line)."""
    path = run_dir / PID_FILE
    try:
        info = json.loads(path.read_text())
        pid, started = int(info["pid"]), float(info["started"])
    except FileNotFoundError:
        return f"unhealthy: no peer running in {run_dir} (no {PID_FILE}: stopped, or never started)"
    except (OSError, ValueError, TypeError, KeyError):
        return f"unhealthy: {path} is unreadable"
    if not _is_peer_process(pid):
        return f"unhealthy: the peer (pid {pid} in {PID_FILE}) is not running"
    return started


def _is_peer_process(pid: int) -> bool:
    """True if ``pid`` lives and runs p2p-diloco (a pid reused by another program does not count)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (b"p2p_diloco" in cmdline or b"p2p-diloco" in cmdline)


def tail_records(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict]:
    """The complete JSON records in the last ``tail_bytes`` of a JSONL file (a torn or foreign line is skipped),
    preceded by the end of its rotated predecessor (ops/metrics.py JsonlSink) if the file is shorter than that."""
    records = _tail(path, tail_bytes)
    if path.is_file() and path.stat().st_size < tail_bytes:
        records = _tail(rotated(path), tail_bytes - path.stat().st_size) + records
    return records


def _tail(path: Path, tail_bytes: int) -> list[dict]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > tail_bytes:
        lines = lines[1:]  # the first one is cut
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _number(value) -> Optional[float]:
    """A finite number from an untrusted record, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
