"""Run by tests/test_shard.py under torchrun (2 processes, gloo): a sharded peer's Replica takes ``steps`` inner
steps, each rank on its own batches, then rank 0 writes the pseudo-gradient against the initial θ_global, and checks
that θ_local ← θ_global reaches every shard (gathered back, the host copy is θ_global to the bit)."""

from __future__ import annotations

import sys
import types

import torch

from p2p_diloco.config import load_config
from p2p_diloco.train.replica import Replica, build_training, join_ranks
from p2p_diloco.train.transfer import host_copy


def batches(rank: int, steps: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (2, 32), generator=g) for _ in range(steps)]


def main(out: str, steps: int, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = load_config(overrides=dict(o.split("=", 1) for o in overrides))
    ranks = join_ranks(cfg.run)
    training = build_training(cfg, "shard-test", ranks)
    replica = Replica(training, ranks, cfg)
    mine = iter(batches(ranks.rank, steps, training.data.vocab_size))
    if ranks.rank > 0:
        replica.follow(types.SimpleNamespace(train=types.SimpleNamespace(next_batch=lambda: next(mine))))
        replica.leave_group()
        return
    start = host_copy(replica.params, pin=False)  # θ_global: the model before any step
    losses = [replica.step(lambda: next(mine)).loss for _ in range(steps)]
    delta = [torch.empty_like(p) for p in start]
    replica.pseudo_gradient(start, delta)
    replica.load(start)  # θ_local ← θ_global on every shard
    replica._stale = True  # gather the shards back, as after inner steps
    same = all(torch.equal(a, b) for a, b in zip(replica.params, start))
    torch.save({"delta": delta, "losses": losses, "load_reached_shards": same,
                "sharded": replica.shards is not None}, out)
    replica.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
