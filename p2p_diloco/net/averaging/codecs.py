"""PURE: block-quantized wire codecs for pseudo-gradients (8 and 4 bits per value, one fp32 scale per block).

A vector is cut into blocks of ``block`` consecutive values; each block is sent as its fp32 scale followed by one
code per value. Decoding is a table look-up (or an integer) times the block's scale: a single correctly rounded
multiply, so equal bytes decode to equal floats on every CPU. Encoding rounds to the nearest level (deterministic:
the same input gives the same bytes). Encoded layout: ``[scales: n_blocks x fp32][codes]``; the last block is padded
with zeros. Everything is vectorized torch (no Python loop over values) and runs on any device. Imports torch only.

* ``int8``: symmetric absmax integers, codes -127..127, step = absmax / 127 per block.
* ``int4``: symmetric absmax integers, codes -7..7, step = absmax / 7 per block, two codes per byte.
* ``e3m0``: 4-bit sign + 3-bit exponent (no mantissa), magnitudes {0, 2^-6, ..., 2^-1, 1} x absmax per block,
  two codes per byte: the format of Streaming DiLoCo (arXiv 2501.18512), here with a per-block scale.

A block holding a non-finite value decodes to NaN throughout, so a broken contribution is never mistaken for a
finite one (the peer then rejects the round, as it does for a non-finite fp32 average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCALE_BYTES = 4  # one fp32 per block


@dataclass(frozen=True)
class BlockCodec:
    """One block codec. ``levels``: the non-negative magnitudes a code can take, in units of the block's absmax
    (None: uniform integers, code x absmax / qmax)."""
    name: str
    bits: int                            # bits per code: 8 or 4
    block: int                           # values per fp32 scale
    qmax: int = 0                        # integer codecs: largest code
    levels: Optional[tuple] = None       # table codecs: sorted magnitudes (first is 0), as fractions of absmax

    @property
    def bits_per_value(self) -> float:
        """Bits on the wire per value, scales included (the last block's padding excluded)."""
        return self.bits + 8 * SCALE_BYTES / self.block

    def encoded_bytes(self, numel: int) -> int:
        blocks = -(-numel // self.block)
        return blocks * SCALE_BYTES + blocks * self.block * self.bits // 8

    # ------------------------------------------------------------------------------------------- encode
    @torch.no_grad()
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (any shape, float) → uint8 tensor of :meth:`encoded_bytes` bytes."""
        blocks = _blocks(values.detach().reshape(-1).float(), self.block)
        absmax = blocks.abs().amax(dim=1)  # NaN if the block holds a NaN, inf if it holds an inf
        finite = torch.isfinite(absmax)
        if self.levels is None:
            scale = absmax / self.qmax  # the step between two integer codes
            unit = torch.where(finite & (absmax > 0), scale, torch.ones_like(scale))
            codes = torch.round(blocks / unit[:, None]).clamp_(-self.qmax, self.qmax)
            codes = torch.nan_to_num_(codes, nan=0.0).to(torch.int8)
        else:
            scale = absmax
            unit = torch.where(finite & (absmax > 0), absmax, torch.ones_like(absmax))
            codes = self._table_codes(torch.nan_to_num(blocks / unit[:, None], nan=0.0))
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        return torch.cat([scale.contiguous().view(torch.uint8), self._pack(codes)])

    def _table_codes(self, normalized: torch.Tensor) -> torch.Tensor:
        """Nearest level of |x| (ties to the larger one) in the low 3 bits, the sign in bit 3."""
        levels = torch.tensor(self.levels, dtype=torch.float32, device=normalized.device)
        midpoints = (levels[1:] + levels[:-1]) / 2
        index = torch.bucketize(normalized.abs(), midpoints, right=True).to(torch.uint8)
        return index | (normalized < 0).to(torch.uint8) << 3

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        flat = codes.reshape(-1)
        if self.bits == 8:
            return flat.view(torch.uint8)
        nibbles = (flat + self.qmax + 1).to(torch.uint8) if self.levels is None else flat  # integers: 1..15
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    # ------------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """uint8 bytes from :meth:`encode` → fp32 vector of ``numel`` values."""
        blocks = -(-numel // self.block)
        if data.numel() != self.encoded_bytes(numel):
            raise ValueError(f"{self.name}: {data.numel()} bytes cannot hold {numel} values")
        scale = data[: blocks * SCALE_BYTES].view(torch.float32)
        codes = data[blocks * SCALE_BYTES:]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=1).view(-1)
        if self.levels is None:  # integers: exact in fp32
            values = codes.view(torch.int8) if self.bits == 8 else codes.view(torch.int8) - (self.qmax + 1)
            values = values.to(torch.float32)
        else:
            magnitudes = torch.tensor(self.levels, dtype=torch.float32, device=data.device)
            values = torch.cat([magnitudes, -magnitudes])[codes.int()]
        return (values.view(blocks, self.block) * scale[:, None]).view(-1)[:numel]

    @torch.no_grad()
    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """decode(encode(values)), shaped like ``values``: what a recipient reconstructs."""
        return self.decode(self.encode(values), values.numel()).view(values.shape)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


E3M0_LEVELS = (0.0, *(2.0 ** -k for k in range(6, -1, -1)))  # 0, 1/64, 1/32, ..., 1/2, 1

BLOCK_CODECS = {
    "int8": BlockCodec("int8", bits=8, block=256, qmax=127),
    "int4": BlockCodec("int4", bits=4, block=64, qmax=7),
    "e3m0": BlockCodec("e3m0", bits=4, block=64, levels=E3M0_LEVELS),
}


class ErrorFeedback:
    """Sender-side error feedback: what the wire lost of this peer's contribution is added to its next one.

    ``pending`` is written during an all-reduce, for every value this peer sent: contribution − decode(encode(it))
    (in shared memory, by the averager's process). When the round commits, it becomes the ``residual`` that
    :meth:`add_to` adds to the next pseudo-gradient; a round that does not commit leaves the residual as it was (that
    round's contribution was not applied, and the next one carries its work again). Local state: checkpointed.
    """

    def __init__(self, shapes):
        self.pending = [torch.zeros(shape, dtype=torch.float32).share_memory_() for shape in shapes]
        self.residual = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    @torch.no_grad()
    def add_to(self, contribution) -> None:
        for c, r in zip(contribution, self.residual, strict=True):
            c.add_(r)

    @torch.no_grad()
    def commit(self) -> None:
        for r, p in zip(self.residual, self.pending, strict=True):
            r.copy_(p)

    @torch.no_grad()
    def reset(self) -> None:
        """Our θ_global was replaced by another peer's: our past contributions' residual no longer applies."""
        for r in self.residual:
            r.zero_()

    def state_dict(self) -> dict:
        return {"residual": [r.clone() for r in self.residual]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for r, s in zip(self.residual, state["residual"], strict=True):
            r.copy_(s)
