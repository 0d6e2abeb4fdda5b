"""PURE: what a reducer's average may be, given summaries its senders signed (issue 24, finding 6). Imports torch only.

A reducer sees its senders' parts; a receiver sees only the average. So every sender sends, with each part, a
*summary* of it, covered by the part's signature (evidence.py), and the reducer forwards every participant's signed
summary with the average (attest.py). A summary cuts the part into blocks of :data:`BLOCK` values and gives, per
block, the smallest and largest value (fp32, exact) and the sum (fp64). The reducer checks each summary against the
part (:func:`summary_mismatch`: lo and hi exactly, the sum to fp64 rounding) and refuses a part whose summary lies,
with the signed part and summary as evidence; so every summary a receiver sees is true of what its sender sent.

Each receiver then checks the decoded average against bounds that hold for the run's aggregator whatever the parts
were, with room for the average codec's rounding and fp32 accumulation (:func:`average_problem`):
  * **box**: each value of block b lies in [lo_b, hi_b]: the smallest of the members' ``lo`` and the largest of their
    ``hi`` for ``mean`` (a weighted mean lies in the range of its inputs); for ``trimmed_mean`` trimming k per side,
    the (k+1)-th smallest ``lo`` and the (k+1)-th largest ``hi`` (so up to k lying members, the reducer's own claim
    included, cannot widen it); ``clipped_mean`` and ``centered_clip`` scale parts towards 0, so their box holds 0;
  * **sums** (``mean``, and ``trimmed_mean`` with nothing trimmed): the sum of block b of the average equals the
    weighted mean of the members' block sums: a change of direction (a sign flip, a shift) shows here.
What this does not bound: a reducer's own contribution to its own part is summarized by itself (nobody else sees
it), so under ``mean``, ``clipped_mean`` and ``centered_clip`` it can widen the box and move the sums as its own
contribution could move the mean; within the bounds (a permutation inside a block, zero-sum noise within the box,
for robust rules a direction inside the box) it is not seen; and a codec's rounding room is slack (4-bit codecs:
an eighth to a quarter of a block's largest value per value).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

BLOCK = 4096  # values per summary block: a multiple of every block codec's block (64, 256)
ROW_BYTES = 16  # lo (fp32), hi (fp32), sum (fp64) per block
_SUM_ROUNDING = 2.0 ** -30  # a block sum in fp64, relative to the block's count x its largest value
_TINY = 2.0 ** -120  # fp32 arithmetic on subnormal values rounds by up to 2^-149 whatever their size


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _stats(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of the flattened part: (lo fp32, hi fp32, sum fp64)."""
    flat = part.detach().reshape(-1).float()
    full = flat.numel() // BLOCK
    head, tail = flat[: full * BLOCK].view(full, BLOCK), flat[full * BLOCK:]
    lo, hi, sums = [head.amin(1)], [head.amax(1)], [head.double().sum(1)]
    if tail.numel():
        lo.append(tail.amin().view(1))
        hi.append(tail.amax().view(1))
        sums.append(tail.double().sum().view(1))
    return torch.cat(lo), torch.cat(hi), torch.cat(sums)


def summarize(part: torch.Tensor) -> bytes:
    """The summary a sender signs for a part (as its reducer decodes it): lo ‖ hi (fp32) ‖ sums (fp64), per block."""
    lo, hi, sums = _stats(part)
    return lo.numpy().tobytes() + hi.numpy().tobytes() + sums.numpy().tobytes()


def parse_summary(blob: bytes, numel: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(lo, hi, sums) as fp64 tensors, or None if ``blob`` is not a summary of a part of ``numel`` values."""
    m = blocks(numel)
    if not isinstance(blob, bytes) or len(blob) != m * ROW_BYTES:
        return None
    if m == 0:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty, empty
    data = bytearray(blob)
    lo = torch.frombuffer(data, dtype=torch.float32, count=m).double()
    hi = torch.frombuffer(data, dtype=torch.float32, count=m, offset=4 * m).double()
    sums = torch.frombuffer(data, dtype=torch.float64, count=m, offset=8 * m)
    return lo, hi, sums.clone()


def _counts(numel: int) -> torch.Tensor:
    m = blocks(numel)
    counts = torch.full((m,), float(BLOCK), dtype=torch.float64)
    if m and numel % BLOCK:
        counts[-1] = numel % BLOCK
    return counts


def summary_mismatch(part: torch.Tensor, blob: bytes) -> Optional[str]:
    """Why ``blob`` is not the summary of ``part`` (a finite part as its reducer decoded it), or None."""
    claimed = parse_summary(blob, part.numel())
    if claimed is None:
        return "a part summary of the wrong size"
    lo, hi, sums = (t.double() for t in _stats(part))
    room = _counts(part.numel()) * torch.maximum(lo.abs(), hi.abs()) * _SUM_ROUNDING
    if not (torch.equal(claimed[0], lo) and torch.equal(claimed[1], hi) and bool(((claimed[2] - sums).abs() <= room).all())):
        return "a part summary that does not match its part"
    return None


# what the average codec may change a value by, as a fraction of the largest |value| of its block (integer and table
# block codecs: half a step; e3m0's widest gap is between 1/2 and 1 of the block's scale)
_BLOCK_CODEC_ROOM = {"int8": 1 / 254, "int4": 1 / 14, "e3m0": 1 / 4}


def codec_room(codec: str, a: torch.Tensor) -> torch.Tensor:
    """Per block, how far the average ``codec`` may move any value of a block whose values are at most ``a`` (fp64
    tensor, per block) in magnitude."""
    if codec == "fp32":
        return torch.zeros_like(a)
    if codec == "fp16":  # half an ulp of the value, or of the smallest subnormal
        return a * 2.0 ** -10 + 2.0 ** -24
    if codec == "scaled_fp16":  # fp16 of (x - mean) / std, times std, plus mean: |x - mean| <= a + the part's max;
        # the std is at least fp32's eps (2^-23), so fp16's smallest step (2^-24) is at least 2^-47 of x
        whole = a.max() if a.numel() else a.new_zeros(())
        return (a + whole) * 2.0 ** -10 + whole * 2.0 ** -21 + 2.0 ** -46
    if codec in _BLOCK_CODEC_ROOM:
        return a * _BLOCK_CODEC_ROOM[codec] * (1 + 2.0 ** -8)
    raise ValueError(f"unknown codec {codec!r}")


def average_problem(average: torch.Tensor, claims: Sequence[tuple[float, tuple]], aggregator: str,
                    trim_fraction: float, codec: str) -> Optional[str]:
    """Why the decoded ``average`` of a part cannot be what ``aggregator`` makes of parts with these summaries, or
    None. ``claims``: (weight, parsed summary) of each participant (weight > 0), in sender order. An average that is
    not finite is left to the commit's own check (an overflow is no proof against the reducer)."""
    n = len(claims)
    if n == 0 or average.numel() == 0 or not bool(torch.isfinite(average).all()):
        return None
    lo = torch.stack([c[1][0] for c in claims])
    hi = torch.stack([c[1][1] for c in claims])
    k = min(int(trim_fraction * n), (n - 1) // 2) if aggregator == "trimmed_mean" else 0
    lo_b, hi_b = lo.sort(0).values[k], hi.sort(0).values[n - 1 - k]
    if aggregator in ("clipped_mean", "centered_clip"):
        lo_b, hi_b = lo_b.clamp(max=0.0), hi_b.clamp(min=0.0)
    a = torch.maximum(lo_b.abs(), hi_b.abs())
    a = a + (n + 8) * 2.0 ** -20 * a  # fp32 accumulation and the rule's own arithmetic
    room = (a - torch.maximum(lo_b.abs(), hi_b.abs())) + codec_room(codec, a) + _TINY  # _TINY: subnormal rounding
    got_lo, got_hi, got_sums = (t.double() for t in _stats(average))
    outside = (got_lo < lo_b - room) | (got_hi > hi_b + room)
    if bool(outside.any()):
        b = int(outside.nonzero()[0])
        return (f"values {float(got_lo[b]):.4g}..{float(got_hi[b]):.4g} in block {b} where its members' lie in "
                f"{float(lo_b[b]):.4g}..{float(hi_b[b]):.4g}")
    if aggregator == "mean" or (aggregator == "trimmed_mean" and k == 0):
        weights = torch.tensor([float(w) for w, _ in claims], dtype=torch.float64)
        expected = (torch.stack([c[1][2] for c in claims]) * weights[:, None]).sum(0) / weights.sum()
        counts = _counts(average.numel())
        tolerance = counts * room + counts * a * _SUM_ROUNDING
        off = (got_sums - expected).abs() > tolerance
        if bool(off.any()):
            b = int(off.nonzero()[0])
            return (f"block {b} sums to {float(got_sums[b]):.6g} where its members' weighted mean sums to "
                    f"{float(expected[b]):.6g} (± {float(tolerance[b]):.2g})")
    return None
