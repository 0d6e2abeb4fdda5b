"""The inner AdamW with its moments, an fp32 master copy of the parameters and the gradient sums in host memory
(``inner.offload``; ZeRO-Offload's split of the work): the device keeps the fp32 parameters (θ_local, what the round
reads and writes) and, during a backward, each gradient only until its copy to the host is queued. The update runs
on the CPU, then the new parameters are copied back. On a 24 GB card this is what lets a 3B model train: its
parameters take 12 GB, and the 12 GB of gradients and 24 GB of moments (6 with 8-bit moments) stay on the host.

Costs, per inner step: the gradient of every micro-batch goes to the host (4 bytes per parameter, asynchronously for
the first micro-batch of a step; later ones wait for their copy into a third pinned buffer and are added on the
CPU), the CPU's AdamW step (memory-bound: ~28 bytes per parameter read or written), and the parameters back to the
device (4 bytes per parameter). More micro-batches per step (inner.grad_accum) spread the last two.

θ_local may be changed outside the step (θ_local ← θ_global at each round, a rebase, a checkpoint): the parameters'
version counter says so, and the next step first copies them into the master copy.
"""

from __future__ import annotations

from typing import Callable

import torch


class HostAdamW:
    """An optimizer over ``groups`` of device parameters whose update runs on host copies (``make`` builds the host
    optimizer from the host groups: AdamW, fused on the CPU, or AdamW8bit). Exposes the host optimizer's
    ``param_groups`` (learning rate, weight decay), ``zero_grad``, ``step``, ``state_dict`` and ``load_state_dict``;
    :meth:`host_parameters` are what gradient clipping must see (the device's gradients are gone by then)."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer],
                 device: torch.device):
        self.device, self.pin = device, device.type == "cuda"
        self.params = [p for g in groups for p in g["params"]]
        # two flat host buffers (master copy, gradient sums), one view per parameter: one pinned allocation each
        # (the pinned allocator rounds every allocation up to a power of two)
        total = sum(p.numel() for p in self.params)
        self.flat = torch.empty(total, dtype=torch.float32, pin_memory=self.pin)
        self.flat_grad = torch.empty(total, dtype=torch.float32, pin_memory=self.pin)
        self.host: dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in self.params:
            h = self.flat[offset:offset + p.numel()].view(p.shape)
            h.copy_(p.detach())
            h.grad = self.flat_grad[offset:offset + p.numel()].view(p.shape)
            self.host[p] = h
            offset += p.numel()
        host_groups = [{**g, "params": [self.host[p] for p in g["params"]]} for g in groups]
        self.optimizer = make(host_groups)
        self.param_groups = self.optimizer.param_groups
        self.received: set[int] = set()  # parameters whose gradient of this step reached the host
        self.flat_staging = None  # later micro-batches' gradients land here before they are added
        self.seen_version = None  # θ_local's version after our last write; None: copy it to the host first
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._to_host)

    @torch.no_grad()
    def _to_host(self, p: torch.Tensor) -> None:
        grad = self.host[p].grad
        if id(p) in self.received:  # a later micro-batch of the step: copy (waiting for it), then add
            staging = self._staging(p)
            staging.copy_(p.grad)
            grad.add_(staging)
        else:  # the first: queued on the device's stream, which orders the memory's reuse after it
            grad.copy_(p.grad, non_blocking=True)
            self.received.add(id(p))
        p.grad = None

    def _staging(self, p: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer the size of ``p`` (views of one buffer made at the first need: with inner.grad_accum
        1 there is none)."""
        if self.flat_staging is None:
            self.flat_staging = torch.empty(self.flat.numel(), dtype=torch.float32, pin_memory=self.pin)
            self.offsets, offset = {}, 0
            for q in self.params:
                self.offsets[id(q)] = offset
                offset += q.numel()
        start = self.offsets[id(p)]
        return self.flat_staging[start:start + p.numel()].view(p.shape)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.received.clear()
        for p in self.params:
            p.grad = None

    def host_parameters(self) -> list[torch.Tensor]:
        """The host parameters with this step's gradients (parameters without one have none), once every copy has
        arrived."""
        if self.pin:
            torch.cuda.synchronize(self.device)
        out = []
        for p in self.params:
            h = self.host[p]
            if id(p) not in self.received:
                h.grad = None
            elif h.grad is None:  # cannot happen: received parameters keep their buffer
                raise RuntimeError("offload: a received gradient has no host buffer")
            out.append(h)
        return out

    @torch.no_grad()
    def step(self) -> None:
        hosts = self.host_parameters()
        if self.seen_version != self._version():  # θ_local changed outside the step: the master follows
            for p in self.params:
                self.host[p].copy_(p.detach())
        self.optimizer.step()
        offset = 0
        for p, h in zip(self.params, hosts):
            p.detach().copy_(h, non_blocking=True)  # pinned: asynchronous; the next forward is queued after it
            if h.grad is None:  # give back the buffer a parameter without gradient lost this step
                h.grad = self.flat_grad[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.received.clear()
        self.seen_version = self._version()

    def _version(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.params)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        self.seen_version = None  # θ_local comes from the checkpoint: copy it to the host at the next step
