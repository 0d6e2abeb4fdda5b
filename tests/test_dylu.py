"""DyLU (pure): each peer's inner steps from the measured speeds of the live peers; the lr schedule's clock."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.train.dylu import (MAX_SPEED_RATIO, PaceMeter, RoundPlan, credible_speeds, local_steps, plan_round,
                                  schedule_position)

pytestmark = pytest.mark.timeout(30)


def test_eq6_the_fastest_runs_h_the_others_their_share_rounded_down():
    speeds = {"a100": 10.0, "4090": 5.0, "3060": 2.5, "laptop": 0.9}
    steps = {name: local_steps(v, speeds.values(), 500, 1) for name, v in speeds.items()}
    assert steps == {"a100": 500, "4090": 250, "3060": 125, "laptop": 45}
    # rounds end together: steps / speed is the same for every peer, up to one step
    assert max(s / speeds[n] for n, s in steps.items()) - min(s / speeds[n] for n, s in steps.items()) < 1.2


def test_equal_peers_run_h_and_a_peer_never_runs_more_than_h():
    assert local_steps(3.0, [3.0, 3.0], 50, 1) == 50
    assert local_steps(9.0, [3.0], 50, 1) == 50  # we are the fastest: others' speeds never raise our H_i


def test_an_absurd_speed_is_capped_by_the_median_so_a_liar_cannot_cut_rounds_to_one_step():
    # one liar among 3 honest peers of 2 steps/s: taken as MAX_SPEED_RATIO x 2, never 1e12
    assert local_steps(2.0, [2.0, 2.0, 1e12], 500, 1) == math.floor(500 / MAX_SPEED_RATIO)
    assert local_steps(2.0, [1e12], 500, 1) == math.floor(500 / MAX_SPEED_RATIO)  # alone with the liar: the same
    assert local_steps(2.0, [1e12], 500, 100) == 100  # min_inner_steps still bounds it from below
    plan = plan_round(2.0, [2.0, 1e12, math.inf, math.nan], 40, 1, dylu=True, round_start=0.0)
    assert plan.steps == 5 and plan.deadline == 40 / 16.0, "the time budget is bounded by the cap too"
    assert credible_speeds([1.0, 2.0, 3.0, 1e12, -5.0, math.nan]) == [1.0, 2.0, 3.0, 16.0]


def test_every_member_of_a_group_plans_the_same_budget_from_the_same_speeds():
    speeds = [1.0, 1.2, 30.0]  # announced in the group's all-reduce, our own among them
    plans = [plan_round(v, speeds, 100, 1, dylu=True, round_start=0.0) for v in speeds]
    assert len({p.deadline for p in plans}) == 1 and plans[2].steps == 100


def test_unmeasured_or_broken_speeds_are_ignored():
    assert local_steps(2.0, [0.0, -1.0, math.nan, math.inf], 40, 1) == 40  # nobody else measured yet
    assert local_steps(0.0, [5.0], 40, 1) == 40  # our own speed unknown: plain H (the probe comes first)
    assert plan_round(None, [5.0], 40, 1, dylu=True, round_start=0.0) == RoundPlan(40)
    assert plan_round(1.0, [5.0], 40, 1, dylu=False, round_start=0.0) == RoundPlan(40)


def test_a_round_has_the_fastest_peers_time_budget_so_this_rounds_speed_changes_steps_not_the_end():
    fast = plan_round(5.0, [1.0], 40, 2, dylu=True, round_start=100.0)
    slow = plan_round(1.0, [5.0], 40, 2, dylu=True, round_start=100.0)
    assert (fast.steps, slow.steps) == (40, 8) and fast.deadline == slow.deadline == 108.0  # H / v_max = 8 s
    # the slow peer at its usual 1 s per step: its 8th step ends at the deadline, no 9th
    assert slow.more(7, 107.0, 1.0) and not slow.more(8, 108.0, 1.0)
    # slower than usual this round (2 s per step): it stops after 4 steps instead of making the others wait, and
    # never starts a step that would end past the deadline
    assert slow.more(3, 106.0, 2.0) and not slow.more(4, 106.5, 2.0)
    # faster than usual: it uses the time (bounded by 2 H whatever the clock says)
    assert slow.more(12, 106.0, 0.5) and not slow.more(80, 100.5, 0.01)
    assert slow.more(3, 500.0, 1.0) and not slow.more(4, 500.0, 1.0)  # at least half its plan, even late
    # a plain round (no DyLU): exactly its steps, whatever the clock
    assert RoundPlan(3).more(2, 1e9, 1.0) and not RoundPlan(3).more(3, 0.0, 0.0)
    # a round that waited 5 s for an average after τ steps (diloco.overlap_steps): its deadline moves by the wait
    assert slow.postponed(5.0).deadline == 113.0
    assert slow.postponed(5.0).more(8, 107.5, 2.0) and not slow.more(8, 107.5, 2.0)
    assert RoundPlan(3).postponed(5.0) == RoundPlan(3)


def test_pace_is_the_median_of_recent_rounds_so_one_frozen_round_does_not_dictate():
    pace = PaceMeter(window=3)
    assert not pace.measured and pace.steps_per_s == 0.0
    pace.add(10, 1000, 1.0)
    pace.add(10, 1000, 60.0)  # a round with a long freeze inside
    pace.add(10, 1000, 1.1)
    assert pace.steps_per_s == pytest.approx(10 / 1.1)
    assert pace.tokens_per_s == pytest.approx(1000 / 1.1)
    pace.add(0, 0, 0.0)  # an interrupted round with no step: ignored
    for _ in range(3):
        pace.add(5, 500, 1.0)  # the machine got slower: the window follows within its length
    assert pace.steps_per_s == 5.0


def test_the_rounds_clock_puts_every_peer_at_the_same_point_of_the_schedule():
    h = 50
    assert schedule_position(3, 0, 50, h) == 150
    assert schedule_position(3, 25, 50, h) == schedule_position(3, 5, 10, h) == 175  # half of its round, any H_i
    assert [schedule_position(0, k, h, h) for k in range(3)] == [0, 1, 2]  # H_i = H: the peer's own step count
