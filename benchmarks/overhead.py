"""Framework overhead: a peer's inner-loop tokens/s against a plain PyTorch loop with the same model, batch and
optimizer, measured alternately in the same run.

  * plain: this process, one torch thread; the tiny preset built from its config; ``torch.optim.AdamW`` with the
    peer's hyperparameters (weight decay on matrices only), gradient clipping, ``loss.item()`` each step; batches
    of the embedded corpus drawn beforehand, so the loop does nothing but train;
  * peer: a real peer process (``p2p-diloco swarm --peers 1``: its DHT, averager process and p2pd daemon running,
    heartbeats in the roster) doing one round of the same number of inner steps; its tokens/s is the round's
    ``train/tokens / time/inner_s`` (data loading, lr schedule, progress accounting and fault hooks included).

The two alternate ``--reps`` times (plain, peer, plain, peer, ...); the table gives the median of each and the
ratio of medians. Run:

    python benchmarks/overhead.py [--steps 200] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import demo_config, median, rounds_of, swarm_records, table

from p2p_diloco.train.data import build_data
from p2p_diloco.train.model import build_model


def plain_loop(steps: int) -> float:
    """Tokens/s of a bare AdamW loop on the peer's model, batch size and hyperparameters."""
    cfg = demo_config()
    data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, "plain")
    batches = [data.train.next_batch() for _ in range(steps)]
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.inner.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.inner.lr,
                            betas=(cfg.inner.beta1, cfg.inner.beta2))
    start = time.perf_counter()
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return sum(x.numel() for x in batches) / (time.perf_counter() - start)


def peer_loop(steps: int) -> float:
    records = swarm_records(1, 1, steps, demo_config(**{"averaging.min_group_size": 1, "run.eval_every": 0}),
                            "overhead")
    (r,) = [r for r in rounds_of(records["peer0"]) if r["committed"]]
    return r["train/tokens"] / r["time/inner_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="inner steps per measurement (default 200)")
    parser.add_argument("--reps", type=int, default=3, help="measurements of each (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain, peer = [], []
    for rep in range(args.reps):
        plain.append(plain_loop(args.steps))
        peer.append(peer_loop(args.steps))
        print(f"rep {rep}: plain {plain[-1]:.0f} tokens/s, peer {peer[-1]:.0f} tokens/s", flush=True)
    cfg = demo_config()
    print(table(["model", "batch", "plain loop tokens/s", "peer tokens/s", "peer / plain", "runs"],
                [[cfg.model.name, f"{cfg.inner.batch_size} x {cfg.model.seq_len}", f"{median(plain):.0f}",
                  f"{median(peer):.0f}", f"{median(peer) / median(plain):.3f}", args.reps]]))


if __name__ == "__main__":
    main()
