"""Convergence at equal tokens: DiLoCo with M = 1, 2, 4 peers against data parallelism, the scaling-laws protocol.

A global batch of ``--batch`` sequences, ``--steps`` steps (default: 2400 x 32 x 128 = 9.8M tokens, about 21 tokens
per parameter of the tiny preset, i.e. Chinchilla's 20):

  * ``AdamW / data parallel``: one model, the whole batch, ``--steps`` AdamW steps. Synchronous data parallelism with
    any number of workers computes exactly this update (mean all-reduce of gradients every step), so it runs in one
    process; it is also plain AdamW with the same steps, the reference for DiLoCo M = 1. Its bytes are those a ring
    all-reduce of fp32 gradients among 4 workers would send (computed);
  * ``DiLoCo M``: a real local swarm (``p2p-diloco swarm``; ``--engine sim``: the exact in-process reference) of M
    peers with batch/M sequences each and ``--steps`` inner steps each, H inner steps per round, pseudo-gradients
    all-reduced in 16 bits, outer optimizer from the defaults (``diloco.outer_lr = auto``) unless given.

Inner lr: ``--lr`` for every method unless ``--dp-lr`` is given for AdamW and ``--lr-for M:LR`` for DiLoCo M (each
method at its own tuned lr, as the scaling-laws protocol tunes it; benchmarks/learning-quality.md 7.6).
Every run is evaluated on the same ``--eval-windows`` held-out windows of the ``--corpus``. Results are appended to
``--out`` as each run ends (a stopped study resumes). Prints a Markdown table of the median final eval loss over the
seeds and draws eval loss against tokens (median over seeds at each point) to ``--plot``. Run:

    python benchmarks/convergence.py [--preset tiny] [--steps 2400] [--seeds 0 1 2] [--peers 1 2 4] [--h 30]
        [--engine swarm] [--out benchmarks/results/convergence-tiny.jsonl] [--plot benchmarks/convergence-tiny.png]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys

from common import median, table
from study import Spec, run_all

from p2p_diloco.train.outer import auto_outer


def specs_of(args) -> dict[str, list[Spec]]:
    """Method name -> its spec for every seed."""
    base = Spec(preset=args.preset, corpus=args.corpus, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                warmup=args.warmup, lr=args.lr, eval_windows=args.eval_windows, eval_points=args.eval_points,
                engine=args.engine, codec=args.codec, device=args.device)
    named = bool(args.dp_lr or args.lr_for)  # methods at different inner lrs: say each one's in its name
    dp = Spec(**{**base.__dict__, "peers": 0, "h": 1, "outer": "none", "outer_lr": 0.0, "momentum": 0.0,
                 "engine": "local", "codec": None, "lr": args.dp_lr or args.lr})
    methods = {dp.label() + (f" lr {dp.lr:g}" if named else ""): dp}
    for h in args.h:
        for m in args.peers:
            lr, momentum = auto_outer(m, h)
            lr = args.outer_lr if args.outer_lr is not None else lr
            momentum = args.momentum if args.momentum is not None else momentum
            spec = Spec(**{**base.__dict__, "peers": m, "h": h, "outer": "nesterov", "outer_lr": lr,
                           "momentum": momentum, "lr": args.lr_for.get(m, args.lr)})
            methods[spec.label() + (f" lr {spec.lr:g}" if named else "")] = spec
    return {name: [Spec(**{**s.__dict__, "seed": seed}) for seed in args.seeds] for name, s in methods.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--corpus", default="stdlib", help="data.dataset (default stdlib, 10 MB)")
    parser.add_argument("--steps", type=int, default=2400, help="steps of every method (default 2400)")
    parser.add_argument("--batch", type=int, default=32, help="global batch in sequences (default 32)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--warmup", type=int, default=100, help="inner lr warm-up steps (default 100)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak inner AdamW lr (default 2e-3)")
    parser.add_argument("--dp-lr", type=float, default=None, help="AdamW's lr if not --lr")
    parser.add_argument("--lr-for", nargs="+", default=[], metavar="M:LR", help="DiLoCo M's inner lr if not --lr "
                        "(each method at its own tuned lr, e.g. --lr-for 1:2.8e-3)")
    parser.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4], help="DiLoCo sizes (default 1 2 4)")
    parser.add_argument("--h", type=int, nargs="+", default=[30], help="inner steps per round, one DiLoCo run of each "
                        "size per value (default 30)")
    parser.add_argument("--outer-lr", type=float, default=None, help="outer lr (default: the auto rule)")
    parser.add_argument("--momentum", type=float, default=None, help="outer momentum (default: the auto rule)")
    parser.add_argument("--engine", default="swarm", choices=("swarm", "sim"), help="DiLoCo runs (default swarm)")
    parser.add_argument("--codec", default=None, help="wire codec (swarm default scaled_fp16; sim default exact)")
    parser.add_argument("--device", default="cpu", help="AdamW and --engine sim: cpu or cuda (bf16 autocast)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    parser.add_argument("--eval-windows", type=int, default=512, help="held-out windows (default 512)")
    parser.add_argument("--eval-points", type=int, default=16, help="evaluations along a run (default 16)")
    parser.add_argument("--out", default=None, help="JSONL results (default benchmarks/results/convergence-PRESET"
                        ".jsonl)")
    parser.add_argument("--plot", default=None, help="PNG (default benchmarks/convergence-PRESET.png)")
    parser.add_argument("--shard", default="0/1", help="run only every K-th missing run, from the I-th: I/K")
    parser.add_argument("--jobs", type=int, default=1, help="run the missing runs in this many processes at once "
                        "(a GPU runs several small models side by side; default 1)")
    args = parser.parse_args()
    lr_for = {}  # --lr-for M:LR ... -> {M: LR}
    for item in args.lr_for:
        m, _, lr = item.partition(":")
        try:
            lr_for[int(m)] = float(lr)
            if int(m) not in args.peers or float(lr) <= 0:
                raise ValueError
        except ValueError:
            print(f"convergence.py: --lr-for {item}: want M:LR with M one of --peers and LR > 0", file=sys.stderr)
            raise SystemExit(2)
    args.lr_for = lr_for
    out = args.out or f"benchmarks/results/convergence-{args.preset}.jsonl"
    methods = specs_of(args)
    index, count = map(int, args.shard.split("/"))
    specs = [s for specs in methods.values() for s in specs]
    if args.jobs > 1:  # job j runs shard j of this process's shard's runs
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        jobs = [context.Process(target=run_all, args=(specs, out, (index + j * count, count * args.jobs)))
                for j in range(args.jobs)]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join()
    results = run_all(specs, out, (index, count), echo=lambda s: print(s, flush=True))
    done = {name: [results[s.key()] for s in specs if s.key() in results] for name, specs in methods.items()}
    print(report(done, args))
    if all(done.values()):
        plot(done, args.plot or f"benchmarks/convergence-{args.preset}.png", args)


def report(done: dict[str, list[dict]], args) -> str:
    dp = next(iter(done.values()))
    dp_final = median(r["final"] for r in dp) if dp else None
    rows = []
    for name, runs in done.items():
        if not runs:
            rows.append([name, "–", "–", "(not run yet)", "–", "–"])
            continue
        final = median(r["final"] for r in runs)
        gap = f"{100 * (final / dp_final - 1):+.1f} %" if dp_final and runs is not dp else "–"
        sent = runs[0].get("bytes_sent_per_peer")
        if runs is dp:
            params = runs[0]["params"]
            sent = args.steps * 2 * 3 / 4 * params * 4  # ring all-reduce of fp32 gradients, 4 workers, every step
        rows.append([name, runs[0]["curve"][-1][0], f"{final:.4f}",
                     " / ".join(f"{r['final']:.4f}" for r in runs), gap,
                     "–" if sent is None else f"{sent / 1e6:.1f}" + (" (computed)" if runs is dp else "")])
    return table(["method", "tokens", "final eval loss (median)", "per seed", "vs data parallel",
                  "MB sent per worker"], rows)


def plot(done: dict[str, list[dict]], path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, runs in done.items():
        points = min(len(r["curve"]) for r in runs)
        xs = [runs[0]["curve"][i][0] / 1e6 for i in range(1, points)]
        ys = [statistics.median(r["curve"][i][1] for r in runs) for i in range(1, points)]
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xlabel("training tokens, all workers (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    params = next(iter(done.values()))[0]["params"]
    seeds = f"median of {len(args.seeds)} seeds" if len(args.seeds) > 1 else f"seed {args.seeds[0]}"
    engine = "DiLoCo in real local swarms" if args.engine == "swarm" else "DiLoCo in the in-process reference"
    ax.set_title(f"{args.preset} ({params / 1e6:.2f}M parameters), {args.corpus} corpus, {seeds}, {engine}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
