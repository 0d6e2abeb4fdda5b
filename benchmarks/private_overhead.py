"""The cost of a private run (network.secret_file): round time and all-reduce time of a 2-peer local swarm with and
without a secret, alternated in the same script (open, private, open, private, ...), median over the rounds of each
run, then the median of ``--reps`` runs, and the ratio private / open.

What a secret adds per round: an HMAC-SHA256 over every DHT request and response (with a nonce check), the
membership proof in each join request and its check by the leader, every member's check of the group's proofs before
the all-reduce, and one read of the revocation list. Run:

    nice -n 10 python benchmarks/private_overhead.py [--reps 3] [--rounds 5] [--inner-steps 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from common import demo_config, median, rounds_of, table

from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import run_swarm, write_peer_config


def one_run(private: bool, rounds: int, inner_steps: int, scratch: Path, tag: str) -> dict:
    run_dir = scratch / tag
    cfg = demo_config(**{"model.seq_len": 64, "inner.batch_size": 4, "data.eval_batches": 1, "run.eval_every": 0,
                         "diloco.dylu": False})  # a fixed H: rounds of both kinds do the same work
    bootstrap_args = []
    if private:
        secret = scratch / "secret"
        secret.write_text("benchmark secret\n")
        cfg.network.secret_file = str(secret)
        bootstrap_args = [f"--network.secret_file={secret}"]
    rc = run_swarm(2, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg), timeout=600,
                   echo=lambda s: None, bootstrap_args=bootstrap_args)
    if rc != 0:
        raise RuntimeError(f"swarm {tag} failed (exit {rc}): {run_dir}")
    records = [r for p in sorted(run_dir.glob("peer*/metrics.jsonl")) for r in rounds_of(read_jsonl(p))
               if r["committed"] and r["round"] > 1]  # round 1 includes start-up waits
    return {"round_s": median(r["time/round_s"] for r in records), "sync_s": median(r["time/sync_s"] for r in records),
            "inner_step_s": median(r["time/inner_s"] / max(1, r["train/inner_steps"]) for r in records),
            "inner_steps": median(r["train/inner_steps"] for r in records),
            "allreduce_s": median(r["outer/allreduce_s"] for r in records),
            "allreduce_only_s": median(r["outer/allreduce_only_s"] for r in records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inner-steps", type=int, default=20)
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="private-overhead-"))
    results = {"open": [], "private": []}
    try:
        for rep in range(args.reps):
            for kind in ("open", "private"):
                results[kind].append(one_run(kind == "private", args.rounds, args.inner_steps, scratch,
                                             f"{kind}{rep}"))
                print(kind, rep, results[kind][-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    keys = ("round_s", "sync_s", "inner_step_s", "inner_steps", "allreduce_s", "allreduce_only_s")
    rows = []
    for key in keys:
        o, s = median(r[key] for r in results["open"]), median(r[key] for r in results["private"])
        rows.append([key, f"{o:.3f}", f"{s:.3f}", f"{s / o:.3f}"])
    print(table(["per round (median)", "open s", "private s", "private / open"], rows))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
