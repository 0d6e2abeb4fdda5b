"""Hyperparameter sweeps of the convergence study, in the exact in-process DiLoCo (no swarm): every combination of
the values given, each run once per seed, results appended to a JSONL file (a stopped sweep resumes; two processes
can share one grid with ``--shard 0/2`` and ``--shard 1/2``). Prints one row per run, sorted by final eval loss.

Every field of ``study.Spec`` is a flag taking one or more values (``--peers 0`` is AdamW with the whole batch, i.e.
data parallelism; ``--outer sgd --outer-lr 1`` is plain model averaging). Run:

    python benchmarks/sweep.py --out benchmarks/results/sweep.jsonl --steps 600 --warmup 25 --peers 1 4 \\
        --h 10 30 100 --outer-lr 0.4 0.7 1.0 --momentum 0 0.6 0.9 [--seed 0 1] [--shard 0/2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import typing

from common import table
from study import Spec, run_all


def grid(values: dict[str, list]) -> list[Spec]:
    """Every combination of ``values`` (field -> values); sgd ignores momentum, AdamW (peers 0) every outer field,
    so duplicates are dropped."""
    specs, seen = [], set()
    for combo in itertools.product(*values.values()):
        spec = Spec(**dict(zip(values, combo)))
        if spec.outer == "sgd":
            spec = dataclasses.replace(spec, momentum=0.0)
        if spec.peers == 0:
            spec = dataclasses.replace(spec, h=1, outer="none", outer_lr=0.0, momentum=0.0, engine="local")
        if spec.key() not in seen:
            seen.add(spec.key())
            specs.append(spec)
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(Spec)
    for f in dataclasses.fields(Spec):
        if f.name == "extra":
            continue
        kind = {int: int, float: float}.get(hints[f.name], str)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, nargs="+", default=[f.default],
                            help=f"default {f.default}")
    parser.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                        help="further config overrides for every run (e.g. inner.grad_clip=none)")
    parser.add_argument("--out", required=True, help="JSONL results file (appended; existing runs are skipped)")
    parser.add_argument("--shard", default="0/1", help="run only every K-th missing run, from the I-th: I/K")
    args = parser.parse_args()
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Spec) if f.name != "extra"}
    if args.set:
        values["extra"] = [tuple((k, _typed(v)) for k, v in (s.split("=", 1) for s in args.set))]
    specs = grid(values)
    index, count = map(int, args.shard.split("/"))
    print(f"{len(specs)} runs in the grid", flush=True)
    results = run_all(specs, args.out, (index, count), echo=lambda s: print(s, flush=True))
    rows = sorted(results.values(), key=lambda r: r["final"])
    print(table(["run", "lr", "seed", "final eval loss", "s"],
                [[Spec(**{**r["spec"], "extra": ()}).label() + (f" {r['spec']['extra']}" if r["spec"]["extra"] else ""),
                  r["spec"]["lr"], r["spec"]["seed"], f"{r['final']:.4f}", f"{r['seconds']:.0f}"] for r in rows]))


def _typed(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text.lower() == "none" else text


if __name__ == "__main__":
    main()
