"""How a part of a pseudo-gradient goes on the wire: hivemind's 16/32-bit codecs or our block codecs (codecs.py).

hivemind's codec registry is keyed by a protobuf enum, so a new codec cannot be registered there; it does not need to
be: the canonical all-reduce (allreduce.py) encodes every part with a :class:`WireCodec` and decodes every message
itself with :func:`decode_part`. A block-coded part travels in hivemind's ``Tensor`` message with ``dtype`` set to
``block:<codec>`` (so hivemind's own decoder would refuse it rather than misread it) and the codec's bytes as buffer.

Error feedback: a :class:`WireCodec` given ``residuals`` (fp32 buffers shaped like the averaged tensors, in shared
memory) writes there, for every part it encodes, what the recipients will *not* see: ``part - decode(encode(part))``.
The peer adds that residual to its next contribution once the round commits (see ``Averager.error_feedback``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  ScaledFloat16Compression, deserialize_torch_tensor)
from hivemind.proto import runtime_pb2

from p2p_diloco.net.averaging.codecs import BLOCK_CODECS

HIVEMIND_CODECS = {"scaled_fp16": ScaledFloat16Compression, "fp16": Float16Compression, "fp32": NoCompression}
CODEC_NAMES = (*HIVEMIND_CODECS, *BLOCK_CODECS)
BLOCK_TAG = "block:"


def bits_per_value(name: str) -> float:
    """Bits one value takes on the wire with codec ``name`` (per-block scales included)."""
    if name in BLOCK_CODECS:
        return BLOCK_CODECS[name].bits_per_value
    return 32.0 if name == "fp32" else 16.0


def payload_bytes(values: int, codec: str, average_codec: Optional[str] = None) -> int:
    """The all-reduce's payload for the deadline estimator (net/deadlines.py): a peer's parts go up in ``codec``
    and the averages come back in ``average_codec`` (None: the same), each for half of what it moves."""
    return int(values * (bits_per_value(codec) + bits_per_value(average_codec or codec)) / 16)


class WireCodec(CompressionBase):
    """The codec named ``name`` as a hivemind ``CompressionBase``, recording residuals if ``residuals`` is given.

    Parts are cut (by hivemind's ``TensorPartContainer``) at multiples of the codec's block, so the blocks of a part
    are the blocks of its whole tensor: encoding a tensor part by part or whole gives the same values."""

    compression_type = runtime_pb2.CompressionType.NONE  # unused: our runner decodes with decode_part

    def __init__(self, name: str, part_size_bytes: int, residuals: Optional[Sequence[torch.Tensor]] = None):
        if name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {name!r}")
        self.name, self.part_size_bytes, self.residuals = name, part_size_bytes, residuals
        self.block = BLOCK_CODECS[name] if name in BLOCK_CODECS else None
        self._hivemind = None if self.block else HIVEMIND_CODECS[name]()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        tensor = tensor.detach()
        if self.block is None:
            msg = self._hivemind.compress(tensor, info)
        else:
            if info.part_size is not None and info.part_size % self.block.block:
                raise ValueError(f"part of {info.part_size} values is not a whole number of {self.name} blocks")
            msg = runtime_pb2.Tensor(buffer=self.block.encode(tensor).numpy().tobytes(), size=tensor.shape,
                                     dtype=BLOCK_TAG + self.name, compression=self.compression_type)
        if self.residuals is not None:
            self._record_residual(tensor, decode_part(msg), info)
        return msg

    def _record_residual(self, sent: torch.Tensor, received: torch.Tensor, info: CompressionInfo) -> None:
        start = info.part_index * (info.part_size or 0)
        target = self.residuals[info.key].view(-1)[start: start + sent.numel()]
        torch.sub(sent.reshape(-1), received.reshape(-1), out=target)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return decode_part(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Sizes parts (``part_size_values = int(part_size_bytes / (4 x ratio))``): a whole number of blocks."""
        if self.block is None:
            return self._hivemind.estimate_compression_ratio(info)
        values = max(1, int(self.part_size_bytes * 8 / self.block.bits_per_value) // self.block.block)
        values *= self.block.block
        return self.part_size_bytes / (4 * values) * (1 - 2 ** -30)  # a hair low, so the int() above gives values


def decode_part(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """Any part our all-reduce sends, as fp32 values shaped as sent."""
    if not msg.dtype.startswith(BLOCK_TAG):
        return deserialize_torch_tensor(msg)
    codec = BLOCK_CODECS.get(msg.dtype[len(BLOCK_TAG):])
    if codec is None:
        raise ValueError(f"unknown codec {msg.dtype!r} on the wire")
    shape = torch.Size(msg.size)
    data = torch.frombuffer(bytearray(msg.buffer), dtype=torch.uint8) if msg.buffer else torch.empty(0, dtype=torch.uint8)
    return codec.decode(data, shape.numel()).view(shape)
