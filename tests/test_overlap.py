"""The overlap bookkeeping (train/overlap.py) against references: the eager rule against the paper's algorithm run
literally, delayed overlap losing and double-counting no work through failed rounds, and the outer step's response."""

from __future__ import annotations

import copy

import pytest
import torch

from p2p_diloco.train.outer import OuterNesterov, OuterSGD
from p2p_diloco.train.overlap import Overlap

pytestmark = pytest.mark.timeout(30)
SHAPES = [torch.Size([5]), torch.Size([2, 3])]


def _inner(theta: list[torch.Tensor], worker: int, steps: int = 3) -> list[torch.Tensor]:
    """A worker's inner phase: gradient steps on its own quadratic, so the work depends on where it starts."""
    out = [t.clone() for t in theta]
    for _ in range(steps):
        for i, t in enumerate(out):
            target = torch.full_like(t, float(worker + i + 1))
            t.sub_(0.3 * (t - target))
    return out


@pytest.mark.parametrize("cls", [OuterSGD, OuterNesterov])
def test_step_response_is_the_difference_of_two_real_steps(cls):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    outer = cls(params, 0.7) if cls is OuterSGD else cls(params, 0.7, 0.9)
    outer.step(params, [torch.randn(s, generator=g) for s in SHAPES])  # some momentum first
    delta, extra = [torch.randn(s, generator=g) for s in SHAPES], [torch.randn(s, generator=g) for s in SHAPES]
    a, b = [p.clone() for p in params], [p.clone() for p in params]
    outer_a, outer_b = copy.deepcopy(outer), copy.deepcopy(outer)
    outer_a.step(a, delta)
    outer_b.step(b, [d + e for d, e in zip(delta, extra)])
    for r, x, y in zip(outer.step_response(extra), a, b):
        torch.testing.assert_close(r, y - x, rtol=1e-5, atol=1e-6)


def test_eager_with_an_sgd_outer_step_is_the_papers_algorithm():
    """Kale et al. (arXiv 2502.12996), literally: each worker keeps its own θ_i and applies Δ̃_i(t) = Δ(t−1) +
    (Δ_i(t) − Δ_i(t−1)) / M; ours keeps one canonical θ_global stepped with the delayed true averages, plus an
    offset per worker. Where each worker trains from must be the same."""
    M, rounds, lr = 3, 6, 0.7
    theta0 = [torch.zeros(s) for s in SHAPES]
    # the paper
    thetas = [[t.clone() for t in theta0] for _ in range(M)]
    prev_avg, prev_own = [torch.zeros(s) for s in SHAPES], [[torch.zeros(s) for s in SHAPES] for _ in range(M)]
    paper_starts = []
    for _ in range(rounds):
        own = [[a - b for a, b in zip(thetas[i], _inner(thetas[i], i))] for i in range(M)]
        for i in range(M):
            eager = [pa + (o - po) / M for pa, o, po in zip(prev_avg, own[i], prev_own[i])]
            thetas[i] = [t - lr * e for t, e in zip(thetas[i], eager)]
        prev_avg = [sum(o[j] for o in own) / M for j in range(len(SHAPES))]
        prev_own = own
        paper_starts.append([[t.clone() for t in th] for th in thetas])
    # ours
    glob = [t.clone() for t in theta0]
    outer = OuterSGD(glob, lr)
    locals_ = [[t.clone() for t in theta0] for _ in range(M)]
    overlaps = [Overlap("eager", SHAPES) for _ in range(M)]
    in_flight = None
    for r in range(rounds):
        works = []
        for i in range(M):
            locals_[i] = _inner(locals_[i], i)
            works.append([torch.empty(s) for s in SHAPES])
            overlaps[i].work(glob, locals_[i], works[-1])
        if in_flight is not None:
            outer.step(glob, in_flight)
        for i in range(M):
            overlaps[i].advance(works[i], in_flight is not None, 1 / M, outer.step_response)
            overlaps[i].restart(locals_[i], glob)
        in_flight = [sum(ov.sent[j] for ov in overlaps) / M for j in range(len(SHAPES))]
        for i in range(M):
            for ours, theirs in zip(locals_[i], paper_starts[r][i]):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_delayed_overlap_drops_no_work_and_counts_none_twice_through_failures():
    """One peer, an average equal to its own contribution and θ ← θ − Δ: whatever rounds fail, once the last
    contribution commits θ_global has moved by exactly all the work done, and θ_local never jumps."""
    glob = [torch.zeros(s) for s in SHAPES]
    outer = OuterSGD(glob, 1.0)
    local = [t.clone() for t in glob]
    ov = Overlap("delayed", SHAPES)
    total = [torch.zeros(s) for s in SHAPES]
    in_flight = None
    for ok in (True, False, True, True, False, False, True, True):
        before = [t.clone() for t in local]
        local = _inner(local, 0)
        for t, a, b in zip(total, before, local):
            t.add_(a - b)
        work = [torch.empty(s) for s in SHAPES]
        ov.work(glob, local, work)
        arrived = in_flight is not None and ok
        if arrived:
            outer.step(glob, in_flight)
        ov.advance(work, arrived, 1.0, outer.step_response)
        trained = [t.clone() for t in local]
        ov.restart(local, glob)
        for a, b in zip(local, trained):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # delayed: θ_local goes on where it was
        in_flight = [s.clone() for s in ov.sent]
    outer.step(glob, in_flight)  # the last one commits
    for g, t in zip(glob, total):
        torch.testing.assert_close(-g, t, rtol=1e-5, atol=1e-5)


def test_state_round_trips_and_a_restart_counts_the_round_in_flight_as_missed():
    ov = Overlap("delayed", SHAPES)
    ov.advance([torch.ones(s) for s in SHAPES], False, 0.5, None)
    ov.in_flight = True
    other = Overlap("delayed", SHAPES)
    other.load_state_dict(ov.state_dict())
    assert not other.in_flight
    assert all(torch.equal(a, b) for a, b in zip((*ov.offset, *ov.sent), (*other.offset, *other.sent)))


def test_delayed_overlap_settled_after_tau_steps_drops_no_work_and_counts_none_twice():
    """``diloco.overlap_steps``: the all-reduce in flight is settled after τ of the next round's inner steps
    (advance with the τ steps' work, restart), the rest of the round is added at its end with nothing in flight
    (advance with arrived=False). Two workers, a Nesterov outer step, failures anywhere: θ_local moves only by the
    change of θ_global in place of the contribution it committed, and once the last contribution commits each
    worker's committed contributions sum to exactly all the work it did."""
    glob = [torch.zeros(s) for s in SHAPES]
    outer = OuterNesterov(glob, 0.7, 0.5)
    locals_ = [[t.clone() for t in glob] for _ in range(2)]
    overlaps = [Overlap("delayed", SHAPES) for _ in range(2)]
    done = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]  # each worker's work: its inner phases' moves
    committed = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
    in_flight = None  # the two contributions of the all-reduce in flight

    def train(steps: int) -> list[list[torch.Tensor]]:
        works = []
        for w in range(2):
            before = locals_[w]
            locals_[w] = _inner(before, w, steps)
            for d, a, b in zip(done[w], before, locals_[w]):
                d.add_(a - b)
            works.append([torch.empty(s) for s in SHAPES])
            overlaps[w].work(glob, locals_[w], works[w])
        return works

    def settle(works, arrived: bool) -> None:
        old = [g.clone() for g in glob]
        if arrived:
            outer.step(glob, [(a + b) / 2 for a, b in zip(*in_flight)])
            for c, sent in zip(committed, in_flight):
                for t, s in zip(c, sent):
                    t.add_(s)
        for w in range(2):
            # θ_local follows θ_global's change in place of our stale contribution, else stays where it is
            stale = [s.clone() if arrived else torch.zeros(s.shape) for s in overlaps[w].sent]
            overlaps[w].advance(works[w], arrived, 0.5, outer.step_response)
            trained = [t.clone() for t in locals_[w]]
            overlaps[w].restart(locals_[w], glob)
            for l, t, g, o, s in zip(locals_[w], trained, glob, old, stale):
                torch.testing.assert_close(l, t + (g - o) + s, rtol=0, atol=1e-5)

    for ok in (True, True, False, True, False, False, True, True):
        if in_flight is not None:  # τ = 1 step, then the last round's all-reduce is settled
            settle(train(1), arrived=ok)
            in_flight = None
        settle(train(2), arrived=False)  # the rest of the round, with nothing in flight
        in_flight = [[s.clone() for s in ov.sent] for ov in overlaps]
    settle(train(0), arrived=True)  # the last one commits
    for w in range(2):
        assert all(float(s.abs().max()) < 1e-5 for s in overlaps[w].sent)  # nothing owed
        for c, d in zip(committed[w], done[w]):
            torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-5)
