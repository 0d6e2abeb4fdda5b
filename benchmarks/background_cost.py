"""What an all-reduce running in the background costs a GPU peer's inner steps (``diloco.overlap = "delayed"``).

With overlap, round t's all-reduce runs in the averager's process (encoding, decoding and reducing on the CPU, p2pd
moving the bytes) while round t+1's inner steps run on the GPU. Every peer times each inner step and notes whether
its all-reduce was exchanging parts (its group formed; matchmaking not counted) when the step began
(``train/step_s_background``, ``train/step_s_alone``: the medians of a round's steps, its first step left out).
The figure: for each round that has both kinds of steps, step time with a background all-reduce over step time
without, in the same round of the same process; the median over the rounds after the first, then the median over
``--runs`` runs. As a second reference the same swarm runs without overlap
(the peers average between rounds, nothing runs beside the inner steps): its median step time against the delayed
run's steps with a background all-reduce.

Two peers on one device: the measured one (peer0) and its averaging partner (peer1), which sleeps 19 times each of
its steps' compute after it (``fault.slowdown`` 20; DyLU gives it about a twentieth of the steps), so that the GPU is
peer0's alone but for about 5 % of the time in either kind of step (two peers training side by side would halve each
one's speed whenever both train, which has nothing to do with the all-reduce). The BPE vocabulary is
benchmarks/gpu.py's (50257 entries, like gpt2's). Made for a GPU machine. Run:

    python benchmarks/background_cost.py [--preset 150m] [--batch 8] [--h 40] [--rounds 5] [--runs 3] \\
        [--codec int4 --codec scaled_fp16]
    python benchmarks/background_cost.py --device cpu --preset tiny --seq-len 64 --batch 4 --vocab 512 --h 20 \\
        --rounds 4 --runs 1 --codec int4   # smoke run anywhere
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import median, rounds_of, swarm_records, table
from gpu import bpe_padded, config_for

PARTNER_SLOWDOWN = 20.0


def one_run(cfg, overlap: str, codec: str, h: int, rounds: int) -> dict:
    """One 2-peer swarm; peer0's per-round ratios of step time with / without a background all-reduce, step times."""
    cfg.diloco.overlap, cfg.averaging.codec = overlap, codec
    cfg.averaging.min_group_size = 2  # config_for's 1 suits gpu.py's single peer; here both average together
    records = swarm_records(2, rounds, h, cfg, f"bg-{overlap}-{codec}", timeout=1200, slowdowns=[1.0, PARTNER_SLOWDOWN])
    rows = [r for r in rounds_of(records["peer0"]) if r["round"] > 1 and r.get("train/inner_steps", 0) > 1]
    ratios = [r["train/step_s_background"] / r["train/step_s_alone"] for r in rows
              if r.get("train/step_s_background") and r.get("train/step_s_alone")]
    steps = sum(r["train/inner_steps"] - 1 for r in rows)
    return {"ratio": median(ratios) if ratios else None, "rounds_with_both": len(ratios),
            "background_share": sum(r["train/steps_background"] for r in rows) / steps if steps else 0.0,
            "step_s": median(r["time/inner_s"] / r["train/inner_steps"] for r in rows),
            "step_s_background": median(r["train/step_s_background"] for r in rows
                                        if r.get("train/step_s_background")) if ratios else None,
            "step_s_alone": median(r["train/step_s_alone"] for r in rows if r.get("train/step_s_alone")),
            "allreduce_s": median(r["outer/allreduce_only_s"] for r in rows if r["committed"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--preset", default="150m", help="model preset (default 150m)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default 50257)")
    parser.add_argument("--h", type=int, default=40, help="inner steps per round (default 40)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per swarm (default 5)")
    parser.add_argument("--runs", type=int, default=3, help="swarms per setting (default 3)")
    parser.add_argument("--threads", type=int, default=4, help="torch CPU threads per peer (default 4)")
    parser.add_argument("--codec", action="append", help="averaging.codec (repeatable; default int4)")
    args = parser.parse_args()
    args.checkpointing = set()
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-bg-") as tmp:
        tokenizer = bpe_padded(Path(tmp) / "bpe", args.vocab)
        for codec in args.codec or ["int4"]:
            delayed, plain = [], []
            for run in range(args.runs):
                delayed.append(one_run(config_for(args, args.preset, args.batch, tokenizer), "delayed", codec,
                                       args.h, args.rounds))
                plain.append(one_run(config_for(args, args.preset, args.batch, tokenizer), "none", codec,
                                     args.h, args.rounds))
                print(f"{codec} run {run}: delayed {delayed[-1]}; none {plain[-1]}", flush=True)
            m = {k: median(r[k] for r in delayed if r[k] is not None) for k in delayed[0]}
            none_step = median(r["step_s"] for r in plain)
            out.append([codec, f"{m['allreduce_s']:.2f}", f"{100 * m['background_share']:.0f} %",
                        f"{m['step_s_alone']:.4f}", f"{m['step_s_background']:.4f}", f"{m['ratio']:.3f}",
                        f"{none_step:.4f}", f"{m['step_s_background'] / none_step:.3f}",
                        sum(r["rounds_with_both"] for r in delayed)])
    print(f"device {args.device}; preset {args.preset}, {args.batch} x {args.seq_len} tokens per step, vocabulary "
          f"{args.vocab}; peer0 of 2 peers on the device (its partner slowed down {PARTNER_SLOWDOWN:g}x), H {args.h}, "
          f"{args.rounds} rounds, median of {args.runs} runs")
    print(table(["codec", "all-reduce s", "steps with a background all-reduce", "step s alone (delayed)",
                 "step s with a background all-reduce (delayed)", "with / alone, same rounds",
                 "step s without overlap (none)", "with / none", "rounds with both kinds"], out))


if __name__ == "__main__":
    main()
