"""The block codecs (net/averaging/codecs.py) against a scalar reference, their error bounds, determinism and layout; the wire
adapter's part sizes and residuals (net/averaging/wire.py); error feedback's commit and roll-back."""

from __future__ import annotations

import struct

import pytest
import torch

from p2p_diloco.net.averaging.codecs import BLOCK_CODECS, E3M0_LEVELS, ErrorFeedback

pytestmark = pytest.mark.timeout(60)


def _reference_decode(codec, data: bytes, numel: int) -> list[float]:
    """Byte by byte, value by value: what the codec's layout says the bytes mean."""
    blocks = -(-numel // codec.block)
    scales = struct.unpack(f"<{blocks}f", data[: 4 * blocks])
    codes = data[4 * blocks:]
    if codec.bits == 4:
        codes = [n for byte in codes for n in (byte & 15, byte >> 4)]
    out = []
    for i in range(numel):
        c = codes[i]
        if codec.name == "int8":
            v = c - 256 if c >= 128 else c
        elif codec.name == "int4":
            v = c - 8
        else:
            v = (-1 if c & 8 else 1) * E3M0_LEVELS[c & 7]
        out.append(float(torch.tensor(v, dtype=torch.float32) * torch.tensor(scales[i // codec.block])))
    return out


def _values(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=g)]
    x[:64] = 0.0  # an all-zero block
    return x


@pytest.mark.parametrize("name", sorted(BLOCK_CODECS))
def test_decode_matches_the_scalar_reference_and_encoding_is_deterministic(name):
    codec = BLOCK_CODECS[name]
    x = _values(333)  # not a whole number of blocks: the last one is padded
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.encoded_bytes(333)
    assert torch.equal(codec.encode(x.clone()), data)
    decoded = codec.decode(data, 333)
    assert decoded.tolist() == _reference_decode(codec, data.numpy().tobytes(), 333)
    assert torch.equal(decoded, codec.round_trip(x))


@pytest.mark.parametrize("name", sorted(BLOCK_CODECS))
def test_round_trip_error_is_within_the_codec_bound(name):
    codec = BLOCK_CODECS[name]
    x = _values(4096, seed=1)
    y = codec.round_trip(x)
    blocks = x.view(-1, codec.block)
    absmax = blocks.abs().amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)
    err = (y - x).abs()
    if codec.levels is None:  # nearest integer step: half a step, plus float rounding
        assert (err <= absmax / codec.qmax / 2 * (1 + 1e-5) + 1e-30).all()
    else:  # nearest power of two: a third of the value at most, or half the smallest level below it
        assert (err <= torch.maximum(x.abs() / 3, absmax * E3M0_LEVELS[1] / 2) * (1 + 1e-5)).all()
    assert torch.equal(y.abs().amax(), x.abs().amax())  # the largest value of a block is exact
    assert torch.equal(y[:64], torch.zeros(64))
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))


@pytest.mark.parametrize("name", sorted(BLOCK_CODECS))
def test_a_non_finite_value_poisons_only_its_block(name):
    codec = BLOCK_CODECS[name]
    x = _values(3 * codec.block, seed=2)
    x[codec.block + 5] = float("nan")
    x[2 * codec.block + 1] = float("inf")
    y = codec.round_trip(x)
    assert torch.isfinite(y[: codec.block]).all()
    assert torch.isnan(y[codec.block:]).all()


def test_wire_bits_per_value_and_the_deadline_payload():
    from p2p_diloco.net.averaging.wire import payload_bytes

    assert BLOCK_CODECS["int8"].bits_per_value == 8.125
    assert BLOCK_CODECS["int4"].bits_per_value == BLOCK_CODECS["e3m0"].bits_per_value == 4.5
    assert BLOCK_CODECS["int4"].encoded_bytes(1000) == 16 * 4 + 16 * 32
    assert payload_bytes(1000, "fp32") == 4000 and payload_bytes(1000, "scaled_fp16") == 2000
    assert payload_bytes(1024, "int4") == 576 and payload_bytes(1024, "int4", "int8") == 808


def test_wire_codec_cuts_whole_blocks_and_records_the_residual():
    """Parts are whole blocks of their tensor, so encoding by parts equals encoding the tensor; the residual of each
    part lands where that part lies in its tensor."""
    from hivemind.averaging.partition import TensorPartContainer

    from p2p_diloco.net.averaging.wire import WireCodec, decode_part

    tensors = [_values(5000, seed=3).view(50, 100), _values(37, seed=4)]
    residuals = [torch.full_like(t, float("nan")) for t in tensors]
    codec = WireCodec("int4", part_size_bytes=500, residuals=residuals)
    container = TensorPartContainer(tensors, (0.5, 0.5), compression=codec, part_size_bytes=500)
    parts = [part for peer in container._input_parts_by_peer for part in peer]
    assert len(parts) > 4 and all(info.part_size % 64 == 0 for _, info in parts)
    sent = {}
    for part, info in parts:
        msg = codec.compress(part, info)
        assert len(msg.buffer) <= 500 and msg.dtype == "block:int4"
        sent.setdefault(info.key, []).append(decode_part(msg))
    for i, t in enumerate(tensors):
        whole = BLOCK_CODECS["int4"].round_trip(t.reshape(-1))
        assert torch.equal(torch.cat(sent[i]), whole)
        assert torch.equal(residuals[i].reshape(-1), t.reshape(-1) - whole)


def test_error_feedback_commits_only_committed_rounds_and_round_trips_its_state():
    ef = ErrorFeedback([torch.Size([3]), torch.Size([2, 2])])
    contribution = [torch.ones(3), torch.ones(2, 2)]
    ef.pending[0].fill_(0.5)
    ef.add_to(contribution)  # nothing committed yet
    assert torch.equal(contribution[0], torch.ones(3))
    ef.commit()
    ef.pending[0].fill_(9.0)  # a later round that does not commit
    ef.add_to(contribution)
    assert torch.equal(contribution[0], torch.full((3,), 1.5))
    state = ef.state_dict()
    other = ErrorFeedback([torch.Size([3]), torch.Size([2, 2])])
    other.load_state_dict(state)
    assert torch.equal(other.residual[0], torch.full((3,), 0.5))
    other.reset()
    assert not any(r.any() for r in other.residual)
