"""Inner-step speed of this version against another checkout of the project, in one process: blocks of steps of each
alternate, so both see the same machine load (on a busy shared machine, far steadier than two separate runs).

  * this version: what a peer runs, ``Replica(build_training(...)).step`` (flat parameters, the GPU-path changes);
  * baseline: the other checkout's ``InnerTrainer.step`` on its own ``build_model``/``build_data`` (imported under
    another package name: a copy of its ``p2p_diloco`` with the imports renamed);
both with the local swarm's demo settings (tiny model, embedded corpus, batch 8 x 128, one torch thread), the same
seed, the same batches. Reports tokens/s of each (median over the blocks) and their ratio.

Run:

    python benchmarks/inner_ab.py --baseline /path/to/other/checkout [--steps 20] [--blocks 10]
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import demo_config, median, table

from p2p_diloco.ops.swarm import DEMO_DEFAULTS


def import_baseline(checkout: Path, into: Path):
    """The checkout's ``p2p_diloco`` package, importable as ``p2p_diloco_baseline``."""
    target = into / "p2p_diloco_baseline"
    shutil.copytree(checkout / "p2p_diloco", target)
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bp2p_diloco\b", "p2p_diloco_baseline", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("p2p_diloco_baseline")


def baseline_stepper(overrides: dict):
    config = importlib.import_module("p2p_diloco_baseline.config")
    cfg = config.load_config(defaults=overrides)  # the baseline's own config classes
    data = importlib.import_module("p2p_diloco_baseline.train.data")
    model_mod = importlib.import_module("p2p_diloco_baseline.train.model")
    inner = importlib.import_module("p2p_diloco_baseline.train.inner")
    d = data.build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, "ab")
    model = model_mod.build_model(cfg.model, d.vocab_size, cfg.run.seed)
    trainer = inner.InnerTrainer(model, cfg.inner, torch.device("cpu"), None)
    return lambda: trainer.step(d.train.next_batch)


def current_stepper(cfg):
    from p2p_diloco.train.replica import Replica, build_training

    training = build_training(cfg, "ab", None)
    replica = Replica(training, None, cfg)
    return lambda: replica.step(training.data.train.next_batch)


def timed(step, steps: int, tokens_per_step: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tokens_per_step / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, type=Path, help="another checkout of the project")
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of each version (default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = {**DEMO_DEFAULTS, "run.device": "cpu"}
    cfg = demo_config(**overrides)
    tokens = cfg.inner.batch_size * cfg.model.seq_len
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        import_baseline(args.baseline, Path(tmp))
        steppers = {"baseline": baseline_stepper(overrides), "this version": current_stepper(cfg)}
        for step in steppers.values():
            timed(step, 3, tokens)  # warm-up: allocator, first-call costs
        rates = {name: [] for name in steppers}
        for block in range(args.blocks):
            for name, step in steppers.items():
                rates[name].append(timed(step, args.steps, tokens))
            print(f"block {block}: " + ", ".join(f"{n} {r[-1]:.0f}" for n, r in rates.items()), flush=True)
    base, this = median(rates["baseline"]), median(rates["this version"])
    print(table(["model", "batch", "baseline tokens/s", "this version tokens/s", "this / baseline", "blocks"],
                [[cfg.model.name, f"{cfg.inner.batch_size} x {cfg.model.seq_len}", f"{base:.0f}", f"{this:.0f}",
                  f"{this / base:.3f}", f"{args.blocks} x {args.steps} steps"]]))


if __name__ == "__main__":
    main()
