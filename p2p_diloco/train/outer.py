"""PURE outer-loop math: pseudo-gradients and outer optimizers on θ_global. Imports torch only.

θ_global and the momentum buffer m live on the CPU in fp32. Every peer of a group applies the outer step to the
same averaged bytes; to get the same result bits on every CPU, each update below is a chain of single elementwise
ops (each correctly rounded) rather than fused multiply-adds, whose use varies between CPUs and kernels.
"""

from __future__ import annotations

import abc
import hashlib
from typing import Iterable, Sequence

import torch


@torch.no_grad()
def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Iterable[torch.Tensor],
                    out: Sequence[torch.Tensor]) -> None:
    """δ = θ_global − θ_local, written into ``out`` (fp32, CPU). Sign convention: δ acts like a gradient."""
    for g, l, o in zip(global_params, local_params, out, strict=True):
        o.copy_(l.detach(), non_blocking=False)  # device → CPU and dtype → fp32 in one copy
        torch.sub(g, o, out=o)


@torch.no_grad()
def load_into(local_params: Iterable[torch.Tensor], global_params: Sequence[torch.Tensor]) -> None:
    """θ_local ← θ_global (the start of every round)."""
    for l, g in zip(local_params, global_params, strict=True):
        l.detach().copy_(g)


def params_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 (hex) of the raw bytes of ``tensors`` in order: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    _update(h, tensors)
    return h.hexdigest()


def state_digests(params: Sequence[torch.Tensor], optimizer_state: Sequence[torch.Tensor]) -> tuple[str, str]:
    """(digest of θ_global, digest of θ_global followed by the outer optimizer state), hashing θ only once."""
    h = hashlib.sha256()
    _update(h, params)
    params_hex = h.hexdigest()
    _update(h, optimizer_state)
    return params_hex, h.hexdigest()


def _update(h, tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())


class OuterOptimizer(abc.ABC):
    """Applies an averaged pseudo-gradient Δ to θ_global in place.

    ``num_contributions`` is how many peers' pseudo-gradients the round averaged (k), for rules such as Delayed
    Nesterov that count arrivals. The state (e.g. momentum) must be identical on every peer, so it is shared with
    joiners and checkpointed through :meth:`state_tensors`.
    """

    @abc.abstractmethod
    def step(self, params: Sequence[torch.Tensor], avg_pseudo_grads: Sequence[torch.Tensor],
             num_contributions: int = 1) -> None:
        ...

    @abc.abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        ...

    def state_dict(self) -> dict:
        return {"tensors": [t.clone() for t in self.state_tensors()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for t, s in zip(self.state_tensors(), state["tensors"], strict=True):
            t.copy_(s)


class OuterSGD(OuterOptimizer):
    """θ ← θ − ε·Δ (with ε = 1: plain averaging of the replicas, i.e. federated averaging)."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float):
        self.lr = lr

    @torch.no_grad()
    def step(self, params, avg_pseudo_grads, num_contributions: int = 1) -> None:
        for p, d in zip(params, avg_pseudo_grads, strict=True):
            p.sub_(d * self.lr)

    def state_tensors(self) -> list[torch.Tensor]:
        return []


class OuterNesterov(OuterOptimizer):
    """DiLoCo's outer step: m ← β·m + Δ;  θ ← θ − ε·(Δ + β·m).

    Same semantics as ``torch.optim.SGD(lr=ε, momentum=β, nesterov=True, dampening=0)`` applied to Δ as the gradient.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.buffers = [torch.zeros_like(p, dtype=torch.float32, device="cpu") for p in params]

    @torch.no_grad()
    def step(self, params, avg_pseudo_grads, num_contributions: int = 1) -> None:
        for p, d, m in zip(params, avg_pseudo_grads, self.buffers, strict=True):
            m.mul_(self.momentum).add_(d)
            update = m * self.momentum
            update.add_(d).mul_(self.lr)
            p.sub_(update)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.buffers


def auto_outer(peers: int, inner_steps: int) -> tuple[float, float]:
    """(outer lr, outer momentum) of ``diloco.outer_lr = "auto"`` for a run of ``peers`` peers, H = ``inner_steps``.
    PLACEHOLDER until the sweep is in."""
    return 0.7, 0.9


def build_outer_optimizer(name: str, params: Sequence[torch.Tensor], lr: float, momentum: float) -> OuterOptimizer:
    if name == "nesterov":
        return OuterNesterov(params, lr, momentum)
    if name == "sgd":
        return OuterSGD(params, lr)
    raise ValueError(f"unknown outer optimizer {name!r}")
