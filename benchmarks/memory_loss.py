"""What the memory options cost in loss: DiLoCo at equal tokens with the inner AdamW's moments in fp32 (the default),
in 8 bits (``inner.optimizer_state = "8bit"``, torchao's AdamW8bit) and on the host (``inner.offload``), from the same
seeds, data and schedule; the final held-out loss of each, median over seeds, and each option's penalty against fp32
(relative, on the medians, and per seed paired with fp32's run of that seed).

Each run is the convergence study's in-process DiLoCo (benchmarks/study.py, ``engine = 'sim'``): ``--peers``
replicas of the peer's own inner loop (``InnerTrainer``, which builds the optimizer the option names exactly as a peer
does), an outer Nesterov step every ``--h`` inner steps, evaluated on the same held-out windows of the embedded
corpus. Gradient checkpointing and the chunked loss are not rows: they compute the same loss and gradients (up to
rounding; tests/test_memory_options.py holds them to it). An option this machine cannot run (8-bit moments without
torchao) is reported "unmeasured" with its reason; nothing is estimated in its place. Results are appended to
``--json`` after every run.

Run:

    python benchmarks/memory_loss.py --device cuda --json benchmarks/results/gpu/memory-loss-h100.json  # ~5 min, H100
    python benchmarks/memory_loss.py --smoke                      # the tiny preset on the CPU: the code path only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, when run from a bare checkout

OPTIONS = {  # the row's name: the config overrides it stands for
    "fp32": (),
    "8bit": (("inner.optimizer_state", "8bit"),),
    "offload": (("inner.offload", True),),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", default="fp32,8bit,offload", help="comma-separated, of " + ", ".join(OPTIONS))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per replica (default 600)")
    parser.add_argument("--h", type=int, default=30, help="inner steps per round (default 30)")
    parser.add_argument("--peers", type=int, default=2, help="DiLoCo replicas (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="global batch in sequences (default 32)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows (default 256)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", help="write the results here (JSON), after every run")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, 4 steps: the code path only")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.steps, args.h, args.batch, args.seq_len, args.eval_windows = "tiny", 4, 2, 4, 64, 8
        args.seeds = "0,1"
    unknown = [o for o in args.options.split(",") if o not in OPTIONS]
    if unknown:
        parser.error(f"--options: unknown {', '.join(unknown)} (known: {', '.join(OPTIONS)})")
    return args


def unmeasurable(option: str, device: str):
    """None if ``option`` runs on ``device`` here, else why not (one line)."""
    if option != "8bit":
        return None
    import torch

    from big_models import torchao_problem

    return torchao_problem(torch.device(device))


def spec_of(option: str, seed: int, args):
    from study import Spec

    return Spec(peers=args.peers, h=args.h, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                preset=args.preset, seed=seed, eval_windows=args.eval_windows, eval_points=1,
                warmup=min(100, args.steps // 6), extra=OPTIONS[option], device=args.device)


def summarize(runs: list[dict], options: list[str], seeds: list[int]) -> list[dict]:
    """One row per option: final losses by seed, their median, and the penalty against fp32 (median and paired)."""
    final = {(r["option"], r["seed"]): r["final"] for r in runs if r.get("final") is not None}
    base = statistics.median(final[("fp32", s)] for s in seeds) if all(("fp32", s) in final for s in seeds) else None
    rows = []
    for option in options:
        losses = [final.get((option, s)) for s in seeds]
        why = next((r["unmeasured"] for r in runs if r["option"] == option and r.get("unmeasured")), None)
        row = {"option": option, "losses": losses, "unmeasured": why}
        if all(x is not None for x in losses):
            row["median"] = statistics.median(losses)
            if base is not None:
                row["penalty_pct"] = 100.0 * (row["median"] / base - 1.0)
                row["paired_pct"] = [100.0 * (final[(option, s)] / final[("fp32", s)] - 1.0) for s in seeds]
        rows.append(row)
    return rows


def table(rows: list[dict], seeds: list[int]) -> str:
    lines = [f"| option | {' | '.join(f'seed {s}' for s in seeds)} | median | vs fp32 (median) | vs fp32 per seed |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for r in rows:
        if r["unmeasured"]:
            lines.append(f"| {r['option']} | " + " | ".join(["unmeasured"] * len(seeds)) +
                         f" | unmeasured: {r['unmeasured']} | | |")
            continue
        losses = " | ".join(f"{x:.4f}" if x is not None else "-" for x in r["losses"])
        pen = f"{r['penalty_pct']:+.2f} %" if "penalty_pct" in r else "-"
        paired = ", ".join(f"{x:+.2f} %" for x in r.get("paired_pct", [])) or "-"
        lines.append(f"| {r['option']} | {losses} | {r.get('median', float('nan')):.4f} | {pen} | {paired} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    from study import run

    options, seeds = args.options.split(","), [int(s) for s in args.seeds.split(",")]
    runs, meta = [], {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.device.startswith("cuda"):
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
    for option in options:
        why = unmeasurable(option, args.device)
        for seed in seeds:
            if why:
                runs.append({"option": option, "seed": seed, "unmeasured": why})
                continue
            result = run(spec_of(option, seed, args))
            runs.append({"option": option, "seed": seed, "final": result["final"], "seconds": result["seconds"],
                         "params": result["params"]})
            print(f"{option} seed {seed}: final held-out loss {result['final']:.4f} in {result['seconds']:.0f} s",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({**meta, "runs": runs}, indent=1))
    rows = summarize(runs, options, seeds)
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "runs": runs, "rows": rows}, indent=1))
    print(f"\n{args.preset}, {args.peers} replicas x {args.steps} inner steps, H={args.h}, batch {args.batch} x "
          f"{args.seq_len}, {args.device}: final held-out loss at equal tokens\n")
    print(table(rows, seeds))


if __name__ == "__main__":
    main()
