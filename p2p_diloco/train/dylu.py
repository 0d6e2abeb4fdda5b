"""PURE: Dynamic Local Updates (Asynchronous Local-SGD, arXiv 2401.09135, Eq. 6) and the lr schedule's clock.

Peers of different speeds run different numbers of inner steps so that their rounds end together: with v_i the
measured inner steps per second of peer i and H = ``diloco.inner_steps``, peer i runs
H_i = max(min_inner_steps, floor(v_i / max_j v_j · H)) steps, the maximum taken over the live roster (peers that
left or whose entry expired do not count) and this peer's own speed. A peer publishing a speed it does not have can
only make the others' rounds shorter, never longer than H, and never below ``min_inner_steps``; each speed is capped
at MAX_SPEED_RATIO × the median speed (:func:`credible_speeds`), so a lie shortens rounds by that factor at most; a
dead peer stops counting when its roster entry expires.

Speeds are steps per second, not tokens per second, because machines of one run may use different micro-batches
(the number of tokens per step is a machine setting); steps per second is what makes rounds end together.

H_i is what a peer expects to run. Speeds move from round to round (a shared machine, thermal limits, data loading),
so a plan made from past rounds alone lets the peers that happen to be faster this round wait for the others. A
round under DyLU therefore also has a time budget, the fastest peer's expected time for H steps, T = H / v_max,
counted from the start of the round: every peer keeps stepping while its next step ends within it (at least half its
H_i, so that a round that started late, after a slow state download or a stalled DHT request, still does useful
work; at most 2·H, a bound for clocks gone wrong), so that a peer slower than usual this round ends on time with
fewer steps and one faster than usual uses the time for more. The fastest peer runs about H.

For the budget to end together on every peer, the peers of a group use the same T and the same start: the speeds
all members announced in the group's all-reduce (identical on every member), and the moment that all-reduce ended
(within milliseconds on every member), so that committing, evaluating and checkpointing fall inside the budget.
A peer that did not average last round (a newcomer, a failed round) plans from the roster's speeds and its own
round start. No torch, no network.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Optional

PROBE_STEPS = 3  # a peer with no measurement yet times this many steps (training steps) before planning its round
MAX_SPEED_RATIO = 8.0  # a speed above this multiple of the median speed is taken as this multiple (a lie or a fluke)


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


def credible_speeds(speeds: Iterable[float]) -> list[float]:
    """The speeds DyLU may plan from: non-finite or non-positive ones (not measured yet, or garbage) dropped, and
    each capped at :data:`MAX_SPEED_RATIO` × the lower median of them. Speeds come from the roster, which anyone can
    write: one entry of 1e12 steps/s must not cut every peer's round to one step; liars (fewer than half of the
    speeds) make the others' rounds at most MAX_SPEED_RATIO times shorter. The same speeds give the same result on
    every peer (a group plans from the speeds its members announced: one time budget for all)."""
    ok = sorted(float(v) for v in speeds if isinstance(v, (int, float)) and math.isfinite(v) and v > 0)
    if not ok:
        return []
    cap = MAX_SPEED_RATIO * ok[(len(ok) - 1) // 2]
    return [min(v, cap) for v in ok]


def local_steps(own: float, others: Iterable[float], inner_steps: int, min_steps: int) -> int:
    """H_i of Eq. 6 for a peer of speed ``own`` (steps/s) next to the live peers' ``others``; ``inner_steps`` (H)
    when ``own`` is unknown (<= 0). Speeds, ours included, go through :func:`credible_speeds`."""
    if not own > 0 or not math.isfinite(own):
        return inner_steps
    speeds = credible_speeds(_with(own, others))
    own = min(own, max(speeds))  # ours capped like the others'
    return min(inner_steps, max(min_steps, math.floor(own / max(speeds) * inner_steps)))


def _with(own: float, speeds: Iterable[float]) -> list[float]:
    """``speeds`` and ours, counted once (a group's announced speeds already hold ours)."""
    speeds = list(speeds)
    return speeds if own in speeds else [*speeds, own]


def schedule_position(round_: int, step_in_round: int, steps_in_round: int, inner_steps: int) -> float:
    """The lr schedule's step for the ``lr_clock = "rounds"`` clock: the run's progress in units of H steps,
    round · H + the share of this round's steps done · H. Every peer is at the same point of the schedule in the same
    round, whatever its H_i; with H_i = H and no failed rounds it equals the peer's own step count."""
    return round_ * inner_steps + step_in_round * inner_steps / max(1, steps_in_round)


@dataclass(frozen=True)
class RoundPlan:
    """How many inner steps a round runs: ``steps`` (H_i, the expectation), and under DyLU a ``deadline`` (a
    ``time.perf_counter()`` value) with bounds: step while the next step ends within the deadline, at least
    ``least`` and at most ``most`` steps."""
    steps: int
    deadline: Optional[float] = None
    least: int = 0
    most: int = 0

    def postponed(self, seconds: float) -> RoundPlan:
        """The same plan with its deadline (if any) ``seconds`` later: time the round spent waiting, not stepping."""
        return replace(self, deadline=self.deadline + seconds) if self.deadline is not None and seconds else self

    def more(self, done: int, now: float, last_step_s: float) -> bool:
        """Whether to run another step, ``done`` steps in, at time ``now``, the last step having taken
        ``last_step_s`` seconds (the next one is expected to take as long). A step that would end past the deadline
        is not started: a peer rather ends early by part of a step than makes the others wait for one."""
        if self.deadline is None:
            return done < self.steps
        if done < self.least:
            return True
        return done < self.most and now + last_step_s <= self.deadline


def plan_round(own: Optional[float], live_speeds: Iterable[float], inner_steps: int, min_steps: int, dylu: bool,
               round_start: float) -> RoundPlan:
    """This round's plan: H steps without DyLU (or while our speed is unknown); with it, H_i of Eq. 6 and the time
    budget H / v_max from ``round_start`` (see the module's docstring)."""
    if not dylu or not own or not math.isfinite(own) or own <= 0:
        return RoundPlan(inner_steps)
    speeds = credible_speeds(_with(own, live_speeds))
    steps = local_steps(own, speeds, inner_steps, min_steps)
    return RoundPlan(steps, round_start + inner_steps / max(speeds), least=max(min_steps, steps // 2),
                     most=2 * inner_steps)
