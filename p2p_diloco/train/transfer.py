"""θ_local on the device and θ_global on the host, moved in bulk. Imports torch only.

Once per round the peer computes δ = θ_global − θ_local (device → host) and, after a commit, sets θ_local ← θ_global
(host → device). Done tensor by tensor, a 1B model means hundreds of small copies, each a device sync. Instead:

* the model's parameters become views into one flat device buffer (:func:`flatten_parameters`), and θ_global is
  held in one flat host buffer, pinned when the device is a GPU (:func:`host_copy`), so θ_local ← θ_global is a single
  copy at full DMA speed;
* δ is computed in ``chunk_bytes`` pieces (:class:`DeltaTransfer`): the device copies piece k+1 into one of two
  pinned staging buffers while the CPU subtracts piece k into the averager's buffers, which live in shared memory
  for hivemind's averager process and so cannot be pinned or read by the device directly.

The arithmetic is the reference's (:func:`p2p_diloco.train.outer.pseudo_gradient`), one fp32 subtraction per value,
so the result is bit-identical to it (tested on the CPU, with pieces that cut across tensors).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

DEFAULT_CHUNK_BYTES = 128 * 2 ** 20
"""Size of one device → host piece of δ: large enough for full copy speed, small enough that two pinned staging
buffers cost little host memory."""


def flat_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One 1-D view over ``tensors`` if they lie back to back, in order, in one storage (same dtype, contiguous);
    else None."""
    tensors = [t.detach() for t in tensors]  # views of the same memory, outside autograd
    if not tensors:
        return None
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


@torch.no_grad()
def flatten_parameters(model: torch.nn.Module, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Make ``model``'s parameters views into one new flat buffer on ``device`` (default: their own; values
    unchanged); return it. From the host to a GPU this also moves them, without a second copy on the GPU (a 3B
    model's 12 GB once, not twice, while flattening).

    Call it before an optimizer or DDP is built on the model. Parameters of mixed dtypes or devices are left alone
    (None is returned, and transfers fall back to one copy per tensor)."""
    params = list(model.parameters())
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return None
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=device or params[0].device)
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        view.copy_(p)
        p.data = view
        offset += p.numel()
    return flat


def host_copy(tensors: Iterable[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """fp32 copies of ``tensors`` on the host, as views into one flat buffer (pinned if ``pin``)."""
    tensors = [t.detach() for t in tensors]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, pin_memory=pin)
    out, offset = [], 0
    for t in tensors:
        view = flat[offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += t.numel()
    return out


@torch.no_grad()
def load_params(local_params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor]) -> None:
    """θ_local ← θ_global: one copy when both sides are flat, else one per tensor. Returns once the copy is done
    (the host buffer may be changed right after)."""
    local_flat, global_flat = flat_view(local_params), flat_view(global_params)
    if local_flat is not None and global_flat is not None and local_flat.dtype == global_flat.dtype:
        local_flat.copy_(global_flat)  # host → device from pinned memory: synchronous for the host, one DMA
        return
    for l, g in zip(local_params, global_params, strict=True):
        l.copy_(g)


class DeltaTransfer:
    """δ = θ_global − θ_local into host buffers, for θ_local on any device (see the module docstring)."""

    def __init__(self, local_params: Sequence[torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.local = list(local_params)
        self.device = self.local[0].device if self.local else torch.device("cpu")
        self.flat = flat_view(self.local)
        self.chunk = max(1, chunk_bytes // 4)
        self._staging: list[torch.Tensor] = []

    @torch.no_grad()
    def pseudo_gradient(self, global_params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """Write δ into ``out`` (fp32 host tensors shaped like the parameters)."""
        if self.device.type == "cpu" or self.flat is None:
            for g, l, o in zip(global_params, self.local, out, strict=True):
                torch.sub(g, l.to(o.device, o.dtype), out=o)  # a no-op .to() on the CPU: one pass, no copy
            return
        self.chunked(global_params, out)

    @torch.no_grad()
    def chunked(self, global_params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """The piecewise path (used for devices; callable on the CPU to test it): copy piece k+1 while subtracting
        piece k."""
        total = self.flat.numel()
        starts = list(range(0, total, self.chunk))
        if not starts:
            return
        staging = self._buffers(min(self.chunk, total))
        pending = [self._fetch(starts[0], staging[0])]
        for k, start in enumerate(starts):
            if k + 1 < len(starts):
                pending.append(self._fetch(starts[k + 1], staging[(k + 1) % 2]))
            done = pending[k]
            if done is not None:
                done.synchronize()  # piece k is on the host; piece k+1 is still being copied
            self._subtract(global_params, out, start, staging[k % 2])

    def _buffers(self, size: int) -> list[torch.Tensor]:
        if not self._staging or self._staging[0].numel() < size:
            pin = self.device.type == "cuda"
            self._staging = [torch.empty(size, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        return self._staging

    def _fetch(self, start: int, buffer: torch.Tensor):
        """Start copying the piece at ``start`` into ``buffer``; returns an event to wait on (None on the CPU)."""
        piece = self.flat[start:start + self.chunk]
        buffer[:piece.numel()].copy_(piece, non_blocking=True)
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _subtract(self, global_params, out, start: int, piece: torch.Tensor) -> None:
        end = min(start + self.chunk, self.flat.numel())
        offset = 0
        for g, o in zip(global_params, out, strict=True):
            lo, hi = max(start, offset), min(end, offset + g.numel())
            if lo < hi:
                torch.sub(g.view(-1)[lo - offset:hi - offset], piece[lo - start:hi - start],
                          out=o.view(-1)[lo - offset:hi - offset])
            offset += g.numel()
            if offset >= end:
                break
