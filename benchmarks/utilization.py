"""Compute utilization: the share of a peer's wall time spent in inner steps, in the all-reduce, and waiting.

A local swarm (``p2p-diloco swarm``, tiny model, one torch thread per peer) runs a few rounds at each H; every peer
logs, per round, the time in inner steps (``time/inner_s``), in the all-reduce once its group formed
(``outer/allreduce_only_s``) and the round's whole wall time (``time/round_s``: roster read and state check, inner
steps, pseudo-gradient, matchmaking, all-reduce, outer step; held-out evaluation excluded). Matchmaking
(``outer/allreduce_s - outer/allreduce_only_s``) is mostly waiting for the slowest peer of the group; "other" is the
rest (state check, pseudo-gradient, outer step). The first round is left out (it includes the peers' start-up skew).
Shares are pooled over the remaining rounds of every peer of a run; with ``--runs`` the table gives the median
over runs. Run:

    python benchmarks/utilization.py [--peers 2] [--h 50 --h 500] [--rounds 4] [--runs 3]
"""

from __future__ import annotations

import argparse

from common import demo_config, median, rounds_of, swarm_records, table

SHARES = ("inner", "allreduce", "matchmaking", "other")


def measure(peers: int, h: int, rounds: int) -> dict:
    records = swarm_records(peers, rounds, h, demo_config(**{"run.eval_every": 0}), f"util-h{h}")
    rows = [r for recs in records.values() for r in rounds_of(recs) if r["committed"] and r["round"] > 1]
    if not rows:
        raise RuntimeError(f"H={h}: no committed round after the first")
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731  (pooled over peers and rounds)
    wall = total("time/round_s")
    inner, allreduce = total("time/inner_s") / wall, total("outer/allreduce_only_s") / wall
    matchmaking = (total("outer/allreduce_s") - total("outer/allreduce_only_s")) / wall
    return {"h": h, "round_s": median(r["time/round_s"] for r in rows), "inner": inner, "allreduce": allreduce,
            "matchmaking": matchmaking, "other": 1 - inner - allreduce - matchmaking, "samples": len(rows),
            "tokens_per_s": total("train/tokens") / wall,
            "inner_tokens_per_s": total("train/tokens") / total("time/inner_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2, help="peers (default 2: one per core of this machine)")
    parser.add_argument("--h", type=int, action="append", help="inner steps per round (default 50 and 500)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; the first is not counted (default 4)")
    parser.add_argument("--runs", type=int, default=1, help="runs per H; the table gives the median of each column "
                        "over them (default 1)")
    args = parser.parse_args()
    out = []
    for h in args.h or [50, 500]:
        runs = [measure(args.peers, h, args.rounds) for _ in range(args.runs)]
        for r in runs:
            print(r, flush=True)
        m = {k: median(r[k] for r in runs) for k in runs[0]}
        out.append([h, f"{m['round_s']:.1f}", *(f"{100 * m[k]:.1f}%" for k in SHARES),
                    f"{m['tokens_per_s']:.0f} / {m['inner_tokens_per_s']:.0f}", sum(r["samples"] for r in runs)])
    print(table(["H", "round s (median)", "inner compute", "all-reduce", "matchmaking (waiting for the group)",
                 "other (state check, pseudo-gradient, outer step)", "tokens/s per peer: whole round / inner only",
                 "peer-rounds"], out))

if __name__ == "__main__":
    main()
