"""Wire codecs, error feedback and overlap at equal tokens: eval loss of DiLoCo with M replicas, in one process.

The M replicas are what a local swarm's peers ``peer0..peer{M-1}`` hold (the peer's model, InnerTrainer and data
order), trained one after another in this process; each round's contributions and average go through the wire
exactly as in the swarm's all-reduce (p2p_diloco.net.averaging.wire: every contribution encoded with ``codec``, the weighted
mean in fp32, the mean encoded with the average codec; block codecs cut tensors into the same blocks as the swarm's
parts, so their values are the swarm's), with the peer's error feedback (the residual of each replica's contribution
added to its next one) and the peer's overlap bookkeeping (p2p_diloco.train.overlap: the all-reduce of round t is
committed at the end of round t+1, or with τ = ``diloco.overlap_steps`` after τ inner steps of round t+1, the
rest of that round's work added when it ends; the last one is committed after the last round, so every variant ends
at the same tokens). What is not emulated: the order in which a reducer sums contributions, and failures (every
round commits).

Variants (``--variant``, default all): fp32, scaled_fp16, int8, int4, int4+ef, e3m0, e3m0+ef, int4+ef>int8
(int4 contributions, averages sent back in int8), and overlap delayed / eager with int4+ef, delayed also settled
after τ = 1, 2, 5, 10 inner steps (delayed-t1, -t2, -t5, -t10). Results are appended to
``--out`` (JSON lines, one per variant and seed; runs already there are skipped, so an interrupted study resumes);
the table gives the final eval loss, median over seeds, and its gap to fp32 (codecs) or to no overlap (overlap).
The tiny preset (0.46M parameters) at 1000 steps x 4 replicas (4.1M tokens, 45% of its Chinchilla budget) takes
about 6 CPU-minutes per variant and seed; ``--model micro`` (0.12M parameters) at 300 steps (1.2M tokens, 50%)
about 40 s. Shards split the work between processes. Run:

    nice -n 10 python benchmarks/uplink_convergence.py [--steps 1000] [--h 50] [--seeds 0 1 2] [--shard 0/2]
    nice -n 10 python benchmarks/uplink_convergence.py --model micro --steps 300 --h 20 \
        --out benchmarks/results/uplink_convergence_micro.jsonl
    python benchmarks/uplink_convergence.py --table [--out ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from common import demo_config, median, table

VARIANTS = {  # name: (codec, average codec, error feedback, overlap[, overlap_steps τ]); the main comparison first
    "fp32": ("fp32", None, False, "none"),
    "int4+ef": ("int4", None, True, "none"),
    "int4+ef eager": ("int4", None, True, "eager"),
    "int4+ef delayed": ("int4", None, True, "delayed"),
    "int4+ef delayed-t1": ("int4", None, True, "delayed", 1),
    "int4+ef delayed-t2": ("int4", None, True, "delayed", 2),
    "int4+ef delayed-t5": ("int4", None, True, "delayed", 5),
    "int4+ef delayed-t10": ("int4", None, True, "delayed", 10),
    "int4+ef delayed-t20": ("int4", None, True, "delayed", 20),
    "int4+ef delayed-t30": ("int4", None, True, "delayed", 30),
    "int4": ("int4", None, False, "none"),
    "int8": ("int8", None, False, "none"),
    "scaled_fp16": ("scaled_fp16", None, False, "none"),
    "e3m0": ("e3m0", None, False, "none"),
    "e3m0+ef": ("e3m0", None, True, "none"),
    "int4+ef>int8": ("int4", "int8", True, "none"),
}
OVERLAP_BASE = "int4+ef"  # the overlap variants are compared with this one


class Replicas:
    """DiLoCo with ``peers`` replicas configured like a local swarm's peers, in this process."""

    def __init__(self, cfg, peers: int, rounds: int, codec: str, average_codec: Optional[str], error_feedback: bool,
                 overlap: str, overlap_steps: int = 0):
        from p2p_diloco.net.averaging.wire import WireCodec
        from p2p_diloco.train.data import build_data
        from p2p_diloco.train.inner import InnerTrainer
        from p2p_diloco.train.model import build_model
        from p2p_diloco.train.outer import build_outer_optimizer
        from p2p_diloco.train.overlap import Overlap

        self.cfg, self.device = cfg, torch.device("cpu")
        d = cfg.diloco
        total = rounds * d.inner_steps
        self.replicas = []
        for i in range(peers):
            data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, f"peer{i}")
            model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
            self.replicas.append((model, InnerTrainer(model, cfg.inner, self.device, total), data))
        self.eval_batches = self.replicas[0][2].eval_batches
        self.eval_model = build_model(cfg.model, self.replicas[0][2].vocab_size, cfg.run.seed)
        self.params = [p.detach().clone() for p in self.replicas[0][0].parameters()]
        self.outer = build_outer_optimizer(d.outer_optimizer, self.params, d.outer_lr, d.outer_momentum)
        shapes = [p.shape for p in self.params]
        self.codec, self.average_codec = WireCodec(codec, 2 ** 19), WireCodec(average_codec or codec, 2 ** 19)
        self.residuals = [[torch.zeros(s) for s in shapes] for _ in range(peers)] if error_feedback else None
        self.overlaps = [Overlap(overlap, shapes) for _ in range(peers)] if overlap != "none" else None
        self.in_flight: Optional[list[torch.Tensor]] = None
        self.overlap_steps = overlap_steps  # τ: the all-reduce in flight is settled after τ steps of the next round
        self.tokens = 0

    def run_round(self) -> None:
        from p2p_diloco.train.outer import load_into, pseudo_gradient

        H, tau = self.cfg.diloco.inner_steps, self.overlap_steps
        if self.overlaps is None:
            works = self._train(H, pseudo_gradient)
            self.outer.step(self.params, self._average(works), num_contributions=len(works))
            for model, _, _ in self.replicas:
                load_into(model.parameters(), self.params)
            return
        if 0 < tau < H and self.in_flight is not None:  # τ steps, then the all-reduce in flight is settled
            self._settle(self._train(tau), arrived=True)
            self._settle(self._train(H - tau), arrived=False)  # nothing in flight: all this round's work goes out
        else:  # settled at the end of the round (τ = 0, the peer's default)
            self._settle(self._train(H), arrived=self.in_flight is not None)
        self.in_flight = self._average([ov.sent for ov in self.overlaps])

    def _train(self, steps: int, pseudo_gradient=None) -> list[list[torch.Tensor]]:
        """``steps`` inner steps on every replica; each one's work since its last restart (or pseudo-gradient)."""
        works = []
        for i, (model, inner, data) in enumerate(self.replicas):
            for _ in range(steps):
                self.tokens += inner.step(data.train.next_batch).tokens
            work = [torch.empty_like(p) for p in self.params]
            if pseudo_gradient is not None:
                pseudo_gradient(self.params, model.parameters(), work)
            else:
                self.overlaps[i].work(self.params, model.parameters(), work)
            works.append(work)
        return works

    def _settle(self, works: list[list[torch.Tensor]], arrived: bool) -> None:
        """The peer's Exchange.settle: the average in flight committed if it ``arrived``, then every replica's
        bookkeeping (train/overlap.py) and θ_local restarted."""
        if arrived:
            self.outer.step(self.params, self.in_flight, num_contributions=len(works))
            self.in_flight = None
        for ov, work, (model, _, _) in zip(self.overlaps, works, self.replicas):
            # equal tokens per replica: equal shares of the average
            ov.advance(work, arrived, 1 / len(works), self.outer.step_response)
            ov.restart(model.parameters(), self.params)

    def drain(self) -> None:
        """Commit the all-reduce still in flight (overlap): every variant then holds all of its tokens' work."""
        if self.in_flight is not None:
            self.outer.step(self.params, self.in_flight, num_contributions=len(self.replicas))
            self.in_flight = None

    def _average(self, contributions: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        total = [torch.zeros_like(p) for p in self.params]
        for i, contribution in enumerate(contributions):
            if self.residuals is not None:
                contribution = [c + r for c, r in zip(contribution, self.residuals[i])]
            sent = self._wire(self.codec, contribution)
            if self.residuals is not None:
                self.residuals[i] = [c - s for c, s in zip(contribution, sent)]
            for t, s in zip(total, sent):
                t.add_(s)  # equal weights (equal tokens per replica)
        return self._wire(self.average_codec, [t / len(contributions) for t in total])

    @staticmethod
    def _wire(codec, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        from hivemind.compression import CompressionInfo

        from p2p_diloco.net.averaging.wire import decode_part

        return [decode_part(codec.compress(t.reshape(-1), CompressionInfo.from_tensor(t.reshape(-1), key=i)))
                .view_as(t) for i, t in enumerate(tensors)]

    def evaluate(self) -> float:
        from p2p_diloco.train.inner import evaluate
        from p2p_diloco.train.outer import load_into

        load_into(self.eval_model.parameters(), self.params)
        return evaluate(self.eval_model, self.eval_batches, self.device)


def model_name(model: str) -> str:
    """``model.name`` for --model: a preset, or "micro" (0.12M parameters: 2 layers x 64, MLP 192, byte vocabulary)."""
    if model != "micro":
        return model
    from transformers import LlamaConfig

    path = Path(tempfile.gettempdir()) / "uplink-convergence-micro" / "config.json"
    path.parent.mkdir(exist_ok=True)
    LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=192, vocab_size=256, max_position_embeddings=1024,
                tie_word_embeddings=True).to_json_file(str(path))
    return str(path)


def run(variant: str, seed: int, peers: int, steps: int, h: int, eval_every: int, model: str,
        outer: dict) -> dict:
    codec, average_codec, ef, overlap, *tau = VARIANTS[variant]
    cfg = demo_config(**{"data.seed": seed, "run.seed": seed, "diloco.inner_steps": h, "data.eval_batches": 16,
                         "model.name": model_name(model), **outer})
    rounds = steps // h
    replicas = Replicas(cfg, peers, rounds, codec, average_codec, ef, overlap, *tau)
    start = time.perf_counter()
    curve = [(0, replicas.evaluate())]
    for r in range(1, rounds + 1):
        replicas.run_round()
        if r == rounds:
            replicas.drain()
        if r % eval_every == 0 or r == rounds:
            curve.append((replicas.tokens, replicas.evaluate()))
    return {"variant": variant, "seed": seed, "model": model, "peers": peers, "steps": steps, "h": h, "curve": curve,
            "final": curve[-1][1], "tokens": replicas.tokens, "seconds": time.perf_counter() - start,
            "outer_lr": cfg.diloco.outer_lr, "outer_momentum": cfg.diloco.outer_momentum, "inner_lr": cfg.inner.lr}


def print_table(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    finals = {v: median(r["final"] for r in runs) for v, runs in by_variant.items()}
    out = []
    for v in VARIANTS:
        if v not in by_variant:
            continue
        runs = sorted(by_variant[v], key=lambda r: r["seed"])
        base = OVERLAP_BASE if VARIANTS[v][3] != "none" else "fp32"
        gap = f"{100 * (finals[v] / finals[base] - 1):+.2f}% vs {base}" if base in finals and v != base else ""
        from p2p_diloco.net.averaging.wire import bits_per_value

        codec, average_codec = VARIANTS[v][:2]
        bits = (bits_per_value(codec) + bits_per_value(average_codec or codec)) / 2
        out.append([v, f"{bits:g}", runs[0]["tokens"], f"{finals[v]:.4f}", gap,
                    " / ".join(f"{r['final']:.4f}" for r in runs), len(runs)])
    r0 = rows[0]
    print(f"{r0['peers']} replicas, H={r0['h']}, {r0['steps']} inner steps each; outer lr {r0['outer_lr']}, "
          f"momentum {r0['outer_momentum']}, inner lr {r0['inner_lr']}\n")
    print(table(["variant", "bits per value on the wire (mean of up and down)", "tokens",
                 "final eval loss (median)", "gap", "per seed", "seeds"], out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--model", default="tiny", help="model preset, or micro (0.12M parameters; 300 steps x 4 "
                        "replicas are 50%% of its Chinchilla budget) (default tiny)")
    parser.add_argument("--peers", type=int, default=4, help="replicas M (default 4)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per replica (default 1000: 4.1M tokens "
                        "with 4 replicas, 45%% of the tiny model's Chinchilla budget)")
    parser.add_argument("--h", type=int, default=50, help="inner steps per round (default 50)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=5, help="rounds between evaluations (default 5)")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th (variant, seed) from the i-th")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="diloco.outer_lr (default 0.7: what the results "
                        "in benchmarks/uplinks.md were measured with, before 'auto' became the default)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="diloco.outer_momentum (default 0.9)")
    parser.add_argument("--out", default="benchmarks/results/uplink_convergence.jsonl")
    parser.add_argument("--table", action="store_true", help="only print the table of --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table:
        return print_table(out)
    torch.set_num_threads(1)
    out.parent.mkdir(parents=True, exist_ok=True)
    outer = {"diloco.outer_lr": args.outer_lr, "diloco.outer_momentum": args.outer_momentum}
    key = (args.steps, args.h, args.model, args.outer_lr, args.outer_momentum)
    done = set()
    if out.exists():
        done = {(r["variant"], r["seed"], r["steps"], r["h"], r.get("model", "tiny"), r["outer_lr"],
                 r["outer_momentum"]) for r in map(json.loads, out.read_text().splitlines())}
    jobs = [(v, s) for s in args.seeds for v in (args.variant or list(VARIANTS))]  # every variant once, then again
    index, count = map(int, args.shard.split("/"))
    for v, s in jobs[index::count]:
        if (v, s, *key) in done:
            continue
        result = run(v, s, args.peers, args.steps, args.h, args.eval_every, args.model, outer)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{v} seed {s}: eval loss {result['final']:.4f} at {result['tokens']} tokens "
              f"({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
