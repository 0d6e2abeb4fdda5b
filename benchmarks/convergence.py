"""Convergence at equal tokens: DiLoCo against plain AdamW and its data-parallel equivalent, on the embedded corpus.

Every method sees the same number of training tokens (``--steps`` inner steps x ``--workers`` workers x batch x
sequence length) and is evaluated on the same held-out batches:

  * ``AdamW, 1 worker``: one model, workers x steps steps of the peer batch (the same InnerTrainer a peer runs);
  * ``data-parallel, 4x batch``: steps steps of a workers x larger batch. Synchronous data parallelism with a mean
    all-reduce of gradients every step computes exactly this update, so it runs in one process; its bytes are those
    a ring all-reduce of fp32 gradients would send (computed, not measured);
  * ``DiLoCo, N peers, H``: a real local swarm (``p2p-diloco swarm``): N peer processes, steps inner steps each,
    pseudo-gradients all-reduced every H steps in 16 bits; bytes are those the peers measured on the wire;
  * ``DiLoCo, 1 peer``: the outer Nesterov step alone (a swarm of one peer, workers x steps steps).

Prints a Markdown table (final eval loss, median over seeds; bytes sent per worker) and writes a PNG plot of eval
loss against tokens. Run:

    python benchmarks/convergence.py [--steps 250] [--workers 4] [--h 10 --h 50] [--seeds 0 1 2] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import demo_config, median, rounds_of, swarm_records, table

from p2p_diloco.train.data import build_data
from p2p_diloco.train.inner import InnerTrainer, evaluate
from p2p_diloco.train.model import build_model, count_parameters


def local_run(steps: int, batch_mult: int, eval_every: int, seed: int) -> dict:
    """Plain AdamW in this process: the peer's InnerTrainer on peer0's data order, batch x ``batch_mult``."""
    cfg = demo_config(**{"data.seed": seed, "run.seed": seed})
    batch = cfg.inner.batch_size * batch_mult
    data = build_data(cfg.data, cfg.model.seq_len, batch, "peer0")
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    trainer = InnerTrainer(model, cfg.inner, torch.device("cpu"), total_steps=steps)
    curve, tokens = [(0, evaluate(model, data.eval_batches, torch.device("cpu")))], 0
    for step in range(1, steps + 1):
        tokens += trainer.step(data.train.next_batch).tokens
        if step % eval_every == 0 or step == steps:
            curve.append((tokens, evaluate(model, data.eval_batches, torch.device("cpu"))))
    return {"curve": curve, "params": count_parameters(model)}


def diloco_run(peers: int, inner_steps: int, rounds: int, seed: int) -> dict:
    """A real local swarm; the curve is peer0's eval loss of θ_global after each round vs the swarm's tokens."""
    cfg = demo_config(**{"data.seed": seed, "run.seed": seed, "averaging.min_group_size": min(peers, 2)})
    everything = swarm_records(peers, rounds, inner_steps, cfg, f"conv-{peers}x{inner_steps}")
    records = {name: rounds_of(recs) for name, recs in everything.items()}
    by_round: dict[int, int] = {}
    for recs in records.values():
        for r in recs:
            if r["committed"]:
                by_round[r["round"]] = by_round.get(r["round"], 0) + r["train/tokens"]
    start = next(r for r in everything["peer0"] if r.get("event") == "start")
    tokens, curve = 0, [(0, start["eval/loss"])]
    for r in records["peer0"]:
        if r["committed"] and "eval/loss" in r:
            tokens = sum(v for k, v in by_round.items() if k <= r["round"])
            curve.append((tokens, r["eval/loss"]))
    sent = median(sum(r["outer/bytes_sent"] for r in recs) for recs in records.values())
    return {"curve": curve, "bytes_sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=250, help="inner steps per worker (default 250)")
    parser.add_argument("--workers", type=int, default=4, help="DiLoCo peers and data-parallel workers (default 4)")
    parser.add_argument("--h", type=int, action="append", help="DiLoCo inner steps per round (default 10 and 50)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (init and data order); the table "
                        "reports the median final eval loss over them (default: 0)")
    parser.add_argument("--plot", default="benchmarks/convergence.png", help="PNG path for eval loss vs tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hs = args.h or [10, 50]
    if any(args.steps % h for h in hs):
        parser.error("--steps must be a multiple of every --h")
    n, steps = args.workers, args.steps
    eval_every = min(hs)  # eval points at the same token counts as the DiLoCo run with the smallest H
    methods = {
        "AdamW, 1 worker": lambda s: local_run(n * steps, 1, n * eval_every, s),
        f"data-parallel, {n} workers ({n}x batch)": lambda s: local_run(steps, n, eval_every, s),
        **{f"DiLoCo, {n} peers, H={h}": (lambda s, h=h: diloco_run(n, h, steps // h, s)) for h in hs},
        f"DiLoCo, 1 peer, H={max(hs)}": lambda s: diloco_run(1, max(hs), n * steps // max(hs), s),
    }
    params = count_parameters(build_model(demo_config().model, 256, 0))
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, fn in methods.items():
            start = time.perf_counter()
            out = fn(seed)
            out["seconds"] = time.perf_counter() - start
            results.setdefault(name, []).append(out)
            print(f"seed {seed} {name}: eval loss {out['curve'][-1][1]:.4f} at {out['curve'][-1][0]} tokens "
                  f"({out['seconds']:.0f} s)", flush=True)

    dp_name = f"data-parallel, {n} workers ({n}x batch)"
    rows = []
    for name, runs in results.items():
        final = median(r["curve"][-1][1] for r in runs)
        if name == dp_name:  # ring all-reduce of fp32 gradients every step: 2(N-1)/N x params x 4 bytes per worker
            sent, how = steps * 2 * (n - 1) / n * params * 4, "computed"
        elif "bytes_sent" in runs[0]:
            sent, how = median(r["bytes_sent"] for r in runs), "measured"
        else:
            sent, how = 0, ""
        rows.append([name, runs[0]["curve"][-1][0], f"{final:.4f}",
                     " / ".join(f"{r['curve'][-1][1]:.4f}" for r in runs), f"{sent / 1e6:.1f} {how}".strip()])
    print(f"\nseeds {args.seeds}; {params / 1e6:.2f}M parameters; {steps} inner steps per worker\n")
    print(table(["method", "tokens", "final eval loss (median)", "per seed", "MB sent per worker"], rows))
    Path(args.plot).with_suffix(".json").write_text(json.dumps(results))  # the curves, to redraw or compare
    plot(results, args.plot, f"tiny model ({params / 1e6:.2f}M), embedded corpus, seed {args.seeds[0]}")
    print(f"\nplot: {args.plot} (curves: {Path(args.plot).with_suffix('.json')})")


def plot(results: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, runs in results.items():
        xs, ys = zip(*runs[0]["curve"])
        ax.plot([x / 1e6 for x in xs], ys, marker="." if len(xs) < 40 else None, label=name)
    ax.set_xlabel("training tokens, all workers (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(top=min(5.7, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    main()
