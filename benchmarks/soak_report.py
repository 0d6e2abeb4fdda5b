"""The soak's pure parts (benchmarks/soak.py): the fault rotation, reading /proc and a peer's log and metrics, the
per-peer table (start against end after warm-up) and the verdict. To print a results file's table and verdict
again without rerunning the soak, Run:

    python benchmarks/soak_report.py benchmarks/results/soak.jsonl [--warmup-min 3] [--settle-s 60]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
from typing import Optional

from p2p_diloco.ops.metrics import ROTATE_BYTES

FAULT_KINDS = ("kill_restart", "kill_p2pd", "kill_dht", "term_restart")
"""SIGKILL of a peer's process group then a restart on its run folder; SIGKILL of its p2pd; SIGKILL of its DHT
child process; SIGTERM to its process group then a restart."""

TOLERANCE = 0.10  # memory and descriptors: end / start at most 1 + this after warm-up ("flat within 10 %")
WINDOW = 4  # samples (about a minute at 15 s) whose median is "start" and "end"

# net/supervise.py's lines: "network: <what died>; restarted <stack> (n of m ...)" and "...; restarting <stack> failed"
RESTARTED = re.compile(r"network: .+; restarted ")
RESTART_FAILED = re.compile(r"network: .+; restarting .+ failed")


def plan_faults(seed: int, minutes: float, peers: list[str], every_s: float = 60.0) -> list[tuple[float, str, str]]:
    """(seconds after the start, kind, peer), one every ``every_s`` from the first minute to before the end. Faults
    come in blocks of ``len(FAULT_KINDS)``: each block is a seeded permutation of the kinds, paired with a seeded
    order of the peers (no peer twice in a row across blocks when there are several), so every kind recurs every
    four faults and every peer is hit as often as the others. Pure: the same arguments give the same plan."""
    if not peers or every_s <= 0:
        raise ValueError("plan_faults needs at least one peer and every_s > 0")
    rng = random.Random(seed)
    times = [every_s * i for i in range(1, int(minutes * 60 / every_s + 1e-9)) if every_s * i < minutes * 60]
    plan: list[tuple[float, str, str]] = []
    kinds: list[str] = []
    victims: list[str] = []
    for t in times:
        if not kinds:
            kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        if not victims:
            order = rng.sample(peers, len(peers))
            if plan and len(order) > 1 and order[0] == plan[-1][2]:
                order.append(order.pop(0))
            victims = order
        plan.append((t, kinds.pop(0), victims.pop(0)))
    return plan


def parse_stat(text: str) -> dict:
    """/proc/PID/stat → state, ppid, pgrp, starttime (clock ticks after boot). The command name sits in parentheses
    and may hold spaces or parentheses: the fields start after the last ')'."""
    fields = text[text.rfind(")") + 2:].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgrp": int(fields[2]), "starttime": int(fields[19])}


def parse_status(text: str) -> dict:
    """/proc/PID/status → rss_bytes (VmRSS; 0 for a kernel thread or zombie) and threads."""
    out = {"rss_bytes": 0, "threads": 0}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            out["rss_bytes"] = int(value.split()[0]) * 1024  # the kernel writes kB
        elif key == "Threads":
            out["threads"] = int(value.split()[0])
    return out


def fd_kind(target: str) -> str:
    """What a descriptor is open on, from its /proc/PID/fd link: socket, pipe, shm (/dev/shm), file or other."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":", 1)[0]
    if target.startswith("/dev/shm/"):
        return "shm"
    return "file" if target.startswith("/") else "other"


def count_restarts(log_text: str) -> dict:
    """Helper restarts a peer's log reports (net/supervise.py), and the tracebacks in it."""
    return {"restarted": len(RESTARTED.findall(log_text)), "restart_failed": len(RESTART_FAILED.findall(log_text)),
            "tracebacks": log_text.count("Traceback (most recent call last)"),
            "never_retrieved": log_text.count("was never retrieved")}


def count_rounds(records: list[dict]) -> dict:
    """Rounds committed and attempted among a peer's metrics records (``event == "round"``)."""
    rounds = [r for r in records if r.get("event") == "round"]
    return {"committed": sum(bool(r.get("committed")) for r in rounds), "attempted": len(rounds)}


def _steady(samples: list[dict], warmup_s: float, settle_s: float) -> list[dict]:
    """Samples after warm-up of a live peer with all its processes up (its p2pd among them), whose process is at
    least ``settle_s`` old and whose last fault is at least ``settle_s`` ago: a process just restarted (or a stack
    just rebuilt) is still loading (on a loaded machine a restarted peer needs a minute or two for its helpers)."""
    full = max((s["tree"]["procs"] for s in samples), default=0)  # its processes when all are up (a peer: 4)
    return [s for s in samples if s["t_s"] >= warmup_s and s.get("alive") and s.get("p2pd")
            and s["tree"]["procs"] == full and s["up_s"] >= settle_s and s.get("since_fault_s", 1e9) >= settle_s]


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def life_ratio(values: list[float]) -> Optional[float]:
    """End over start of one process's steady samples, each end the median of :data:`WINDOW` samples, as the run's
    start and end are: one sample taken while an all-reduce holds its connections open is not read as growth. None
    for a life shorter than two windows (a minute at each end that do not overlap: too short to tell a level from
    a transient, such as the state transfers after a neighbour's fault) or a start of 0."""
    if len(values) < 2 * WINDOW:
        return None
    start, end = _median(values[:WINDOW]), _median(values[-WINDOW:])
    return end / start if start else None


def summarize(samples: list[dict], warmup_s: float, settle_s: float = 60.0) -> dict:
    """One peer's (or the bootstrap's) samples → start and end after warm-up (medians of the first and last
    :data:`WINDOW` steady samples), their ratios, the peak, and the run folder's growth per minute."""
    steady = _steady(samples, warmup_s, settle_s)
    first, last = steady[:WINDOW], steady[-WINDOW:]
    row: dict = {"steady_samples": len(steady)}
    for key in ("rss_bytes", "fds", "threads", "shm_bytes"):
        for scope in ("tree", "main"):
            if not steady or any(key not in s[scope] for s in steady):
                continue  # shm_bytes: not in results of the first version of the script
            start = _median([s[scope][key] for s in first])
            end = _median([s[scope][key] for s in last])
            row[f"{scope}_{key}"] = (start, end)
            row[f"{scope}_{key}_ratio"] = end / start if start and end is not None and len(steady) >= 2 else None
        row[f"tree_{key}_peak"] = max((s["tree"].get(key, 0) for s in steady), default=None)
    for key in ("rss_bytes", "fds"):  # a leak that a restart of the process would hide: within each process's life
        ratios = [ratio for pid in {s["pid"] for s in steady}
                  if (ratio := life_ratio([s["tree"][key] for s in steady if s["pid"] == pid])) is not None]
        row[f"tree_{key}_worst_life"] = max(ratios, default=None)
    row["lives"] = (len(ratios), len({s["pid"] for s in steady}))  # (long enough to judge, all)
    after = [s for s in samples if s["t_s"] >= warmup_s and "dir_bytes" in s]
    if len(after) >= 2 and after[-1]["t_s"] > after[0]["t_s"]:
        minutes = (after[-1]["t_s"] - after[0]["t_s"]) / 60
        attempts = after[-1]["attempted"] - after[0]["attempted"]
        for key in ("dir_bytes", "metrics_bytes", "log_bytes"):  # appended to: the first and last sample after warm-up
            row[key] = (after[0][key], after[-1][key])
            row[f"{key}_per_min"] = (after[-1][key] - after[0][key]) / minutes
            row[f"{key}_per_round"] = (after[-1][key] - after[0][key]) / attempts if attempts > 0 else None
        for key in ("checkpoint_bytes", "dir_files"):  # replaced in place: the largest of the first and last minute
            row[key] = (max(s[key] for s in after[:WINDOW]), max(s[key] for s in after[-WINDOW:]))
    if samples:
        end = samples[-1]
        for key in ("restarted", "restart_failed", "tracebacks", "never_retrieved", "committed", "attempted"):
            row[key] = end.get(key, 0)
    return row


def verdict(rows: dict[str, dict], tolerance: float = TOLERANCE) -> dict:
    """Memory (RSS of each peer's processes together) and descriptors flat: every end / start at most
    1 + ``tolerance``. The run folder bounded: the checkpoint and the number of files do not grow beyond the
    tolerance; metrics.jsonl is rotated (ops/metrics.py) and the log lives outside it, so their growth is named
    with its rate, not failed. A figure with too few steady samples fails its check (not shown flat)."""
    out: dict = {"memory_flat": True, "fds_flat": True, "folder_bounded": True, "notes": []}
    for name, row in rows.items():
        for key, flag, what in (("tree_rss_bytes_ratio", "memory_flat", "RSS"), ("tree_fds_ratio", "fds_flat", "FDs"),
                                ("tree_shm_bytes_ratio", "memory_flat", "shared memory held")):
            ratio = row.get(key)
            if key == "tree_shm_bytes_ratio" and "tree_shm_bytes" not in row:
                continue  # not measured by this results file
            if ratio is None and key == "tree_shm_bytes_ratio" and row["tree_shm_bytes"][0] == 0:
                ratio = 1.0 if not row["tree_shm_bytes"][1] else float("inf")  # none held at the start
            if ratio is None:
                out[flag] = False
                out["notes"].append(f"{name}: {what} not measured after warm-up ({row.get('steady_samples', 0)} "
                                    f"steady samples)")
            elif ratio > 1 + tolerance:
                out[flag] = False
                out["notes"].append(f"{name}: {what} grew ×{ratio:.2f} after warm-up")
            life = row.get(key.replace("_ratio", "_worst_life"))
            if life is not None and life > 1 + tolerance:
                out[flag] = False
                out["notes"].append(f"{name}: {what} grew ×{life:.2f} within the life of one process")
        if "dir_bytes" not in row:
            continue  # the bootstrap: no run folder
        for key in ("checkpoint_bytes", "dir_files"):
            a, b = row[key]
            if b > a * (1 + tolerance) + 1:
                out["folder_bounded"] = False
                out["notes"].append(f"{name}: {key} grew from {a} to {b}")
        for key, bound in (("metrics_bytes", f"rotated past {ROTATE_BYTES / 2 ** 20:.0f} MiB: at most "
                                             f"{2 * ROTATE_BYTES / 2 ** 20:.0f} MiB kept"),
                           ("log_bytes", "outside the run folder: the journal or the log driver rotates it")):
            rate, per_round = row[f"{key}_per_min"], row.get(f"{key}_per_round")
            if rate > 0:  # appended to, and bounded (ops/metrics.py JsonlSink): said, not a failed check
                out["notes"].append(f"{name}: {key.removesuffix('_bytes')} grows {rate / 1024:.1f} KiB/min "
                                    f"({rate * 60 * 24 / 2 ** 20:.0f} MiB/day)"
                                    + (f", {per_round:.0f} B per round attempted" if per_round else "")
                                    + f", {bound}")
    return out


def _mib(x: Optional[float]) -> str:
    return "–" if x is None else f"{x / 2 ** 20:.0f}"


def _pair(pair, fmt=str) -> str:
    return "–" if pair is None or pair[0] is None else f"{fmt(pair[0])} → {fmt(pair[1])}"


def _ratio(x: Optional[float]) -> str:
    return "–" if x is None else f"×{x:.2f}"


def render(rows: dict[str, dict], events: dict[str, dict]) -> str:
    """The per-peer Markdown table: RSS (MiB, all the peer's processes; main process), FDs, threads and folder size
    start → end after warm-up, restarts (ours by kind, the helpers' from the log), rounds committed / attempted."""
    head = ["peer", "RSS MiB, all processes", "ratio", "RSS MiB, main", "FDs, all", "ratio",
            "RSS / FDs, most grown in one process's life (lives of 2+ min judged)",
            "/dev/shm MiB held",
            "threads, all",
            "run folder MiB", "log KiB", "restarted by the soak", "exits of its own", "helper restarts (log)",
            "rounds committed / attempted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        ev = events.get(name, {})
        lines.append("| " + " | ".join([
            name, _pair(row.get("tree_rss_bytes"), _mib), _ratio(row.get("tree_rss_bytes_ratio")),
            _pair(row.get("main_rss_bytes"), _mib), _pair(row.get("tree_fds"), lambda x: f"{x:.0f}"),
            _ratio(row.get("tree_fds_ratio")),
            f"{_ratio(row.get('tree_rss_bytes_worst_life'))} / {_ratio(row.get('tree_fds_worst_life'))}"
            + (f" ({row['lives'][0]} of {row['lives'][1]} lives)" if row.get("lives") else ""), _pair(row.get("tree_shm_bytes"), lambda x: f"{x / 2 ** 20:.1f}"),
            _pair(row.get("tree_threads"), lambda x: f"{x:.0f}"),
            _pair(row.get("dir_bytes"), lambda x: f"{x / 2 ** 20:.1f}"),
            _pair(row.get("log_bytes"), lambda x: f"{x / 1024:.0f}"),
            str(ev.get("restarted", 0) if name != "bootstrap" else "–"), str(ev.get("exits", 0)),
            "–" if name == "bootstrap" else f"{row.get('restarted', 0)}"
            + (f" (+{row['restart_failed']} failed)" if row.get("restart_failed") else ""),
            "–" if name == "bootstrap" else f"{row.get('committed', 0)} / {row.get('attempted', 0)}"]) + " |")
    return "\n".join(lines)


def fault_outcomes(lines: list[dict]) -> list[dict]:
    """What each fault did: how the peer stopped (for ours: exit code and seconds; a SIGKILL past the grace), whether
    it exited by itself and when, and how long until its metrics counted a committed round more than just before
    the fault (the samples' resolution; None: not before its next fault or the end)."""
    out = []
    for i, line in enumerate(lines):
        if line.get("kind") != "fault":
            continue
        peer, t = line["peer"], line["t_s"]
        row = {"t_s": t, "fault": line["fault"], "peer": peer, "skipped": line.get("skipped"), "outcome": [],
               "back_s": None}
        later = [x for x in lines[i + 1:] if x.get("peer") == peer]
        before = [x for x in lines[:i] if x.get("peer") == peer and x.get("kind") == "sample" and x.get("alive")]
        base = line.get("committed", before[-1]["committed"] if before else 0)  # counted at the fault
        for x in later:
            if x.get("kind") == "fault":
                break
            if x["kind"] == "stopped":
                row["outcome"].append(f"exit {x['exit_code']} after {x['after_s']:.1f} s")
            elif x["kind"] == "stop_overdue":
                row["outcome"].append(f"still running after {x['grace_s']:.0f} s: SIGKILL")
            elif x["kind"] == "exit":
                row["outcome"].append(f"exited by itself ({x['exit_code']}) {x['since_fault_s']:.0f} s later")
            elif x["kind"] == "restart":
                row["outcome"].append("restarted")
                base = None  # a round the stopping process still committed does not count: the new one's do
            elif x["kind"] == "sample" and base is None:
                base = x.get("committed", 0)  # the new process's first sample: it needs a minute to start anyway
            elif x["kind"] == "sample" and x.get("committed", 0) > base and row["back_s"] is None:
                row["back_s"] = round(x["t_s"] - t, 1)
        out.append(row)
    return out


def render_faults(rows: list[dict]) -> str:
    lines = ["| min | fault | peer | what happened | back in a committed round after |", "|---|---|---|---|---|"]
    for r in rows:
        what = f"skipped: {r['skipped']}" if r["skipped"] else ", ".join(r["outcome"]) or "kept running"
        back = "–" if r["skipped"] else "never (until its next fault or the end)" if r["back_s"] is None else (
            f"{r['back_s']:.0f} s")
        lines.append(f"| {r['t_s'] / 60:.0f} | {r['fault']} | {r['peer']} | {what} | {back} |")
    return "\n".join(lines)


def report(lines: list[dict], warmup_s: float, settle_s: float) -> tuple[dict, dict, str]:
    """Results lines → (rows per peer, verdict, table + verdict as text)."""
    samples: dict[str, list[dict]] = {}
    events: dict[str, dict] = {}
    for line in lines:
        if line.get("kind") == "sample":
            samples.setdefault(line["peer"], []).append(line)
        elif line.get("kind") in ("restart", "exit"):
            ev = events.setdefault(line["peer"], {})
            key = "restarted" if line["kind"] == "restart" else "exits"
            ev[key] = ev.get(key, 0) + 1
    rows = {name: summarize(s, warmup_s, settle_s) for name, s in sorted(samples.items())}
    v = verdict(rows)
    text = render(rows, events) + "\n\n" + render_faults(fault_outcomes(lines)) + "\n\n" + "\n".join([
        f"memory flat within {TOLERANCE:.0%} after warm-up: {'yes' if v['memory_flat'] else 'NO'}",
        f"descriptors flat within {TOLERANCE:.0%} after warm-up: {'yes' if v['fds_flat'] else 'NO'}",
        f"run folder bounded: {'yes' if v['folder_bounded'] else 'NO'}", *[f"  - {n}" for n in v["notes"]]])
    return rows, v, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results file of benchmarks/soak.py (JSON lines)")
    parser.add_argument("--warmup-min", type=float, default=None, help="warm-up (min); default: the file's")
    parser.add_argument("--settle-s", type=float, default=None, help="settling time (s); default: the file's")
    parser.add_argument("--write", action="store_true", help="replace the file's summary and verdict lines with "
                        "these (after a change to this report; the samples and events stay as measured)")
    args = parser.parse_args()
    with open(args.results) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    head = next((x for x in lines if x.get("kind") == "config"), {})
    warmup = args.warmup_min if args.warmup_min is not None else head.get("warmup_min", 3.0)
    settle = args.settle_s if args.settle_s is not None else head.get("settle_s", 60.0)
    rows, v, text = report(lines, warmup * 60, settle)
    print(text)
    if args.write:
        with open(args.results, "w") as f:
            for line in lines:
                if line.get("kind") not in ("summary", "verdict"):
                    f.write(json.dumps(line) + "\n")
            f.writelines(summary_lines(rows, v))


def summary_lines(rows: dict[str, dict], v: dict) -> list[str]:
    """The results file's last lines: one summary per peer, then the verdict."""
    return [json.dumps({"kind": "summary", "peer": name, **row}) + "\n" for name, row in rows.items()] + [
        json.dumps({"kind": "verdict", **v}) + "\n"]


if __name__ == "__main__":
    main()
