"""A round's inner steps on θ_local, planned by DyLU (train/dylu.py): how many, until when, at which point of the lr
schedule, each stretched by ``fault.slowdown`` and with the inner-phase fault of tests.

:class:`InnerRounds` belongs to one :class:`~p2p_diloco.peer.Peer` and reaches the swarm only through it (the live
roster for the others' speeds, ``publish_pace`` for ours); it imports no hivemind.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from p2p_diloco.train.dylu import PROBE_STEPS, PaceMeter, RoundPlan, plan_round, schedule_position
from p2p_diloco.train.inner import RoundSteps, progress_bar


class InnerRounds:
    """The inner steps of each round of ``peer``; ``publish_pace`` announces a fresh speed measurement to the run."""

    def __init__(self, peer, publish_pace: Callable[[PaceMeter], None]):
        self.peer = peer
        self.publish_pace = publish_pace
        self.pace = PaceMeter()  # our inner-step speed (DyLU)
        self.group_clock = None  # (when our last committed all-reduce ended, its members' speeds): DyLU's next round
        self._struck = None  # the round an inner-phase fault struck in
        self.planned = 0  # H_i of the last round: the steps DyLU planned from the measured speeds (H without DyLU)
        self.background_split: dict = {}  # the last round's step times with and without a background all-reduce

    @property
    def dylu(self) -> bool:
        return self.peer.cfg.diloco.dylu and self.peer.membership is not None

    def run(self, live_roster, round_start: float) -> RoundSteps:
        """This round's inner steps on θ_local. DyLU: about as many as our measured speed allows next to the fastest
        live peer's, within the round's time budget (train/dylu.py); with no measurement yet, a few timed steps come
        first. Stops early, between steps, if asked to."""
        peer, H = self.peer, self.peer.cfg.diloco.inner_steps
        work = RoundSteps(progress_bar(H, f"{peer.name} r{peer.round + 1}", peer.cfg.run.progress))
        if self.dylu and not self.pace.measured:  # a new peer: its own short measurement, counted as training
            self._train(RoundPlan(min(PROBE_STEPS, H)), H, work)
            probe = work.probe_rate()
            if probe is not None:
                self.pace.add(*probe)
                self.publish_pace(self.pace)  # others plan with it from now on
            live_roster = peer._live_roster()  # the others' speeds, as of now
        own, others, round_start = self._pace_plan(live_roster, round_start)
        plan = plan_round(own, others, H, peer.cfg.diloco.min_inner_steps, self.dylu, round_start)
        work.plan(plan.steps)
        self.planned = plan.steps
        self._train(plan, plan.steps, work)
        self._inner_fault(work.steps, 0)  # a round that ended before its halfway step still gets its fault
        work.close()
        self.background_split = work.background_split()
        self.pace.add(work.steps, work.tokens, work.seconds)
        return work

    def _pace_plan(self, live_roster, round_start: float) -> tuple[float, list[float], float]:
        """(our speed, the others', the round's start) to plan from: after a committed round, what every member of
        its group knows alike (the speeds announced in it, the moment it ended), so all end the round together; else
        our measurement, the live roster's and our own round start."""
        if self.group_clock is not None:
            averaged_at, speeds = self.group_clock
            return self.peer.exchange.announced_speed or self.pace.steps_per_s, speeds, averaged_at
        others = [s.steps_per_s for s in live_roster if s.peer_id != self.peer.peer_id]
        return self.pace.steps_per_s, others, round_start

    def _train(self, plan: RoundPlan, planned: int, work: RoundSteps) -> None:
        """Inner steps while ``plan`` asks for more (a round of about ``planned``), each slowed down by
        ``fault.slowdown`` (sleeping after it)."""
        peer = self.peer
        slowdown = peer.cfg.fault.slowdown
        while not peer.stop_event.is_set() and plan.more(work.steps, time.perf_counter(), work.last_step_s):
            self._inner_fault(work.steps, planned // 2)
            # diloco.overlap_steps: the last round's all-reduce, settled after τ steps; under DyLU the pause for it
            # (the wait and the outer step) takes no steps from the round (at the round's end it does not either)
            plan = plan.postponed(peer.exchange.settle_due(work.steps))
            background = peer.exchange.averaging  # an all-reduce in the averager's process (overlap)
            t0 = time.perf_counter()
            out = peer.replica.step(peer.data.train.next_batch, self._schedule_step(work.steps, planned))
            if slowdown > 1:
                peer.stop_event.wait((slowdown - 1) * (time.perf_counter() - t0))
            work.add(out.loss, out.tokens, time.perf_counter() - t0, background)

    def _inner_fault(self, done: int, at: int) -> None:
        """Fault injection (tests): strike once per round, halfway through its planned inner steps."""
        fault, due = self.peer.fault, self.peer.round + 1
        if fault is None or done < at or self._struck == due:
            return
        if fault.due("inner", due):
            self._struck = due
            fault.strike()

    def _schedule_step(self, step_in_round: int, planned: int) -> Optional[float]:
        if self.peer.cfg.inner.lr_clock == "steps":
            return None  # InnerTrainer counts our own steps
        return schedule_position(self.peer.round, min(step_in_round, planned), planned,
                                 self.peer.cfg.diloco.inner_steps)
