"""PURE: Dynamic Local Updates (Asynchronous Local-SGD, arXiv 2401.09135, Eq. 6) and the lr schedule's clock.

Peers of different speeds run different numbers of inner steps so that their rounds end together: with v_i the
measured inner steps per second of peer i and H = ``diloco.inner_steps``, peer i runs
H_i = max(min_inner_steps, floor(v_i / max_j v_j · H)) steps, the maximum taken over the live roster (peers that
left or whose entry expired do not count) and this peer's own speed. A peer publishing a speed it does not have can
only make the others' rounds shorter, never longer than H, and never below ``min_inner_steps``; a dead peer stops
counting when its roster entry expires.

Speeds are steps per second, not tokens per second, because machines of one run may use different micro-batches
(the number of tokens per step is a machine setting); steps per second is what makes rounds end together.
No torch, no network.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable, Optional

PROBE_STEPS = 3  # a peer with no measurement yet times this many steps (training steps) before planning its round


class PaceMeter:
    """This peer's inner-step speed: the median of the per-round rates of its last ``window`` measured rounds.

    The median (rather than a pooled mean) keeps one disturbed round, such as a peer frozen for a while, from
    dictating the next rounds. Rates exclude averaging: only the time spent in inner steps is measured.
    """

    def __init__(self, window: int = 3):
        self._steps_per_s: deque[float] = deque(maxlen=window)
        self._tokens_per_s: deque[float] = deque(maxlen=window)

    def add(self, steps: int, tokens: int, seconds: float) -> None:
        if steps > 0 and seconds > 0:
            self._steps_per_s.append(steps / seconds)
            self._tokens_per_s.append(tokens / seconds)

    @property
    def measured(self) -> bool:
        return bool(self._steps_per_s)

    @property
    def steps_per_s(self) -> float:
        return statistics.median(self._steps_per_s) if self._steps_per_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self._tokens_per_s) if self._tokens_per_s else 0.0


def local_steps(own: float, others: Iterable[float], inner_steps: int, min_steps: int) -> int:
    """H_i of Eq. 6 for a peer of speed ``own`` (steps/s) next to the live peers' ``others``; ``inner_steps`` (H)
    when ``own`` is unknown (<= 0). Non-finite or non-positive speeds of others (not measured yet) are ignored."""
    if not own > 0 or not math.isfinite(own):
        return inner_steps
    fastest = max([v for v in others if math.isfinite(v) and v > 0] + [own])
    return min(inner_steps, max(min_steps, math.floor(own / fastest * inner_steps)))


def schedule_position(round_: int, step_in_round: int, steps_in_round: int, inner_steps: int) -> float:
    """The lr schedule's step for the ``lr_clock = "rounds"`` clock: the run's progress in units of H steps,
    round · H + the share of this round's steps done · H. Every peer is at the same point of the schedule in the same
    round, whatever its H_i; with H_i = H and no failed rounds it equals the peer's own step count."""
    return round_ * inner_steps + step_in_round * inner_steps / max(1, steps_in_round)


def planned_steps(own: Optional[float], live_speeds: Iterable[float], inner_steps: int, min_steps: int,
                  dylu: bool) -> int:
    """This round's inner steps: H without DyLU, else :func:`local_steps` (H while our speed is unknown)."""
    if not dylu or own is None:
        return inner_steps
    return local_steps(own, live_speeds, inner_steps, min_steps)
