"""Robust aggregation (``averaging.aggregator``): what it costs and what it buys, at 4 peers.

``cost``: 4 averager processes on loopback (no training) all-reduce a pseudo-gradient of ``--values`` fp32 values
(scaled fp16 on the wire) with each aggregator in turn, ``--reps`` times, interleaved so that the machine's load
falls on all alike; reported per aggregator: the all-reduce's wall time (median over reps and peers) and the most
bytes one reducer held at once to combine a part (its accumulator for the mean; every sender's copy otherwise), with
their ratios to the plain mean measured in the same script.

``learning``: local swarms of 4 peers (tiny model, embedded corpus), ``--rounds`` rounds each, per aggregator, without
an attacker and with peer3 attacking from round 2 (``--attack``, default flip: its pseudo-gradient x -1000): the final
eval loss of θ_global on the honest peers, and its ratio to the same aggregator's run without the attacker.

Run:

    nice -n 10 python benchmarks/robust.py cost learning --out benchmarks/results/robust.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, table  # noqa: E402

from p2p_diloco.config import AveragingConfig, NetworkConfig, load_config  # noqa: E402
from p2p_diloco.net.averaging.aggregators import AGGREGATORS  # noqa: E402
from p2p_diloco.ops.metrics import read_jsonl  # noqa: E402
from p2p_diloco.ops.procs import join_or_kill  # noqa: E402
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, ChaosPlan, run_swarm, write_peer_config  # noqa: E402

PEERS = 4
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


# ------------------------------------------------------------------------------------------------ cost
def _cost_worker(index, initial_peers, plan, values, results):
    torch.set_num_threads(1)
    from p2p_diloco.net.averaging import Averager, Contribution
    from p2p_diloco.net.dht import start_dht

    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    shapes = [torch.Size([values])]
    try:
        for step, aggregator in enumerate(plan):
            cfg = AveragingConfig(matchmaking_time=4, request_timeout=3, allreduce_timeout=120,
                                  next_chunk_timeout=30, aggregator=aggregator)
            averager = Averager(dht, cfg, f"robust{step}", shapes, expected_group_size=PEERS)
            try:
                with averager.pseudo_grads() as buffers:
                    buffers[0].copy_(torch.randn(values, generator=torch.Generator().manual_seed(index)))
                tokens = 100 + index
                result = averager.average(Contribution(f"p{index}", round=0, digest="d", tokens=tokens), tokens)
                results.put((step, aggregator, index, result.ok, result.allreduce_seconds, result.reducer_bytes,
                             result.error))
            finally:
                averager.close()
    finally:
        dht.shutdown()


def cost(values: int, reps: int) -> dict:
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    plan = [a for _ in range(reps) for a in AGGREGATORS]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    workers = [ctx.Process(target=_cost_worker, args=(i, visible_maddrs(boot), plan, values, results))
               for i in range(PEERS)]
    try:
        for w in workers:
            w.start()
        rows = [results.get(timeout=600) for _ in range(PEERS * len(plan))]
    finally:
        join_or_kill(workers, timeout=30)
        boot.shutdown()
    failed = [r for r in rows if not r[3]]
    out = {"values": values, "reps": reps, "failed": [r[-1] for r in failed], "by_aggregator": {}}
    for a in AGGREGATORS:
        ok = [r for r in rows if r[1] == a and r[3]]
        out["by_aggregator"][a] = {"allreduce_s": statistics.median(r[4] for r in ok),
                                   "reducer_bytes": max(r[5] for r in ok), "samples": len(ok)}
    base = out["by_aggregator"]["mean"]
    for a, m in out["by_aggregator"].items():
        m["time_ratio"] = m["allreduce_s"] / base["allreduce_s"]
        m["memory_ratio"] = m["reducer_bytes"] / base["reducer_bytes"]
    return out


# ------------------------------------------------------------------------------------------------ learning
def _final_eval(run_dir: Path, honest: list[str], rounds: int):
    losses = []
    for name in honest:
        recs = [r for r in read_jsonl(run_dir / name / "metrics.jsonl")
                if r.get("event") == "round" and r["committed"] and r.get("eval/loss") is not None]
        last = [r for r in recs if r["round"] == rounds]
        losses.append(last[-1]["eval/loss"] if last else None)
    return None if None in losses else statistics.mean(losses), losses


def learning_run(aggregator: str, attack, rounds: int, inner_steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"robust-{aggregator}-{attack}-"))
    cfg = load_config(defaults={**DEMO_DEFAULTS, "model.seq_len": 64, "averaging.aggregator": aggregator,
                                "run.checkpoint_every": 0})
    plan = ChaosPlan(peer_args={"peer3": [f"--fault.attack={attack}", "--fault.attack_from=2"]} if attack else {})
    rc = run_swarm(PEERS, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg), plan=plan,
                   timeout=900, echo=lambda s: None)
    loss, per_peer = _final_eval(run_dir, ["peer0", "peer1", "peer2"], rounds)
    summary = json.loads((run_dir / "summary.json").read_text())
    initial = summary["initial_eval_loss"]
    return {"aggregator": aggregator, "attack": attack, "exit": rc, "final_eval_loss": loss,
            "per_peer": per_peer, "initial_eval_loss": initial, "rounds_committed": len(summary["rounds"]),
            "run_dir": str(run_dir)}


def learning(rounds: int, inner_steps: int, attack: str, aggregators, clean: bool = True) -> list[dict]:
    out = []
    for a in aggregators:
        for att in ((None, attack) if clean else (attack,)):
            r = learning_run(a, att, rounds, inner_steps)
            print(json.dumps(r), flush=True)
            out.append(r)
    return out


def _ratio(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.0f}"


def report(result: dict) -> str:
    lines = []
    if "cost" in result:
        c = result["cost"]["by_aggregator"]
        lines.append(f"cost, {result['cost']['values']} values, {PEERS} peers, median of {result['cost']['reps']}:")
        lines.append(table(["aggregator", "all-reduce s", "x mean", "reducer bytes", "x mean"],
                           [[a, fmt(m["allreduce_s"]), fmt(m["time_ratio"]), m["reducer_bytes"],
                             fmt(m["memory_ratio"])] for a, m in c.items()]))
    if "learning" in result:
        rows, runs = [], result["learning"]
        clean = {r["aggregator"]: r["final_eval_loss"] for r in runs if r["attack"] is None}
        for hit in (r for r in runs if r["attack"] is not None):
            a, loss = hit["aggregator"], hit["final_eval_loss"]
            own, base = clean.get(a), clean.get("mean")
            rows.append([a, hit["attack"], fmt(own, 4), fmt(loss, 4), _ratio(loss / own) if own else "–",
                         _ratio(loss / base) if base else "–", hit["rounds_committed"]])
        lines.append(table(["aggregator", "attack", "eval loss, no attacker", "with 1 attacker of 4",
                            "x no attacker", "x mean, no attacker", "rounds committed"], rows))
    return "\n\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=("cost", "learning"))
    ap.add_argument("--values", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--attack", default="flip")
    ap.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS))
    ap.add_argument("--attacked-only", action="store_true", help="skip the runs without an attacker")
    ap.add_argument("--out", default="benchmarks/results/robust.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {}
    if "cost" in args.parts:
        result["cost"] = cost(args.values, args.reps)
        print(json.dumps(result["cost"]), flush=True)
    if "learning" in args.parts:
        result["learning"] = learning(args.rounds, args.inner_steps, args.attack, args.aggregators,
                                      clean=not args.attacked_only)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(report(result))


if __name__ == "__main__":
    main()
