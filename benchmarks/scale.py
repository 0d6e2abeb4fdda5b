"""Scale: local swarms of N peers (no injected fault), several runs each: rounds committed, runs with any round of
two digests, group size per round, failed round attempts, and the matchmaking and all-reduce seconds against N.

Each run is ``p2p-diloco swarm`` (a bootstrap node and N peer processes on 127.0.0.1, the demo's tiny model, one
thread per peer). Per round: the group that committed it (every peer that logged it), how many digests the peers
committed (more than one: a fork), the all-reduce seconds (the slowest member) and the wait for a group (the
matchmaking: ``time/wait_s`` minus the all-reduce, median over the members). On 2 cores, 32 peers are CPU-bound: the
times are this machine's, the forks and failed attempts are the protocol's. Results go to ``--out`` (JSON lines, one
per run) and a Markdown table is printed. Run:

    python benchmarks/scale.py --peers 16 32 --runs 5 --rounds 4 --inner-steps 10 --out benchmarks/results/scale.jsonl
    python benchmarks/scale.py --table benchmarks/results/scale.jsonl   # the table again, from the results

A second table gives what each member pays per committed round, as its round records count it: the reducer checks
(digest messages sent and received, their bytes, seconds), the roster reads and the entries each returned, the wait
for a group (matchmaking), and the all-reduce's bytes and seconds (medians over members and rounds, then over runs):
    python benchmarks/scale.py --peers 4 8 16 32 --runs 1 --out benchmarks/results/scale-costs.jsonl

With ``--kill-each-round SEED`` each run is ``p2p-diloco swarm --kill-each-round SEED+i`` (run i): from round 2 on one
member is SIGKILLed in every round at a seeded phase and a fresh peer started in its place. The table then counts the
attempts that failed on peers never killed (the survivors: the target is none) apart from those of the replacements
(a peer that joins while a round is under way may contribute to the round the run just left, and repairs):

    python benchmarks/scale.py --peers 16 --runs 5 --rounds 6 --kill-each-round 1 --out benchmarks/results/scale-kill.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import table

from p2p_diloco.config import load_config
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import demo_defaults, run_swarm, write_peer_config


def one_run(peers: int, rounds: int, inner_steps: int, timeout: float, kill_seed=None, keep=False) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"scale-{peers}-"))
    begun = time.monotonic()
    cfg = load_config(defaults=demo_defaults(peers))  # as `p2p-diloco swarm --peers N` (slower timings past 16)
    rc = run_swarm(peers, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg),
                   timeout=timeout, echo=lambda s: None, kill_each_round=kill_seed)
    wall = time.monotonic() - begun
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [dict(r, peer=p.name) for p in sorted(run_dir.iterdir()) if (p / "metrics.jsonl").is_file()
               for r in read_jsonl(p / "metrics.jsonl") if r.get("event") == "round"]
    killed = {e["peer"] for e in summary["events"] if e["kind"] == "kill"}
    replacements = {e["peer"] for e in summary["events"] if e["kind"] == "join"}
    committed = [r for r in records if r.get("committed")]
    per_round = []
    for s in summary["rounds"]:
        mine = [r for r in committed if r["round"] == s["round"]]
        waits = [max(0.0, r["time/wait_s"] - r["outer/allreduce_only_s"]) for r in mine if "time/wait_s" in r]
        per_round.append({"round": s["round"], "committed_by": s["committed_by"], "digests": len(s["digests"]),
                          "group_size": s["group_size"], "allreduce_s": s["allreduce_s"],
                          "matchmaking_s": statistics.median(waits) if waits else None})
    result = {"peers": peers, "rounds": rounds, "inner_steps": inner_steps, "exit_code": rc, "wall_s": wall,
              "rounds_committed": len(summary["rounds"]), "forked_rounds": summary["forked_rounds"],
              "failed_attempts": summary["failed_attempts"], "per_round": per_round,
              "failures": [f"{r['peer']} round {r['round']}: {str(r.get('error'))[:200]}" for r in records
                           if not r.get("committed")]}
    result["costs"] = round_costs(committed)
    if kill_seed is not None:
        result.update(kill_seed=kill_seed, kills=[(e["peer"], e["phase"]) for e in summary["events"]
                                                  if e["kind"] == "kill"],
                      survivor_failures=sum(not r.get("committed") for r in records
                                            if r["peer"] not in killed | replacements),
                      replacement_failures=sum(not r.get("committed") for r in records if r["peer"] in replacements))
    if rc == 0 and not result["failures"] and not keep:
        shutil.rmtree(run_dir)
    else:
        result["run_dir"] = str(run_dir)  # kept, to read why
    return result


def render(results: list[dict]) -> str:
    rows = []
    if any("kill_seed" in r for r in results):
        return render_kills([r for r in results if "kill_seed" in r])
    for n in sorted({r["peers"] for r in results}):
        runs = [r for r in results if r["peers"] == n]
        rounds = [x for r in runs for x in r["per_round"]]
        full = sum(x["committed_by"] == n and x["digests"] == 1 for x in rounds)
        mm = [x["matchmaking_s"] for x in rounds if x["matchmaking_s"] is not None]
        rows.append([n, len(runs), f"{sum(r['rounds_committed'] for r in runs)} of {sum(r['rounds'] for r in runs)}",
                     sum(bool(r["forked_rounds"]) for r in runs), f"{full} of {len(rounds)}",
                     f"{min((x['group_size'] for x in rounds), default=0)}–"
                     f"{max((x['group_size'] for x in rounds), default=0)}",
                     sum(r["failed_attempts"] for r in runs),
                     f"{statistics.median(mm):.2f}" if mm else "–",
                     f"{statistics.median([x['allreduce_s'] for x in rounds]):.2f}" if rounds else "–",
                     f"{statistics.median([r['wall_s'] for r in runs]):.0f}"])
    return table(["N", "runs", "rounds committed", "runs with a forked round", "rounds on all N, one digest",
                  "group size", "failed attempts", "matchmaking s (median)", "all-reduce s (median)",
                  "wall s per run (median)"], rows)


COSTS = {  # per member per committed round: the cost, and how it is read from the round's record
    "check messages": lambda r: r.get("outer/check_messages"),
    "check KB": lambda r: r.get("outer/check_bytes", 0) / 1e3 if "outer/check_bytes" in r else None,
    "check s": lambda r: r.get("outer/check_s"),
    "roster reads": lambda r: r.get("net/roster_reads"),
    "roster entries per read": lambda r: r["net/roster_entries"] / r["net/roster_reads"]
    if r.get("net/roster_reads") else None,
    "roster read s": lambda r: r.get("net/roster_read_s"),
    "certificate store s": lambda r: r.get("net/certificate_store_s"),
    "certificate bytes": lambda r: r.get("net/certificate_bytes"),
    "matchmaking s": lambda r: max(0.0, r["time/wait_s"] - r["outer/allreduce_only_s"]) if "time/wait_s" in r else None,
    "all-reduce MB": lambda r: (r["outer/bytes_sent"] + r["outer/bytes_received"]) / 1e6,
    "all-reduce s": lambda r: r["outer/allreduce_only_s"],
}


def round_costs(committed: list[dict]) -> dict:
    """Medians over every member's committed rounds (round 1 excluded: it includes the wait for the run to form)."""
    later = [r for r in committed if r["round"] > 1] or committed
    out = {}
    for name, read in COSTS.items():
        values = [v for v in (read(r) for r in later) if v is not None]
        out[name] = statistics.median(values) if values else None
    return out


def render_costs(results: list[dict]) -> str:
    rows = []
    for n in sorted({r["peers"] for r in results if r.get("costs")}):
        runs = [r["costs"] for r in results if r["peers"] == n and r.get("costs")]
        row = [n, len(runs)]
        for name in COSTS:
            values = [c[name] for c in runs if c.get(name) is not None]
            row.append(f"{statistics.median(values):.3g}" if values else "–")
        rows.append(row)
    return table(["N", "runs", *COSTS], rows)


def render_kills(results: list[dict]) -> str:
    rows = []
    for r in results:
        groups = [x["group_size"] for x in r["per_round"]]
        rows.append([r["peers"], r["kill_seed"], ", ".join(f"{peer} ({phase})" for peer, phase in r["kills"]),
                     f"{r['rounds_committed']} of {r['rounds']}", len(r["forked_rounds"]),
                     f"{min(groups, default=0)}–{max(groups, default=0)}", r["survivor_failures"],
                     r["replacement_failures"], f"{r['wall_s']:.0f}"])
    return table(["N", "seed", "killed (phase)", "rounds committed", "forked rounds", "group size",
                  "attempts failed on survivors", "on replacements", "wall s"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("Run:")[0].strip(), epilog="Run: see the module "
                                     "docstring", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before its peers are stopped")
    parser.add_argument("--out", type=Path, help="append each run's result (JSON line) to this file")
    parser.add_argument("--table", type=Path, help="print the table of a results file and exit")
    parser.add_argument("--keep", action="store_true", help="keep every run's folder (for scale_sim.py --fit)")
    parser.add_argument("--kill-each-round", type=int, metavar="SEED",
                        help="kill one member in every round from round 2 (seed SEED + run index), as the swarm does")
    args = parser.parse_args()
    if args.table is not None:
        if not args.table.is_file():
            print(f"scale.py: error: no results file {args.table}", file=sys.stderr)
            return 2
        results = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        print(render(results))
        if any(r.get("costs") for r in results):
            print("\nPer member per committed round (medians; round 1 excluded):\n" + render_costs(results))
        return 0
    if any(n < 2 for n in args.peers) or args.runs < 1 or args.rounds < 1 or args.inner_steps < 1:
        print("scale.py: error: --peers must be >= 2 and --runs, --rounds, --inner-steps >= 1", file=sys.stderr)
        return 2
    results = []
    for n in args.peers:
        for i in range(args.runs):
            seed = None if args.kill_each_round is None else args.kill_each_round + i
            result = one_run(n, args.rounds, args.inner_steps, args.timeout, seed, args.keep)
            if result["exit_code"] == 130:  # the swarm was interrupted (Ctrl+C): so is the benchmark
                print(f"scale.py: interrupted; runs so far: {len(results)}", file=sys.stderr)
                return 130
            results.append(result)
            print(f"N={n} run {i + 1}: exit {result['exit_code']}, {result['rounds_committed']} rounds, forked "
                  f"{result['forked_rounds']}, {result['failed_attempts']} failed attempts, {result['wall_s']:.0f} s"
                  + (f", folder {result['run_dir']}" if "run_dir" in result else ""),
                  flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
    print(render(results))
    print("\nPer member per committed round (medians; round 1 excluded):\n" + render_costs(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
