"""Crash cost: the wall time the survivors lose when a peer is SIGKILLed at each phase of a round.

Each scenario is a local swarm (3 peers, tiny model) in which one peer dies in round 3 at the named phase; for the
``serving`` phase a joiner arrives after round 1 and the first donor it asks dies while serving it. The time lost
is the survivors' wall time from the commit of round 2 to the commit of round 4, minus twice the median interval
between the commits of undisturbed rounds of the same run (the reference is measured in the same run, so the
machine's load cancels out). Run:

    python benchmarks/fault_cost.py [--phase inner --phase allreduce ...] [--roster-ttl 6] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from p2p_diloco.config import load_config
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, ChaosPlan, run_swarm, write_peer_config

PHASES = ("inner", "matchmaking", "allreduce", "serving")


def scenario(phase: str) -> ChaosPlan:
    if phase == "serving":
        return ChaosPlan(faults={"peer0": "kill:serving:2"}, actions=[(1, "join", "join0")])
    return ChaosPlan(faults={"peer2": f"kill:{phase}:3"})


def commit_times(run_dir: Path, survivors: list[str]) -> dict[int, float]:
    """round → mean wall time (s) at which the survivors committed it."""
    times: dict[int, list[float]] = {}
    for name in survivors:
        for r in read_jsonl(run_dir / name / "metrics.jsonl"):
            if r.get("event") == "round" and r["committed"]:
                times.setdefault(r["round"], []).append(r["time"])
    return {k: statistics.mean(v) for k, v in times.items()}


def measure(phase: str, inner_steps: int, rounds: int, roster_ttl: float) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"fault-{phase}-"))
    cfg = load_config(defaults={**DEMO_DEFAULTS, "averaging.roster_ttl": roster_ttl})
    plan = scenario(phase)
    rc = run_swarm(3, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg), plan=plan, timeout=600,
                   echo=lambda s: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    victim = next(iter(plan.faults))
    survivors = [p for p in ("peer0", "peer1", "peer2") if p != victim]
    t = commit_times(run_dir, survivors)
    crash_round = 3 if phase != "serving" else min(
        (r["round"] for r in summary["rounds"] if victim not in r["global_params_sha256"]), default=3)
    normal = [t[r + 1] - t[r] for r in sorted(t) if r + 1 in t and r + 1 > crash_round + 1]
    disturbed = t[crash_round + 1] - t[crash_round - 1]
    lost = disturbed - 2 * statistics.median(normal)
    hashes_agree = all(len(set(r["global_params_sha256"].values())) == 1 for r in summary["rounds"])
    return {"phase": phase, "exit": rc, "normal_round_s": round(statistics.median(normal), 2),
            "lost_s": round(lost, 2), "agree": hashes_agree, "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", action="append", choices=PHASES, help="phase(s) to measure (default: all)")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--roster-ttl", type=float, default=DEMO_DEFAULTS["averaging.roster_ttl"],
                        help="averaging.roster_ttl (s): how long a dead peer still counts in the roster")
    parser.add_argument("--runs", type=int, default=1, help="runs per phase; the table gives medians (default 1)")
    args = parser.parse_args()
    print("| phase of the crash | median round s (same run) | survivors' time lost s | per run | hashes agree | exit |")
    print("|---|---|---|---|---|---|")
    for phase in args.phase or PHASES:
        runs = [measure(phase, args.inner_steps, args.rounds, args.roster_ttl) for _ in range(args.runs)]
        lost = [r["lost_s"] for r in runs]
        print(f"| {phase} | {statistics.median(r['normal_round_s'] for r in runs):.2f} | "
              f"{statistics.median(lost):.2f} | {' / '.join(f'{x:.2f}' for x in lost)} | "
              f"{all(r['agree'] for r in runs)} | {','.join(str(r['exit']) for r in runs)} |", flush=True)

if __name__ == "__main__":
    main()
