"""A sharded peer (``inner.shard``, 2 processes, FSDP2) against a one-process peer on the same data: how far apart
are their pseudo-gradients after ``--steps`` inner steps?

The sharded side runs under torchrun (gloo on a CPU machine): each rank takes its own 2 sequences per step; rank 0
computes δ = θ_global − θ_local against the initial θ_global, then checks that θ_local ← θ_global reaches every shard
(gathered back, the host copy is θ_global to the bit), that the AdamW state saved by every rank reads back equal,
and that an evaluation of θ_global through the shards while θ_local is trained on (overlap:
Exchange.global_in_model with shards) gives the one-process loss and leaves θ_local in the shards to the bit. The
one-process side takes both ranks' sequences in one
micro-batch: the same mean loss, the same averaged gradient, the same AdamW steps, summed in another order. Printed
and written to ``--json``: the largest |δ_sharded − δ_one| and the largest |δ|, and both sides' losses.

Run:

    python benchmarks/shard_check.py --preset small --steps 30 --json /tmp/shard-small.json
    python benchmarks/shard_check.py --steps 3        # the tiny preset: what tests/test_shard.py checks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, when run from a bare checkout

from p2p_diloco.config import load_config  # noqa: E402
from p2p_diloco.train.replica import Replica, build_training, join_ranks  # noqa: E402
from p2p_diloco.train.transfer import host_copy, load_params  # noqa: E402
from p2p_diloco.train.inner import evaluate  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer-state", default="fp32", choices=("fp32", "8bit"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another setting for both sides, e.g. model.gradient_checkpointing=true (repeatable)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the sharded side, under torchrun: its output file
    return parser.parse_args(argv)


def settings(args) -> dict:
    return {"model.name": args.preset, "model.seq_len": str(args.seq_len), "inner.batch_size": "2",
            "inner.warmup_steps": "2", "inner.lr": str(args.lr), "run.device": "cpu", "run.threads": "1",
            "inner.optimizer_state": args.optimizer_state, **dict(kv.split("=", 1) for kv in args.set)}


def batches(rank: int, steps: int, vocab: int, seq_len: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (2, seq_len), generator=g) for _ in range(steps)]


def sharded_side(args) -> None:
    """One rank of the sharded peer (under torchrun)."""
    torch.set_num_threads(1)
    cfg = load_config(overrides={**settings(args), "inner.shard": "true", "run.run_dir": os.path.dirname(args.worker)})
    ranks = join_ranks(cfg.run)
    training = build_training(cfg, "shard-check", ranks)
    replica = Replica(training, ranks, cfg)
    mine = iter(batches(ranks.rank, args.steps, training.data.vocab_size, args.seq_len))
    held_out = batches(9, 3, training.data.vocab_size, args.seq_len)  # the same on every rank and side
    if ranks.rank > 0:
        replica.follow(types.SimpleNamespace(train=types.SimpleNamespace(next_batch=lambda: next(mine)),
                                             eval_batches=held_out))
        replica.leave_group()
        mirror = sum(p.numel() * p.element_size() for p in training.model.parameters() if not p.is_meta)
        torch.save({"mirror_bytes": mirror}, f"{args.worker}.rank{ranks.rank}")
        return
    start = host_copy(replica.params, pin=False)  # θ_global: the model before any step
    losses = [replica.step(lambda: next(mine)).loss for _ in range(args.steps)]
    delta = [torch.empty_like(p) for p in start]
    replica.pseudo_gradient(start, delta)
    trained = host_copy(replica.params, pin=False)
    load_params(replica.params, start)  # as Exchange.global_in_model(shards=True) with overlap: θ_global in ...
    replica.broadcast_local()  # ... the shards for the evaluation
    eval_loss = replica.evaluate(held_out)
    load_params(replica.params, trained)  # then θ_local back
    replica.broadcast_local()
    kept = all(torch.equal(a, b) for a, b in zip(replica.gathered(), trained))
    replica.load(start)  # θ_local ← θ_global on every shard
    same = all(torch.equal(a, b) for a, b in zip(replica.gathered(), start))
    saved = _moments(replica.inner.optimizer)
    tag = replica.save_moments()  # every rank its shard, into run_dir/inner-shards
    replica.inner.optimizer.state.clear()  # forgotten here, then read back
    refused = not replica.restore_moments("another checkpoint's") and not replica.inner.optimizer.state
    restored = refused and replica.restore_moments(tag) and _moments(replica.inner.optimizer) == saved
    torch.save({"delta": delta, "losses": losses, "load_reached_shards": same, "moments_restored": restored,
                "eval_loss": eval_loss, "local_kept_through_eval": kept,
                "sharded": replica.shards is not None}, args.worker)
    replica.close()


def _moments(optimizer) -> list:
    """Rank 0's shard of every AdamW state tensor, as plain lists (to compare)."""
    def plain(v):
        v = v.to_local() if hasattr(v, "to_local") else v
        return (v.dequantize() if hasattr(v, "dequantize") else v).tolist()  # torchao's 8-bit moments

    return [[(k, plain(v)) for k, v in sorted(state.items())] for state in optimizer.state.values()]


def one_process_side(args) -> tuple[list[torch.Tensor], list[float]]:
    torch.set_num_threads(1)
    cfg = load_config(overrides=settings(args))
    training = build_training(cfg, "shard-check", None)
    replica = Replica(training, None, cfg)
    start = host_copy(replica.params, pin=False)
    vocab = training.data.vocab_size
    eval_loss = evaluate(training.model, batches(9, 3, vocab, args.seq_len), training.device)  # of θ_global
    both = [torch.cat(pair) for pair in zip(*(batches(r, args.steps, vocab, args.seq_len) for r in (0, 1)))]
    steps = iter(both)
    losses = [replica.step(lambda: next(steps)).loss for _ in range(args.steps)]
    delta = [torch.empty_like(p) for p in start]
    replica.pseudo_gradient(start, delta)
    return delta, losses, eval_loss


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        sharded_side(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sharded.pt")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", out]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"shard_check: the sharded side failed:\n{run.stderr[-3000:]}")
        sharded = torch.load(out)
        mirror_bytes = torch.load(f"{out}.rank1")["mirror_bytes"]  # rank 1's host copy: shapes only
    delta, losses, eval_loss = one_process_side(args)
    result = {"preset": args.preset, "steps": args.steps, "lr": args.lr, "optimizer_state": args.optimizer_state,
              "settings": args.set,
              "sharded": sharded["sharded"], "load_reached_shards": sharded["load_reached_shards"],
              "moments_restored": sharded["moments_restored"], "rank1_host_copy_bytes": mirror_bytes,
              "eval_loss_sharded": sharded["eval_loss"], "eval_loss_one_process": eval_loss,
              "local_kept_through_eval": sharded["local_kept_through_eval"],
              "max_abs_delta_diff": max((a - b).abs().max().item() for a, b in zip(sharded["delta"], delta)),
              "max_abs_delta": max(d.abs().max().item() for d in delta),
              "losses_sharded": sharded["losses"], "losses_one_process": losses}
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
