"""An exact in-process DiLoCo: the M replicas of a swarm trained one after another in one process. No network.

Each replica is what a peer named ``peer{i}`` of a local swarm holds: the model built from the run's seed, an
:class:`~p2p_diloco.train.inner.InnerTrainer` with the run's schedule, and that peer's data order. A round runs H
inner steps on every replica, averages the pseudo-gradients with the weights a peer sends (its tokens, or 1),
optionally passes each contribution and the average through the run's wire codec (as the all-reduce does), applies
the outer optimizer a peer builds to θ_global, and resets every replica to it. With the fp32 codec a real swarm's
eval curve matches this one to float rounding (the order in which the all-reduce sums contributions varies); see
benchmarks/learning-quality.md 7.7 and 7.8. It is the study's cheap engine: no processes, no matchmaking, one thread.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from p2p_diloco.config import Config
from p2p_diloco.train.data import Data, WindowBatches, build_data, peer_seed
from p2p_diloco.train.inner import InnerTrainer, evaluate, schedule_total_steps
from p2p_diloco.train.model import build_model
from p2p_diloco.train.outer import build_outer_optimizer, load_into, pseudo_gradient, resolve_auto


def replica_data(cfg: Config, num_peers: int) -> tuple[Data, list]:
    """(peer0's Data, the training readers of peer0..peer{num_peers-1}): the orders a local swarm's peers read.

    The corpus is tokenized once; window readers of the other peers share its tokens."""
    data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, "peer0")
    readers = [data.train]
    for i in range(1, num_peers):
        name = f"peer{i}"
        if isinstance(data.train, WindowBatches):
            readers.append(WindowBatches(data.train.tokens, cfg.model.seq_len, cfg.inner.batch_size,
                                         peer_seed(cfg.data.seed, name)))
        else:
            readers.append(build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, name).train)
    return data, readers


class ReferenceDiLoCo:
    """DiLoCo with ``num_peers`` replicas in this process, configured like a swarm's peers by ``cfg``.

    ``cfg.run.rounds`` and ``cfg.diloco.inner_steps`` set the inner lr schedule as on a peer. ``codec``: None
    averages exactly in fp32; 'fp32', 'fp16' or 'scaled_fp16' round-trip every contribution and the average
    through the wire codec of that name first (net/averaging/wire.py: the all-reduce's precision).
    ``device``: where the replicas train (θ_global and the outer step stay in fp32 on the CPU, as on a peer).
    ``plain_rounds``: the first rounds average plainly (θ_global ← the mean of the replicas), without the outer step.
    ``combine(parts, weights)``: replaces the weighted mean, per parameter tensor (a robust aggregator, as a reducer
    applies it per part); ``tamper(replica, round, delta)``: changes a replica's pseudo-gradient in place before it is
    averaged (an attacking member; both for the security tests).
    """

    def __init__(self, cfg: Config, num_peers: int, codec: Optional[str] = None, plain_rounds: int = 0,
                 combine: Optional[Callable] = None, tamper: Optional[Callable] = None, device: str = "cpu"):
        self.cfg, self.codec, self.plain_rounds = cfg, codec, plain_rounds
        self.combine, self.tamper = combine, tamper
        self.device = torch.device(device)
        self.data, readers = replica_data(cfg, num_peers)
        total = schedule_total_steps(cfg.inner, cfg.run.rounds, cfg.diloco.inner_steps)
        self.replicas = []
        for reader in readers:
            model = build_model(cfg.model, self.data.vocab_size, cfg.run.seed).to(self.device)
            self.replicas.append((model, InnerTrainer(model, cfg.inner, self.device, total), reader))
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.replicas[0][0].parameters()]
        d = cfg.diloco
        resolve_auto(d, num_peers)
        self.outer = build_outer_optimizer(d.outer_optimizer, self.params, d.outer_lr, d.outer_momentum, d.dn_delay,
                                           d.dn_c)
        self.round = 0
        self.tokens = 0  # training tokens of all replicas so far
        self.stats: list[dict] = []  # per round: how the pseudo-gradients relate (see _stats)
        self._previous: Optional[torch.Tensor] = None

    def run_round(self) -> float:
        """H inner steps on every replica, then the averaged outer step; returns the mean training loss."""
        total = [torch.zeros_like(p) for p in self.params]
        weight_sum, losses, norms = 0.0, [], []
        delta = [torch.empty_like(p) for p in self.params]
        sent, weights = [], []
        for index, (model, inner, reader) in enumerate(self.replicas):
            tokens = 0
            for _ in range(self.cfg.diloco.inner_steps):
                out = inner.step(reader.next_batch)
                losses.append(out.loss)
                tokens += out.tokens
            pseudo_gradient(self.params, model.parameters(), delta)
            if self.tamper is not None:
                self.tamper(index, self.round + 1, delta)
            norms.append(_norm(delta))
            weight = float(tokens) if self.cfg.diloco.weight_by_tokens else 1.0
            if self.combine is not None:
                sent.append([d.clone() for d in self._wire(delta)])
                weights.append(weight)
            else:
                for t, d in zip(total, self._wire(delta)):
                    t.add_(d, alpha=weight)
            weight_sum += weight
            self.tokens += tokens
        if self.combine is not None:
            total = [self.combine([s[j] for s in sent], weights) for j in range(len(total))]
        else:
            total = [t.div_(weight_sum) for t in total]
        averaged = self._wire(total)
        self._stats(averaged, norms)
        if self.round < self.plain_rounds:  # a study knob: plain averaging before the outer optimizer takes over
            for p, d in zip(self.params, averaged):
                p.sub_(d)
        else:
            self.outer.step(self.params, averaged, num_contributions=len(self.replicas))
        for model, _, _ in self.replicas:
            load_into(model.parameters(), self.params)
        self.round += 1
        return sum(losses) / len(losses)

    def _stats(self, averaged: list[torch.Tensor], norms: list[float]) -> None:
        """``agreement``: |Δ| / mean |δ_i| (1: the replicas moved alike; 1/sqrt(M): independent directions);
        ``cos_previous``: cosine of Δ with the previous round's Δ (> 0: rounds push the same way, which outer momentum
        amplifies; < 0: they undo each other)."""
        flat = torch.cat([a.flatten() for a in averaged])
        cos = None
        if self._previous is not None:
            cos = float(flat @ self._previous / (flat.norm() * self._previous.norm()).clamp_min(1e-30))
        self._previous = flat
        self.stats.append({"norm": float(flat.norm()), "agreement": float(flat.norm()) / (sum(norms) / len(norms)),
                           "cos_previous": cos})

    def evaluate(self, batches: Optional[list[torch.Tensor]] = None) -> float:
        """Held-out loss of θ_global (every replica holds it between rounds) on ``batches`` (default: the run's)."""
        return evaluate(self.replicas[0][0], batches or self.data.eval_batches, self.device)

    def _wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.codec is None:
            return tensors
        from hivemind.compression import CompressionInfo  # only for emulation

        from p2p_diloco.net.averaging.wire import WireCodec, decode_part

        codec = WireCodec(self.codec, self.cfg.averaging.part_size_bytes)
        flat = [t.detach().flatten() for t in tensors]
        return [decode_part(codec.compress(f, CompressionInfo.from_tensor(f))).view_as(t) for f, t in zip(flat, tensors)]


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))
