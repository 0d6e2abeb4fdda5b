"""How a reducer combines the senders' copies of one part: the weighted mean, or a robust rule (pure math).

A reducer sees one part of every member's pseudo-gradient, decoded from the bytes it received, so the norms below are
of what a member actually sent: nobody can lie about its own norm. Every rule takes the parts in sender order with their
token weights (weight 0: left out) and returns one fp32 tensor; each is deterministic for a given input.

  * ``mean``:          Σ w_i x_i / Σ w_i, accumulated as hivemind's ``TensorPartReducer`` does (the default path).
  * ``clipped_mean``:  each x_i scaled to at most τ × the median norm of the parts, then the weighted mean.
  * ``centered_clip``: CenteredClip (Karimireddy et al. 2021; per butterfly part as in BTARD, arXiv 2106.11257):
                       from the clipped mean v, ``iterations`` times v ← v + Σ w_i clip(x_i − v, r) / Σ w_i, with r =
                       τ × the median of ‖x_i − v‖.
  * ``trimmed_mean``:  per coordinate, the ⌊β n⌋ largest and smallest values are dropped, the rest averaged by weight.

With n members of which f attack, the clipped rules bound an attacker's pull on the average by about τ × median norm
× w_f / Σ w whatever it sends (the median is an honest norm while f < n / 2); the trimmed mean drops it entirely per
coordinate while f ≤ ⌊β n⌋. What it costs: the reducer holds every sender's copy of a part before combining it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

AGGREGATORS = ("mean", "clipped_mean", "centered_clip", "trimmed_mean")


@dataclass(frozen=True)
class Aggregator:
    """A combining rule and its parameters (``averaging.aggregator``, ``clip_multiple``, ``centered_clip_iters``,
    ``trim_fraction``)."""
    name: str = "mean"
    clip_multiple: float = 2.0
    iterations: int = 3
    trim_fraction: float = 0.25

    def __post_init__(self):
        if self.name not in AGGREGATORS:
            raise ValueError(f"unknown aggregator {self.name!r}")

    @property
    def holds_parts(self) -> bool:
        """Whether a reducer must hold every sender's copy of a part (all but the streaming weighted mean)."""
        return self.name != "mean"

    def __call__(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        kept = [(p.float(), float(w)) for p, w in zip(parts, weights, strict=True) if w > 0]
        if not kept:
            raise ValueError("no part with a positive weight")
        xs, ws = [p for p, _ in kept], [w for _, w in kept]
        if self.name == "mean":
            return weighted_mean(xs, ws)
        if self.name == "clipped_mean":
            return clipped_mean(xs, ws, self.clip_multiple)
        if self.name == "centered_clip":
            return centered_clip(xs, ws, self.clip_multiple, self.iterations)
        return trimmed_mean(xs, ws, self.trim_fraction)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i in sender order, with the same operations as hivemind's ``TensorPartReducer``."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    total = 0.0
    for p, w in zip(parts, weights):
        acc.add_(p, alpha=w)
        total += w
    return acc.div_(total)


def _median(values: torch.Tensor) -> torch.Tensor:
    return values.median()  # the lower median for an even count: deterministic, an honest value while f < n / 2


def _clip_factors(norms: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """min(1, radius / norm), 1 where the norm is 0."""
    return torch.where(norms > radius, radius / norms.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def clipped_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], clip_multiple: float) -> torch.Tensor:
    """Each part scaled to at most ``clip_multiple`` × the median of the parts' norms, then the weighted mean."""
    norms = torch.stack([p.norm() for p in parts])
    factors = _clip_factors(norms, clip_multiple * _median(norms))
    return weighted_mean([p * f for p, f in zip(parts, factors)], weights)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], clip_multiple: float,
                  iterations: int) -> torch.Tensor:
    """CenteredClip from the clipped mean, with the radius re-chosen at each iteration from the median distance."""
    v = clipped_mean(parts, weights, clip_multiple)
    total = sum(weights)
    for _ in range(iterations):
        diffs = [p - v for p in parts]
        norms = torch.stack([d.norm() for d in diffs])
        factors = _clip_factors(norms, clip_multiple * _median(norms))
        step = torch.zeros_like(v)
        for d, f, w in zip(diffs, factors, weights):
            step.add_(d, alpha=float(f) * w)
        v = v + step / total
    return v


def trimmed_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], trim_fraction: float) -> torch.Tensor:
    """Per coordinate: drop the ⌊β n⌋ smallest and largest values (at least one value is kept), weighted mean of the
    rest. Ties are broken by sender order (a stable sort)."""
    n = len(parts)
    k = min(int(trim_fraction * n), (n - 1) // 2)
    stacked = torch.stack([p.reshape(-1) for p in parts])  # (n, values)
    if k == 0:
        return weighted_mean(parts, weights)
    values, order = torch.sort(stacked, dim=0, stable=True)
    w = torch.tensor(weights, dtype=torch.float32)[order[k:n - k]]
    kept = values[k:n - k]
    return ((kept * w).sum(0) / w.sum(0)).view(parts[0].shape)
