"""What a member may put into an average, decided identically on every member or by the reducer that sees it (pure).

From the all-gathered contributions (the same list on every member), every member derives the same:
  * ``sane_contribution``: a gathered record that is not a well-formed contribution counts as one with no tokens
    (left out), instead of failing the round for everyone; its name loses control characters (it is logged);
  * ``accused``: members that a strict majority of the *other* members name as suspects (a reducer showed them a
    malformed part the member signed, or accused someone without such evidence: evidence.py) are left out, so one
    liar cannot exclude an honest member;
  * ``member_weights``: each participant's weight (its tokens, or 1), capped at ``max_weight_ratio`` × the median
    participant's weight; everyone else's weight is 0. Senders must put exactly this weight on the wire.

What only a reducer sees, the bytes of a part, it checks with ``part_problem``: a part that cannot be decoded, has the
wrong shape, or holds NaN/Inf, or a weight other than the one derived above, makes the reducer fail the round for
every member and name the sender (allreduce.py); members then leave it out for ``averaging.suspect_rounds``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from p2p_diloco.net.records import clean_text


MAX_ELECTORATE = 1 << 20  # a view of the run's size beyond this is not a view (not counted)


def sane_contribution(raw) -> dict:
    """``raw`` (a gathered dict from anyone) as the keyword arguments of a Contribution; malformed → no tokens."""
    fields = {"name": str, "round": int, "digest": str, "tokens": int}
    try:
        out = {k: raw[k] for k in fields}
        if not all(type(out[k]) is t for k, t in fields.items()) or out["tokens"] < 0:
            raise ValueError
        speed = float(raw.get("steps_per_s", 0.0))
        suspects = [s for s in raw.get("suspects", ()) if isinstance(s, str)]
        electorate = _count(raw.get("electorate", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        return dict(name="?", round=-1, digest="", tokens=0)
    out["name"] = clean_text(out["name"]) or "?"  # a name reaches logs and terminals: no control characters
    return dict(out, steps_per_s=speed if math.isfinite(speed) and speed >= 0 else 0.0, suspects=suspects[:64],
                electorate=electorate, live_quorum=_count(raw.get("live_quorum", 0)))


def _count(value) -> int:
    """A member's count of peers (a view of the run's size): an int in [0, MAX_ELECTORATE], else 0 (not counted)."""
    return value if type(value) is int and 0 <= value <= MAX_ELECTORATE else 0


def accused(peer_ids: Sequence[str], suspects: Sequence[Sequence[str]]) -> set[int]:
    """Indices of members named as suspects by a strict majority of the other members."""
    out = set()
    for i, peer in enumerate(peer_ids):
        votes = sum(peer in set(s) for j, s in enumerate(suspects) if j != i)
        if votes * 2 > len(peer_ids) - 1:
            out.add(i)
    return out


def member_weights(tokens: Sequence[int], members: Sequence[int], by_tokens: bool,
                   max_weight_ratio: float) -> list[float]:
    """The weight every member sends and every reducer expects: 0 for non-participants; for participants their
    tokens (or 1), at most ``max_weight_ratio`` × the median participant's (an inflated token count is bounded)."""
    raw = [float(tokens[i]) if by_tokens else 1.0 for i in members]
    cap = max_weight_ratio * float(torch.tensor(raw).median()) if raw else 0.0
    weights = [0.0] * len(tokens)
    for i, w in zip(members, raw):
        weights[i] = min(w, cap)
    return weights


def part_problem(part: torch.Tensor, shape: torch.Size, weight: float, expected_weight: float) -> Optional[str]:
    """Why a decoded part from a sender cannot enter the average, or None."""
    if weight != expected_weight:
        return f"weight {weight:g} where its tokens give {expected_weight:g}"
    if part.dtype != torch.float32 or part.shape != shape:
        return f"a part of shape {tuple(part.shape)} ({part.dtype}) where {tuple(shape)} (torch.float32) was due"
    if not bool(torch.isfinite(part).all()):
        return "NaN or Inf in its part"
    return None
