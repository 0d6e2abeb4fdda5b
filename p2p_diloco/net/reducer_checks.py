"""PURE checks on the reducers of a butterfly all-reduce; no network, no torch, no hivemind.

Every member of a group evaluates these on the same inputs and reaches the same verdict:
  * :func:`equivocations`: the digests of the averaged parts each member received, compared across members. A
    reducer streams one encoding of its average to every sender (allreduce.py), so honest members hold the same
    digest for every reducer; two different digests for one reducer mean it sent different bytes to different
    members (it equivocated), and the round must not be committed.
  * :func:`capped_fractions`: the share of the vector each member reduces, from hivemind's load balancing, capped so
    that no member's declared bandwidth gets it more than ``max_share`` times an equal share.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence


def equivocations(views: Mapping[str, Sequence[str]], reducers: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """Reducers whose averaged parts differ between members.

    ``views``: member name -> the digest of the averaged parts it received from each reducer, in the order of
    ``reducers`` (reducer names). Returns {reducer: {digest: [members that received it]}} for every reducer for
    which members hold more than one digest; empty when all agree. Member lists are sorted, so every member that
    compares the same views gets the same answer."""
    found = {}
    for r, reducer in enumerate(reducers):
        seen: dict[str, list[str]] = {}
        for member, digests in views.items():
            seen.setdefault(digests[r], []).append(member)
        if len(seen) > 1:
            found[reducer] = {d: sorted(ms) for d, ms in sorted(seen.items())}
    return found


def describe_equivocations(found: Mapping[str, Mapping[str, Sequence[str]]]) -> str:
    """One line naming each equivocating reducer and who got which bytes (digests shortened)."""
    parts = []
    for reducer, seen in found.items():
        got = "; ".join(f"{', '.join(members)} got {digest[:12]}" for digest, members in seen.items())
        parts.append(f"reducer {reducer} sent different averaged bytes to different members ({got})")
        # one of the digests may be a lie of the member that reported it: see README, "Reducer checks"
    return "; ".join(parts)


def sane_bandwidths(bandwidths: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Declared bandwidths as hivemind's load balancing may take them: a value that is not a finite number >= 0
    (NaN, inf, negative, not a number at all) counts as not declared (None: the mean of the others')."""
    def sane(b):
        return b if isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b >= 0 else None
    return [sane(b) for b in bandwidths]


def capped_fractions(sizes: Sequence[float], eligible: Sequence[bool], max_share: float) -> list[float]:
    """``sizes`` (values each member reduces, from load balancing) capped so that no member reduces more than
    ``max_share`` times an equal share of the eligible members (those that may reduce: not client mode, not a zero
    bandwidth); what a capped member loses goes to the others below the cap, equally (water-filling). Returns
    fractions summing to 1. A share can never be capped below an equal one: a lone eligible member reduces all.

    The all-reduce cuts the vector at part boundaries (``part_size_bytes``), so a member's actual share can exceed
    its fraction by up to one part."""
    n = sum(eligible)
    total = float(sum(sizes))
    if n == 0 or total <= 0:
        return [s / total if total > 0 else 0.0 for s in sizes]
    cap = min(1.0, max(max_share, 1.0) / n)
    fractions = [s / total if ok else 0.0 for s, ok in zip(sizes, eligible)]
    excess = 1.0 - sum(fractions)  # what ineligible members were given (none, from hivemind): redistributed too
    for i, f in enumerate(fractions):
        if f > cap:
            excess += f - cap
            fractions[i] = cap
    while excess > 1e-12:
        below = [i for i, ok in enumerate(eligible) if ok and fractions[i] < cap - 1e-15]
        if not below:
            break
        each = excess / len(below)
        for i in below:
            take = min(each, cap - fractions[i])
            fractions[i] += take
            excess -= take
    return fractions
