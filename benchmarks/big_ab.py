"""The peer's inner loop against the reference loop in ONE process, block by block: the speed ratio of the two loops
without the process-to-process spread that big_models.py's one-process-per-run figures carry (at 1b on an H100 the
same loop varied 43k-48k tokens/s between fresh processes, as much as the gap measured; big-models.md).

Both loops are built once and stay resident on the device (two copies of the model, two optimizers): at 1b and 4
sequences per micro-batch that is about 44 GiB, so this runs uncapped; the micro-batch is the one the 24 GiB cap
allows, and at equal micro-batch the cap changes what fits, not how fast a step runs. Then, per micro-batch: warm-up
steps of each (compilation), and ``--blocks`` blocks, each ``--steps`` timed steps of one loop then of the other (the
order alternates block by block, so a drift of the clock or of the GPU's temperature falls on both); each block
pair gives one peer / reference ratio. The first block of a loop after the other loop ran is slower (the switch: at
1b, 4 sequences, about 8 % on an H100), so a pair's ratio depends on its order: the figure is the median over
consecutive pairs (one of each order) of their ratios' geometric mean, with every block's tokens/s in the JSON.

The loops are big_models.py's (peer: build_inner + InnerTrainer.step, fused fp32 AdamW, layers and loss compiled;
reference: the Hugging Face model, compiled layers, one compiled loss, fused AdamW, ``--reference-loss``).

Run:

    python benchmarks/big_ab.py --preset 1b --batches 4 --json $OUT/big-ab-1b.json        # on a GPU
    python benchmarks/big_ab.py --smoke                                                    # the code path, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from big_models import GIB, _free, _is_oom, _sync, peer_loop, reference_loop  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--batches", default="4", help="comma-separated micro-batches (default 4: 1b's under 24 GiB)")
    parser.add_argument("--blocks", type=int, default=7, help="block pairs per micro-batch (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop first (default 3)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--reference-loss", default="padded", choices=("shifted", "padded"))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the results here (JSON), after every micro-batch")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, eager, 2 blocks of 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.batches, args.blocks, args.steps, args.warmup = "tiny", "2", 2, 2, 1
        args.seq_len, args.vocab, args.device, args.no_compile = 64, 512, "cpu", True
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (use --smoke or --device cpu)")
    return args


def timed(step, x, steps: int, device: torch.device) -> float:
    """tokens/s of ``steps`` steps on the batch ``x``."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(x)
    _sync(device)
    return x.numel() * steps / (time.perf_counter() - start)


def compare(loops: dict, batch: int, args, device: torch.device) -> dict:
    """Warm both loops up at ``batch`` sequences, then alternate timed blocks; the per-pair ratios and their median."""
    x = torch.randint(0, args.vocab, (batch, args.seq_len), device=device)
    for step in loops.values():
        for _ in range(args.warmup):
            step(x)
    speeds = {name: [] for name in loops}
    for block in range(args.blocks):
        order = list(loops) if block % 2 == 0 else list(reversed(loops))
        for name in order:
            speeds[name].append(timed(loops[name], x, args.steps, device))
    ratios = [p / r for p, r in zip(speeds["peer"], speeds["reference"])]
    # the first block of a loop after the other loop ran is slower (at 1b, 4 sequences: ~8 % on an H100), so a pair's
    # ratio depends on its order; two consecutive pairs have both orders: their geometric mean cancels it
    balanced = [(a * b) ** 0.5 for a, b in zip(ratios, ratios[1:])]
    medians = {name: statistics.median(s) for name, s in speeds.items()}
    out = {"micro_batch": batch, "tokens_per_s": speeds, "ratios": ratios, "balanced_ratios": balanced,
           "median_balanced_ratio": statistics.median(balanced or ratios),
           "ratio_of_medians": medians["peer"] / medians["reference"], "median_tokens_per_s": medians}
    if device.type == "cuda":
        out["peak_gib_both"] = torch.cuda.max_memory_allocated(device) / GIB
    return out


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    result = {"preset": args.preset, "seq_len": args.seq_len, "vocab": args.vocab, "steps": args.steps,
              "blocks": args.blocks, "reference_loss": args.reference_loss, "compiled": not args.no_compile,
              "torch": torch.__version__, "rows": []}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    peer_model, peer_step = peer_loop(args.preset, args, device, {"ckpt": False, "state": "fp32", "chunk": 0,
                                                                   "offload": False})
    ref_model, ref_step = reference_loop(args.preset, args, device, {"ckpt": False})
    from p2p_diloco.train.flops import flops_per_token, mfu, peak_flops

    fpt = flops_per_token(ref_model, args.seq_len)
    result["flops_per_token"] = fpt
    loops = {"peer": lambda x: peer_step(x), "reference": ref_step}
    for batch in (int(b) for b in args.batches.split(",")):
        started = time.monotonic()
        try:
            row = compare(loops, batch, args, device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            row = {"micro_batch": batch, "oom": True}
        if "oom" in row:
            _free(device)
        else:
            peak = peak_flops(device)
            row["mfu"] = {name: mfu(s, fpt, peak) for name, s in row["median_tokens_per_s"].items()}
        row["seconds"] = time.monotonic() - started
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    del peer_model


if __name__ == "__main__":
    main()
