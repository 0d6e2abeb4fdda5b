"""Compute utilization: the share of a peer's wall time spent in inner steps, in the all-reduce, and waiting.

A local swarm (``p2p-diloco swarm``, tiny model, one torch thread per peer) runs a few rounds at each H; every peer
logs, per round, the time in inner steps (``time/inner_s``), in the all-reduce once its group formed
(``outer/allreduce_only_s``) and the round's whole wall time (``time/round_s``: roster read and state check, inner
steps, pseudo-gradient, matchmaking, all-reduce, outer step; held-out evaluation excluded). Waiting is the rest:
mostly matchmaking, i.e. waiting for the slowest peer of the group. The first round is left out (it includes the
peers' start-up skew). Shares are medians over the remaining rounds of every peer. Run:

    python benchmarks/utilization.py [--peers 2] [--h 50 --h 500] [--rounds 4]
"""

from __future__ import annotations

import argparse

from common import demo_config, median, rounds_of, swarm_records, table


def measure(peers: int, h: int, rounds: int) -> dict:
    records = swarm_records(peers, rounds, h, demo_config(**{"run.eval_every": 0}), f"util-h{h}")
    rows = [r for recs in records.values() for r in rounds_of(recs) if r["committed"] and r["round"] > 1]
    if not rows:
        raise RuntimeError(f"H={h}: no committed round after the first")
    share = lambda key: median(r[key] / r["time/round_s"] for r in rows)  # noqa: E731
    inner, allreduce = share("time/inner_s"), share("outer/allreduce_only_s")
    return {"h": h, "round_s": median(r["time/round_s"] for r in rows), "inner": inner, "allreduce": allreduce,
            "waiting": 1 - inner - allreduce, "samples": len(rows),
            "tokens_per_s": median(r["train/tokens"] / r["time/round_s"] for r in rows),
            "inner_tokens_per_s": median(r["train/tokens"] / r["time/inner_s"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2, help="peers (default 2: one per core of this machine)")
    parser.add_argument("--h", type=int, action="append", help="inner steps per round (default 50 and 500)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; the first is not counted (default 4)")
    args = parser.parse_args()
    out = []
    for h in args.h or [50, 500]:
        r = measure(args.peers, h, args.rounds)
        out.append([h, f"{r['round_s']:.1f}", f"{100 * r['inner']:.1f}%", f"{100 * r['allreduce']:.1f}%",
                    f"{100 * r['waiting']:.1f}%", f"{r['tokens_per_s']:.0f} / {r['inner_tokens_per_s']:.0f}",
                    r["samples"]])
        print(out[-1], flush=True)
    print(table(["H", "round s (median)", "inner compute", "all-reduce", "waiting (matchmaking, sync, outer step)",
                 "tokens/s per peer: whole round / inner only", "peer-rounds"], out))


if __name__ == "__main__":
    main()
