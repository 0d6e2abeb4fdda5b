"""The round loop with a mocked averaging seam (no network): commit, roll back, reject, checkpoint and resume."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from p2p_diloco.net.averaging import AverageResult
from p2p_diloco.config import load_config
from p2p_diloco.train.outer import OuterNesterov, auto_outer, params_digest
from p2p_diloco.peer import Peer

pytestmark = pytest.mark.timeout(120)


class FakeAverager:
    """A group of one whose outcome per round is scripted: 'ok', 'fail', 'noquorum' or 'nan'. Records every call."""

    peer_id = "fake-peer-id"
    error_feedback = None  # or an ErrorFeedback whose pending residual each call sets to 0.001 x its number

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.buffers = None
        self.calls = []  # (contribution, weight, copy of the pseudo-gradient)

    def bind(self, peer: Peer) -> None:
        self.buffers = [torch.zeros_like(p) for p in peer.state.params]

    @contextlib.contextmanager
    def pseudo_grads(self):
        yield self.buffers

    def average(self, contribution, weight):
        self.calls.append((contribution, weight, [b.clone() for b in self.buffers]))
        if self.error_feedback is not None:
            for r in self.error_feedback.pending:
                r.fill_(0.001 * len(self.calls))
        outcome = self.outcomes.pop(0)
        if outcome == "fail":
            return AverageResult(ok=False, error="injected failure")
        if outcome == "noquorum":
            return AverageResult(ok=False, error="all-reduce failed: NoQuorum('no quorum: injected')")
        if outcome == "nan":
            self.buffers[0].view(-1)[0] = float("nan")
        return AverageResult(ok=True, group_size=1, peers=[contribution.name], tokens=contribution.tokens)

    def start_average(self, contribution, weight, lead=True, quorum=(), watch=None):
        return Ready(contribution, self.average(contribution, weight))

    def observe_round(self, seconds):
        pass

    def close(self, timeout=None):
        pass


class Ready:
    """An all-reduce whose outcome is known when it starts (the fake's); the peer takes it when it settles."""
    waited = 0.0

    def __init__(self, contribution, result):
        self.contribution, self._result = contribution, result

    def exchanging(self):
        return False

    def result(self):
        return self._result


def _peer(tmp_path, outcomes, rounds, error_feedback=False, **extra):
    overrides = {"model.seq_len": "32", "inner.batch_size": "2", "inner.warmup_steps": "2", "inner.lr": "1e-3",
                 "diloco.inner_steps": "3", "data.eval_batches": "1", "run.threads": "1", "run.progress": "false",
                 "run.run_dir": str(tmp_path / "run"), "run.name": "p0", "run.rounds": str(rounds), **extra}
    fake = FakeAverager(outcomes)
    cfg = load_config(overrides=overrides)
    if error_feedback:  # the averager exists before the peer starts (a resumed peer restores the residual into it)
        from p2p_diloco.net.averaging.codecs import ErrorFeedback
        from p2p_diloco.train.model import build_model

        fake.error_feedback = ErrorFeedback([p.shape for p in build_model(cfg.model, 256, cfg.run.seed).parameters()])
    peer = Peer(cfg, averager=fake).start()
    fake.bind(peer)  # the buffers take the model's shapes, known once the peer has started
    return peer, fake


def test_commit_applies_the_nesterov_step_to_the_averaged_pseudo_gradient(tmp_path):
    peer, fake = _peer(tmp_path, ["ok", "ok"], rounds=2)
    theta0 = [p.clone() for p in peer.state.params]
    peer.run()
    reference = [p.clone() for p in theta0]
    outer = OuterNesterov(reference, *auto_outer(1, 3))  # the defaults: 'auto' for 1 expected peer
    for _, _, delta in fake.calls:
        outer.step(reference, delta)
    assert peer.round == 2
    assert params_digest(peer.state.params) == params_digest(reference)
    assert params_digest(peer.model.parameters()) == params_digest(peer.state.params)  # θ_local ← θ_global
    # each round's contribution is relative to the θ_global of its round, weighted by the tokens behind it
    assert [c.round for c, _, _ in fake.calls] == [0, 1]
    assert all(w == c.tokens == 3 * 2 * 32 for c, w, _ in fake.calls)
    peer.close()


def test_auto_outer_step_is_resolved_at_start_and_logged(tmp_path, caplog):
    """'auto' becomes auto_outer's value for run.expected_peers before the run's settings are settled; a value
    given stays."""
    with caplog.at_level(logging.INFO, logger="p2p_diloco"):
        peer, _ = _peer(tmp_path, [], rounds=1, **{"run.expected_peers": "4", "diloco.outer_momentum": "0.8"})
    assert (peer.cfg.diloco.outer_lr, peer.cfg.diloco.outer_momentum) == (0.5, 0.8)
    assert (peer.state.outer.lr, peer.state.outer.momentum) == (0.5, 0.8)
    assert "auto outer step for 4 expected peers, H=3: diloco.outer_lr=0.5" in caplog.text
    peer.close()


def test_round_records_break_the_wall_time_down(tmp_path):
    """benchmarks/utilization.py reads these: sync and inner steps are parts of the round's wall time."""
    import json

    peer, _ = _peer(tmp_path, ["ok", "fail", "ok"], rounds=2)
    peer.run()
    peer.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rounds = [r for r in map(json.loads, lines) if r.get("event") == "round"]
    assert [r["committed"] for r in rounds] == [True, False, True]
    for r in rounds:
        assert r["time/sync_s"] >= 0 and r["time/inner_s"] > 0
        assert r["time/sync_s"] + r["time/inner_s"] <= r["time/round_s"]
        assert r["train/tokens"] == 3 * 2 * 32


def test_failed_round_keeps_theta_global_and_carries_the_work_forward(tmp_path):
    peer, fake = _peer(tmp_path, ["fail", "ok"], rounds=1)
    theta0 = peer.state.digest
    peer.run()
    (first, w1, delta1), (second, w2, delta2) = fake.calls
    assert first.round == second.round == 0, "a failed round must not advance θ_global's version"
    assert first.digest == second.digest == theta0
    assert second.tokens == 2 * first.tokens and w2 == 2 * w1   # the next contribution carries both rounds' work
    # θ_local was not reset after the failure: the second pseudo-gradient covers all six inner steps
    assert not torch.equal(delta2[0], delta1[0])
    assert peer.round == 1
    peer.close()


def test_non_finite_average_is_rejected(tmp_path):
    peer, fake = _peer(tmp_path, ["nan", "ok"], rounds=1)
    theta0 = peer.state.digest
    peer.run()
    assert fake.calls[1][0].digest == theta0, "a NaN average must not touch θ_global"
    assert all(torch.isfinite(p).all() for p in peer.state.params)
    peer.close()


def test_checkpoint_resume_continues_from_the_saved_round(tmp_path):
    peer, _ = _peer(tmp_path, ["ok", "ok"], rounds=2)
    peer.run()
    peer.close()  # saves
    saved = (params_digest(peer.state.params), params_digest(peer.state.outer.state_tensors()),
             peer.data.train.state_dict(), peer.inner.step_count)

    resumed, fake = _peer(tmp_path, ["ok"], rounds=3)
    assert resumed.round == 2
    assert params_digest(resumed.state.params) == saved[0]
    assert params_digest(resumed.state.outer.state_tensors()) == saved[1]
    assert resumed.inner.step_count == saved[3]
    assert str(resumed.data.train.state_dict()) == str(saved[2])
    resumed.run()
    assert resumed.round == 3 and fake.calls[0][0].round == 2
    resumed.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"event": "start"' in line for line in lines) == 1, "a resumed peer does not start over"


# ---------------------------------------------------------------------------------------------- rebasing late work

class FakeMembership:
    """Says we are behind the run at ``round_`` and 'downloads' the given state: θ_global, outer state, members."""

    def __init__(self, peer, round_, tensors, members=()):
        self.peer, self.round, self.tensors, self.members = peer, round_, tensors, members

    def behind(self, live_roster):
        from p2p_diloco.net.consensus import SyncTarget

        return SyncTarget(self.round, "run-digest", ["donor"])

    def fetch(self, target, fresh):
        self.peer.state.load(target.round, self.tensors, self.members)
        return True


def _behind_the_run(tmp_path, run_round, members=(), **extra):
    """A peer with one round of local work not yet committed, then told the run is at ``run_round``."""
    peer, _ = _peer(tmp_path, [], rounds=1, **extra)
    peer._inner_steps([], 0.0)  # H inner steps: local work on top of θ_global (round 0)
    old = [p.clone() for p in peer.state.params]
    local = [p.detach().clone() for p in peer.model.parameters()]
    new_state = [t + 0.01 * torch.randn_like(t) for t in peer.state.tensors()]  # the run's θ_global and momentum
    peer.membership = FakeMembership(peer, run_round, new_state, members)
    tokens = peer.tokens_since_commit
    peer._catch_up([])
    peer.membership = None
    events = [r for r in map(__import__("json").loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if r["event"] in ("rebase", "drop_work")]
    return peer, old, local, new_state, tokens, events


def test_a_late_peer_rebases_its_work_onto_the_runs_theta_global(tmp_path):
    peer, old, local, new_state, tokens, events = _behind_the_run(tmp_path, 3, **{"diloco.max_staleness": "3"})
    n = len(peer.state.params)
    assert peer.round == 3 and params_digest(peer.state.tensors()) == params_digest(new_state)  # the run's, exactly
    for l, o, g, l0 in zip(peer.model.parameters(), old, new_state[:n], local):
        torch.testing.assert_close(l.detach(), g + (l0 - o), rtol=0, atol=1e-6)  # θ_new + (θ_local − θ_old)
    assert peer.tokens_since_commit == tokens > 0 and peer.work_round == 0  # its weight and its age are kept
    assert [(e["event"], e["staleness"], e["tokens"]) for e in events] == [("rebase", 3, tokens)]
    peer.close()


def test_work_older_than_max_staleness_is_dropped(tmp_path):
    peer, _, _, new_state, tokens, events = _behind_the_run(tmp_path, 3, **{"diloco.max_staleness": "2"})
    assert params_digest(peer.model.parameters()) == params_digest(new_state[:len(peer.state.params)])
    assert peer.tokens_since_commit == 0 and peer.work_round == 3
    assert [(e["event"], e["reason"]) for e in events] == [("drop_work", "too old")]
    peer.close()


def test_work_already_in_the_runs_average_is_not_contributed_twice(tmp_path):
    # our contribution of round 1 reached the others' average although our own all-reduce failed
    peer, _, _, _, _, events = _behind_the_run(tmp_path, 2, members=[[1, ["p0", "p1"]], [2, ["p1"]]])
    assert peer.tokens_since_commit == 0
    assert [(e["event"], e["reason"]) for e in events] == [("drop_work", "already averaged")]
    peer.close()


def test_rebased_work_and_its_age_survive_a_checkpoint(tmp_path):
    peer, _, _, _, tokens, _ = _behind_the_run(tmp_path, 2)
    local = params_digest(peer.model.parameters())
    peer.close()  # saves θ_global (round 2), θ_local with the rebased work, its tokens and age
    resumed, _ = _peer(tmp_path, [], rounds=3)
    assert (resumed.round, resumed.tokens_since_commit, resumed.work_round) == (2, tokens, 0)
    assert params_digest(resumed.model.parameters()) == local
    resumed.close()


def test_lr_clock_rounds_follows_the_runs_progress_and_slowdown_stretches_steps(tmp_path):
    import time

    peer, _ = _peer(tmp_path, ["ok"], rounds=1, **{"inner.warmup_steps": "100", "fault.slowdown": "3",
                                                   "inner.lr_clock": "rounds"})
    computing, step = [], peer.inner.step

    def timed(*args):
        t0 = time.perf_counter()
        out = step(*args)
        computing.append(time.perf_counter() - t0)
        return out

    peer.inner.step = timed
    peer.state.round = 10  # as if the run were at round 10 (H = 3): schedule steps 30, 31, 32
    started = time.perf_counter()
    peer._inner_steps([], 0.0)
    wall = time.perf_counter() - started
    assert peer.inner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 33 / 100)  # the run's step 32
    assert peer.inner.step_count == 3  # while its own count says 3 steps
    assert wall >= 3 * sum(computing) * 0.99  # each step followed by a sleep of 2 x its compute time
    assert 3 / peer.pace.steps_per_s == pytest.approx(wall, rel=0.1)  # the speed it publishes includes the sleep
    peer.close()


def test_error_feedback_adds_the_last_committed_residual_and_is_checkpointed(tmp_path):
    """The same run with and without error feedback: each contribution differs by exactly the residual of the last
    committed round (a failed round's residual is never used), and a resumed peer gets its residual back."""
    runs = {}
    for ef in (False, True):
        peer, fake = _peer(tmp_path / str(ef), ["ok", "fail", "ok"], rounds=2, error_feedback=ef)
        peer.run()
        peer.close()  # saves a checkpoint
        runs[ef] = [delta for _, _, delta in fake.calls]
    for with_, without, want in zip(runs[True], runs[False], (0.0, 0.001, 0.001)):  # round 2's 0.002: not committed
        for w, wo in zip(with_, without):
            torch.testing.assert_close(w - wo, torch.full_like(w, want), atol=1e-6, rtol=0)
    resumed, fake = _peer(tmp_path / "True", ["ok"], rounds=3, error_feedback=True)
    assert resumed.round == 2
    assert all(torch.equal(r, torch.full_like(r, 0.003)) for r in resumed.error_feedback.residual)
    resumed.close()


# ---------------------------------------------------------------------------------------------- overlap
def _rounds(tmp_path) -> list[dict]:
    import json

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "round"]


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_overlap_commits_each_average_one_round_late(tmp_path, mode):
    """With overlap the all-reduce of round t is committed at the end of round t+1 (the last one after the last
    round); each contribution is one round's work, relative to the θ_global of its round; θ_global is the outer step
    applied to the averages, exactly as without overlap; at the end θ_local is θ_global."""
    peer, fake = _peer(tmp_path, ["ok"] * 3, rounds=3, **{"diloco.overlap": mode, "run.eval_every": "1"})
    theta0 = [p.clone() for p in peer.state.params]
    peer.run()
    assert peer.round == 3
    assert [c.round for c, _, _ in fake.calls] == [0, 1, 2]
    assert all(c.tokens == w == 3 * 2 * 32 for c, w, _ in fake.calls)  # one round's work each
    reference = [p.clone() for p in theta0]
    outer = OuterNesterov(reference, *auto_outer(1, 3))  # the defaults: 'auto' for 1 expected peer
    for _, _, delta in fake.calls:
        outer.step(reference, delta)
    assert params_digest(peer.state.params) == params_digest(reference)
    assert params_digest(peer.model.parameters()) == params_digest(peer.state.params)
    rounds = _rounds(tmp_path)
    assert [(r["round"], r["committed"]) for r in rounds] == [(1, True), (2, True), (3, True)]
    assert rounds[-1]["train/tokens"] == 0 and "eval/loss" in rounds[-1]  # the drained last all-reduce
    assert peer.tokens_since_commit == 0 and peer.tokens_trained == 3 * 3 * 2 * 32
    peer.close()


class TakenAt(FakeAverager):
    """Records how many inner steps the peer had run when it took each all-reduce's result."""

    def __init__(self, outcomes):
        super().__init__(outcomes)
        self.taken_at = []

    def start_average(self, contribution, weight, lead=True, quorum=(), watch=None):
        ready, taken = super().start_average(contribution, weight), self.taken_at
        ready.result = lambda: taken.append(self.peer.inner.step_count) or ready._result
        return ready


def test_overlap_steps_settle_each_average_after_tau_steps_of_the_next_round(tmp_path):
    """``diloco.overlap_steps`` = 1: round t's all-reduce is committed after the first inner step of round t+1 (the
    last one drained after the last round) and logged at that round's end; θ_global is the outer step (SGD, lr 1)
    applied to the contributions; θ_local never jumps (the contribution committed is exactly the one θ_global took)
    and at the end equals θ_global: no work was lost or counted twice, through a failed round too."""
    overrides = {"model.seq_len": "32", "inner.batch_size": "2", "diloco.inner_steps": "3", "data.eval_batches": "1",
                 "run.threads": "1", "run.progress": "false", "run.run_dir": str(tmp_path / "run"), "run.name": "p0",
                 "run.rounds": "3", "diloco.overlap": "delayed", "diloco.overlap_steps": "1",
                 "diloco.outer_optimizer": "sgd", "diloco.outer_lr": "1.0"}
    fake = TakenAt(["ok", "fail", "ok", "ok"])
    peer = Peer(load_config(overrides=overrides), averager=fake).start()
    fake.bind(peer)
    fake.peer = peer
    theta0 = [p.clone() for p in peer.state.params]
    moves = []  # each inner step's (θ_local before, after)
    step = peer.replica.step

    def recorded(*args):
        before = [p.detach().clone() for p in peer.model.parameters()]
        out = step(*args)
        moves.append((before, [p.detach().clone() for p in peer.model.parameters()]))
        return out

    peer.replica.step = recorded
    peer.run()
    peer.close()
    assert fake.taken_at == [4, 7, 10, 12]  # after step 1 of rounds 2, 3, 4; the last one drained
    assert [c.round for c, _, _ in fake.calls] == [0, 1, 1, 2]  # round 2's failed contribution went out again
    assert [c.tokens for c, _, _ in fake.calls] == [192, 192, 384, 192]
    reference = [p.clone() for p in theta0]
    for (_, _, delta), outcome in zip(fake.calls, ["ok", "fail", "ok", "ok"]):
        for r, d in zip(reference, delta if outcome == "ok" else []):
            r.sub_(d)  # SGD, lr 1
    assert params_digest(peer.state.params) == params_digest(reference)
    for (_, after), (before, _) in zip(moves, moves[1:]):  # a restart between two steps left θ_local in place
        for a, b in zip(after, before):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for l, g in zip(peer.model.parameters(), peer.state.params):
        torch.testing.assert_close(l.detach(), g, rtol=0, atol=1e-6)
    rounds = _rounds(tmp_path)
    assert [(r["round"], r["committed"]) for r in rounds] == [(1, True), (1, False), (2, True), (3, True)]
    assert [r["train/inner_steps"] for r in rounds] == [3, 3, 3, 0]  # logged at the end of the round they ended in
    assert [r["outer/settled_after_steps"] for r in rounds] == [1, 1, 1, 0]
    assert peer.tokens_since_commit == 0 and peer.tokens_trained == 4 * 3 * 2 * 32


class Running(Ready):
    """An all-reduce still running in the background while the peer asks the first ``checks`` times."""

    def __init__(self, contribution, result, checks):
        super().__init__(contribution, result)
        self.checks = checks

    def exchanging(self):
        self.checks -= 1
        return self.checks >= 0


class RunsTwoSteps(FakeAverager):
    def start_average(self, contribution, weight, lead=True, quorum=(), watch=None):
        return Running(contribution, self.average(contribution, weight), checks=2)


def test_overlap_times_the_inner_steps_with_and_without_a_background_allreduce(tmp_path):
    """Each round logs the median time of its steps that began while an all-reduce ran in the background and of the
    others (its first step counted in neither): what overlap costs the inner steps."""
    fake = RunsTwoSteps(["ok"] * 3)
    cfg = load_config(overrides={"model.seq_len": "32", "inner.batch_size": "2", "diloco.inner_steps": "3",
                                 "data.eval_batches": "1", "run.threads": "1", "run.progress": "false",
                                 "run.run_dir": str(tmp_path / "run"), "run.rounds": "3", "diloco.overlap": "delayed"})
    peer = Peer(cfg, averager=fake).start()
    fake.bind(peer)
    peer.run()
    peer.close()
    rounds = _rounds(tmp_path)
    # round 1's record: round 2's steps, of which the first two began with round 1's all-reduce running
    assert [r.get("train/steps_background") for r in rounds] == [1, 1, None]  # the drained last one: no steps
    assert all(r["train/step_s_background"] > 0 and r["train/step_s_alone"] > 0 for r in rounds[:2])


class StopAtSecond(FakeAverager):
    """Asks the peer to stop once its second all-reduce is under way (a SIGTERM arriving then)."""

    def start_average(self, contribution, weight, lead=True, quorum=(), watch=None):
        if len(self.calls) == 1:
            self.peer.stop_event.set()
        return super().start_average(contribution, weight)


def test_overlap_leave_waits_for_the_allreduce_in_flight_and_a_resume_carries_its_work(tmp_path):
    """Stopping with an all-reduce in flight: close() waits for it; it fails, so its work is still owed, saved in the
    checkpoint (θ_global of round 1: nothing half-applied), and goes out again with the resumed peer's next round."""
    cfg = load_config(overrides={"model.seq_len": "32", "inner.batch_size": "2", "inner.warmup_steps": "2",
                                 "diloco.inner_steps": "3", "data.eval_batches": "1", "run.threads": "1",
                                 "run.progress": "false", "run.name": "p0", "run.rounds": "3",
                                 "diloco.overlap": "delayed", "run.run_dir": str(tmp_path / "run")})
    fake = StopAtSecond(["ok", "fail"])
    peer = Peer(cfg, averager=fake).start()
    fake.bind(peer)
    fake.peer = peer
    theta0 = [p.clone() for p in peer.state.params]
    peer.run()
    assert peer.round == 1 and len(fake.calls) == 2  # round 1 committed, round 2's all-reduce in flight
    peer.close()  # waits for it (it fails) and saves
    reference = [p.clone() for p in theta0]
    OuterNesterov(reference, *auto_outer(1, 3)).step(reference, fake.calls[0][2])
    assert params_digest(peer.state.params) == params_digest(reference)
    sent = [s.clone() for s in peer.exchange.overlap.sent]
    assert (peer.round, peer.tokens_since_commit) == (1, 3 * 2 * 32)
    resumed, fake2 = _peer(tmp_path, ["ok", "ok"], rounds=2, **{"diloco.overlap": "delayed"})
    assert (resumed.round, resumed.tokens_since_commit) == (1, 3 * 2 * 32)
    assert params_digest(resumed.state.params) == params_digest(reference)
    assert params_digest(resumed.exchange.overlap.sent) == params_digest(sent)
    resumed.run()
    first = fake2.calls[0][0]
    assert first.round == 1 and first.tokens == 2 * 3 * 2 * 32  # the owed round's work and the new round's
    assert resumed.round == 2
    resumed.close()


def test_overlap_rebase_keeps_the_work_owed_and_sends_it_next(tmp_path):
    """Catching up with overlap (after the round's all-reduce was settled): our work not in θ_global, the failed
    contribution's and this round's, moves onto the run's θ_global and is the next contribution."""
    peer, _ = _peer(tmp_path, [], rounds=1, **{"diloco.overlap": "delayed"})
    peer._inner_steps([], 0.0)
    peer.exchange.settle()  # nothing in flight: this round's work is what goes out next
    old = [p.clone() for p in peer.state.params]
    local = [p.detach().clone() for p in peer.model.parameters()]
    new_state = [t + 0.01 * torch.randn_like(t) for t in peer.state.tensors()]
    peer.membership = FakeMembership(peer, 2, new_state)
    peer._catch_up([])
    peer.membership = None
    n = len(peer.state.params)
    for l, o, g, l0, s in zip(peer.model.parameters(), old, new_state[:n], local, peer.exchange.overlap.sent):
        torch.testing.assert_close(l.detach(), g + (l0 - o), rtol=0, atol=1e-6)
        torch.testing.assert_close(s, o - l0, rtol=0, atol=1e-6)  # the next contribution: all of it
    assert peer.round == 2 and peer.tokens_since_commit == 3 * 2 * 32
    peer.close()


def test_a_peer_that_catches_up_to_the_last_round_contributes_no_round_after_it(tmp_path):
    """A straggler that downloads the run's last θ_global after its inner steps stops there: a contribution to a
    round past ``run.rounds`` finds no group (every other peer has finished) and only fails."""
    peer, fake = _peer(tmp_path, ["ok"], rounds=2)
    catch_ups = []

    def catch_up(live):  # the second catch-up of round 2 finds the run at its last round (a state download)
        catch_ups.append(peer.round)
        if len(catch_ups) == 4:
            peer.state.round = 2

    peer._catch_up = catch_up
    peer.run()
    assert peer.round == 2 and len(catch_ups) == 4
    assert [c.round for c, _, _ in fake.calls] == [0], "no contribution after catching up to the last round"
    peer.close()


def test_a_peer_whose_last_round_finds_no_quorum_stops_one_round_short_instead_of_forgetting_the_runs_size(
        tmp_path, caplog):
    """Before the last round, FORGET_AFTER attempts without quorum make a peer forget the run's size and go on
    with whom it sees; at the last round it stops instead (net/consensus.py RunSize): its group could otherwise
    commit a second final θ_global beside the one the finishers committed."""
    from p2p_diloco.net.consensus import FORGET_AFTER

    peer, fake = _peer(tmp_path, ["ok", *["noquorum"] * FORGET_AFTER, "ok"], rounds=2)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        peer.run()
    assert peer.round == 1 and len(fake.calls) == 1 + FORGET_AFTER
    assert [c.round for c, _, _ in fake.calls] == [0, 1, 1, 1]
    assert "the run's last round found no quorum" in caplog.text and "stopping at round 1" in caplog.text
    peer.close()
