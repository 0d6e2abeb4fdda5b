"""Reducer checks (averaging.verify_parts) and the capped share (averaging.max_share): the pure comparison and
capping, then real processes on loopback where one member's reducer equivocates (fault.attack=equivocate)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest
import torch

from p2p_diloco.config import AveragingConfig, NetworkConfig
from p2p_diloco.net.averaging.reducer_checks import (capped_fractions, describe_equivocations, equivocations,
                                                     sane_bandwidths)
from p2p_diloco.ops.procs import join_or_kill

SHAPES = [torch.Size([300, 500]), torch.Size([37])]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NAMES = ["p0", "p1", "p2"]


# ---------------------------------------------------------------------------------------------------- pure checks
def test_agreeing_views_show_no_equivocation():
    views = {m: ["a", "b", "c"] for m in NAMES}
    assert equivocations(views, NAMES) == {}


def test_a_reducer_with_two_digests_is_named_with_who_got_what():
    views = {"p0": ["a", "b", "c"], "p1": ["a", "b", "X"], "p2": ["a", "b", "c"]}
    found = equivocations(views, NAMES)
    assert found == {"p2": {"X": ["p1"], "c": ["p0", "p2"]}}
    # the same verdict whatever the order in which the views arrived
    assert equivocations(dict(reversed(list(views.items()))), NAMES) == found
    line = describe_equivocations(found)
    assert "reducer p2 sent different averaged bytes" in line and "p1 got X" in line and "\n" not in line


def test_two_equivocating_reducers_are_both_named():
    views = {"p0": ["a", "b", "c"], "p1": ["A", "b", "C"], "p2": ["a", "b", "c"]}
    assert set(equivocations(views, NAMES)) == {"p0", "p2"}


def test_a_group_of_one_and_a_group_that_all_called_first_are_verified_at_once():
    """Nothing left to hear: the check ends as soon as our own digests are known, not at the all-reduce's deadline
    (a peer averaging alone used to wait out the whole deadline, 119 s by default, every round)."""
    import asyncio
    import time

    from p2p_diloco.net.averaging.verify import PartVerifier, Verification

    class Member(PartVerifier):
        _verify_until = time.monotonic() + 60  # the all-reduce's deadline

        async def _call_verify(self, group_id, v, j):  # a call to a member that has answered: the same digests
            v.record(j, v.own.result())

    class GroupInfo:
        group_id = b"g"

    async def verify(size: int, heard_first: list[int]):
        v = Verification(NAMES[:size], NAMES[:size], 0)
        own = [bytes([i]) * 32 for i in range(size)]
        for j in heard_first:
            v.record(j, own)  # their calls reached us before our all-reduce ended
        await asyncio.wait_for(Member()._verify_parts(GroupInfo(), v, own), timeout=5)
        return v.verdict()

    assert asyncio.run(verify(1, [])) is None
    assert asyncio.run(verify(3, [1, 2])) is None


def test_capped_share_takes_the_excess_of_a_greedy_member_to_the_others():
    # hivemind's load balancing gave member 0 (huge declared bandwidth) nearly everything
    fractions = capped_fractions([998, 1, 1, 0], [True, True, True, False], max_share=2.0)
    assert fractions[0] == pytest.approx(2 / 3) and fractions[3] == 0.0
    assert fractions[1] == pytest.approx(1 / 6) and fractions[2] == pytest.approx(1 / 6)
    assert sum(fractions) == pytest.approx(1.0)
    # equal shares stay equal; max_share=1 forces them
    assert capped_fractions([5, 5, 5], [True] * 3, 2.0) == pytest.approx([1 / 3] * 3)
    assert capped_fractions([90, 5, 5], [True] * 3, 1.0) == pytest.approx([1 / 3] * 3)


def test_capped_share_never_starves_the_only_reducer_and_is_deterministic():
    assert capped_fractions([10, 0, 0], [True, False, False], 2.0) == pytest.approx([1.0, 0.0, 0.0])
    # a member the load balancing gave nothing (below min size) may take what the cap frees
    assert capped_fractions([100, 0], [True, True], 1.5) == pytest.approx([0.75, 0.25])
    args = ([700, 200, 100], [True, True, True], 1.2)
    assert capped_fractions(*args) == capped_fractions(*args)
    assert max(capped_fractions(*args)) <= 1.2 / 3 + 1e-12


def test_declared_bandwidths_that_are_not_numbers_count_as_undeclared():
    assert sane_bandwidths([1.0, float("nan"), -3.0, float("inf"), None, 0.0, "x", True]) == \
        [1.0, None, None, None, None, 0.0, None, None]


def test_a_verification_commits_only_when_every_member_reached_agrees():
    import asyncio

    from p2p_diloco.net.averaging.verify import Verification

    own, other = [bytes([i]) * 32 for i in range(3)], [bytes([i]) * 32 for i in (0, 1, 9)]
    cases = {  # member index -> what we heard from it: digests, "dead" (unreachable) or "failed" (its all-reduce)
        "agreed": {1: own, 2: own}, "equivocated": {1: own, 2: other}, "missing": {1: own},
        "malformed": {1: own, 2: own[:2]}, "dead": {1: own, 2: "dead"}, "failed": {1: own, 2: "failed"},
        "two stories": {1: own, 2: [own, other]}}

    async def verdicts():
        out = {}
        for case, answers in cases.items():
            v = Verification(["a", "b", "c"], NAMES, 0)
            v.own.set_result(own)
            for j, heard in answers.items():
                if heard == "dead":
                    v.unreachable(j, "P2PDaemonError('stream reset')")
                elif heard == "failed":
                    v.fail(j, "its all-reduce failed")
                else:
                    for digests in (heard if isinstance(heard[0], list) else [heard]):
                        v.record(j, digests)
            out[case] = (v.settled.is_set(), v.verdict())
        return out

    out = asyncio.run(verdicts())
    assert out["agreed"] == (True, None)
    assert out["equivocated"][0] and "reducer p2 sent different averaged bytes" in out["equivocated"][1]
    assert out["missing"] == (False, "no part digests from member(s) ['p2'] in time")
    assert "member p2 could not verify: sent 2 malformed digests" in out["malformed"][1]
    assert out["dead"] == (True, None), "a member that cannot be reached at all is left out (it cannot commit)"
    assert out["failed"][0] and "member p2 could not verify: its all-reduce failed" in out["failed"][1]
    assert "member p2 could not verify: sent two different sets of digests" in out["two stories"][1]


def test_a_verification_commits_only_with_a_majority_of_the_group():
    """CI's NAT test: home2's router went down right after its all-reduce; it reached nobody, left everyone out and
    committed round 4 alone, while the others failed it and later committed a round 4 of their own. A member now
    commits only when the members that confirmed its digests, itself included, are more than half of the group;
    client-mode members, which can never dial each other, do not count each other."""
    import asyncio

    from p2p_diloco.net.averaging.verify import Verification

    def verdict(size: int, agreed: list[int], dead: list[int], apart=()):
        async def run():
            names = [f"p{i}" for i in range(size)]
            v = Verification(names, names, 0, apart)
            own = [bytes([i]) * 32 for i in range(size)]
            v.own.set_result(own)
            v.check_settled()  # as _verify_parts does
            for j in agreed:
                v.record(j, own)
            for j in dead:
                v.unreachable(j, "StopAsyncIteration()")
            assert v.settled.is_set()
            return v.verdict()
        return asyncio.run(run())

    isolated = verdict(4, [], [1, 2, 3])
    assert isolated is not None and "only 1 of the group's 4 members" in isolated and "not a majority" in isolated
    assert "'p1', 'p2', 'p3'" in isolated
    assert verdict(4, [1], [2, 3]) is not None  # 2 of 4: half is not a majority
    assert verdict(4, [1, 2], [3]) is None  # one death before the checks: the other three commit
    assert verdict(3, [1], [2]) is None
    assert verdict(2, [], [1]) is not None  # a pair cannot tell a dead partner from a cut link
    assert verdict(1, [], []) is None  # averaging alone
    # we are a client-mode member, 2 and 3 are too: only 0 and 1 count, and 1 agreed
    assert verdict(4, [1], [2, 3], apart={2, 3}) is None
    assert verdict(4, [], [1, 2, 3], apart={2, 3}) is not None


@pytest.mark.parametrize("key,value", [("averaging.max_share", "0.5"), ("averaging.verify_parts", "maybe")])
def test_bad_values_of_the_new_keys_are_one_line_and_exit_2(key, value):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "p2p_diloco", "peer", f"--{key}={value}"], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and key in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


# ---------------------------------------------------------------------------------------------------- processes
def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 1e-3 for s in SHAPES]


def _worker(index, initial_peers, setups, results, barrier):
    """One member: for each setup (verify_parts, attacker index or None) average once; report (setup, index, ok,
    error, sha256 of the buffers after the all-reduce). The members start each setup together (``barrier``): the
    equivocator's own checks can wait out the all-reduce's deadline (30 s) for the digests of a member that already
    closed its averager, and the others, 4 s into the next setup's matchmaking by then, found no group (CI, once).
    Nobody closes its averager before every member is done with the setup (a peer's averager lives on after a
    round): a member that named the equivocator from a faster member's answer and closed at once left the other's
    call to it unanswered, and the other then waited out the deadline for its digests per reducer (stop 40, once)."""
    torch.set_num_threads(1)
    from p2p_diloco.net.averaging import Averager, Contribution
    from p2p_diloco.net.dht import start_dht

    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    try:
        for i, (verify, attacker) in enumerate(setups):
            barrier.wait(timeout=90)
            cfg = AveragingConfig(matchmaking_time=4, request_timeout=2, allreduce_timeout=30, next_chunk_timeout=5,
                                  part_size_bytes=2 ** 14, verify_parts=verify)  # ~6 parts per reducer
            averager = Averager(dht, cfg, f"rc{i}", SHAPES, expected_group_size=3,
                                equivocate_from=1 if attacker == index else None)
            try:
                with averager.pseudo_grads() as buffers:
                    for b, t in zip(buffers, _tensors(index)):
                        b.copy_(t)
                result = averager.average(Contribution(NAMES[index], round=0, digest="d", tokens=100), 100)
                with averager.pseudo_grads() as buffers:
                    digest = hashlib.sha256(b"".join(b.numpy().tobytes() for b in buffers)).hexdigest()
                results.put((i, index, result.ok, result.error, digest))
                barrier.wait(timeout=90)  # a peer's averager outlives its round: late digest calls get answers
            finally:
                averager.close()
    finally:
        dht.shutdown()


# each: (averaging.verify_parts, the member whose reducer equivocates or None)
SETUPS = {"verified": (True, None), "equivocating": (True, 2), "unchecked": (False, 2), "stopped": (True, None)}


@pytest.fixture(scope="module")
def rounds(module_process_tag):
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    ctx = mp.get_context("fork")
    results, barrier = ctx.Queue(), ctx.Barrier(3)
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    workers = []
    try:
        for i in range(3):
            workers.append(ctx.Process(target=_worker, args=(i, visible_maddrs(boot), list(SETUPS.values()),
                                                              results, barrier)))
            workers[-1].start()
        out = {}
        for _ in range(3 * len(SETUPS)):
            setup, index, ok, error, digest = results.get(timeout=100)
            out.setdefault(list(SETUPS)[setup], {})[index] = (ok, error, digest)
        return out
    finally:
        join_or_kill(workers, timeout=15)
        boot.shutdown()


@pytest.mark.timeout(150)
def test_verified_rounds_commit_with_identical_bytes(rounds):
    for name in ("verified", "stopped"):  # "stopped": the attacker's next round, honest again
        assert all(ok for ok, _, _ in rounds[name].values()), rounds[name]
        assert len({digest for *_, digest in rounds[name].values()}) == 1, "members hold different bytes"


@pytest.mark.timeout(150)
def test_an_equivocating_reducer_fails_the_round_on_every_honest_member_and_is_named(rounds):
    # without the check the attack is real: the honest members end with different bytes, all reported as good
    unchecked = rounds["unchecked"]
    assert all(ok for ok, _, _ in unchecked.values()) and unchecked[0][2] != unchecked[1][2]
    for index in (0, 1):
        ok, error, _ = rounds["equivocating"][index]
        assert not ok and "reducer p2 (…" in error and "sent different averaged bytes" in error, error


# ---------------------------------------------------------------------------------------------------- whole peers
def _rounds(run_dir, name) -> list[dict]:
    from p2p_diloco.ops.metrics import read_jsonl

    return [r for r in read_jsonl(run_dir / name / "metrics.jsonl") if r.get("event") == "round"]


def _named(run_dir, name, reducer) -> bool:
    return any(not r["committed"] and f"reducer {reducer} (…" in (r["error"] or "")
               and "sent different averaged bytes" in r["error"]
               for r in _rounds(run_dir, name))


@pytest.mark.timeout(240)
def test_peers_never_commit_an_equivocating_reducers_round_and_agree_once_it_is_gone(tmp_path, process_tag):
    """peer2 equivocates as a reducer from round 2 on (fault.attack=equivocate): both honest peers fail round 2 and
    name it, every time; once it is gone (SIGTERM) they commit rounds 2 and 3 without it, with one θ_global."""
    import signal
    import time

    from p2p_diloco.config import load_config
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, LocalSwarm, write_peer_config

    cfg = load_config(defaults={**DEMO_DEFAULTS, "inner.batch_size": 4, "model.seq_len": 32, "data.eval_batches": 1,
                                "averaging.matchmaking_time": 4.0, "run.checkpoint_every": 0})
    swarm = LocalSwarm(tmp_path, peer_args=["--run.rounds=3", "--diloco.inner_steps=6", "--run.expected_peers=3",
                                            *write_peer_config(tmp_path, cfg)])
    try:
        swarm.start_bootstrap()
        for i in range(3):
            swarm.start_peer(f"peer{i}", ["--fault.attack=equivocate", "--fault.attack_from=2"] if i == 2 else [])
        deadline = time.monotonic() + 150
        while not all(_named(tmp_path, n, "peer2") for n in ("peer0", "peer1")):
            assert time.monotonic() < deadline, "the honest peers did not name the equivocating reducer"
            assert all(c.proc.poll() is None for c in swarm.peers.values()), "a peer exited early"
            time.sleep(0.5)  # the peers are other processes: their metrics files are what there is to watch
        swarm.peers["peer2"].proc.send_signal(signal.SIGTERM)
        for name in ("peer0", "peer1"):
            assert swarm.peers[name].proc.wait(timeout=120) == 0
    finally:
        swarm.close()
    honest = {n: {r["round"]: r for r in _rounds(tmp_path, n) if r["committed"]} for n in ("peer0", "peer1")}
    # rounds 2 and 3 (the attack's) on both; round 1 on at least one of them: a peer that a loaded machine makes late
    # for round 1's group repairs from it (seen in CI: peer1 committed rounds 2 and 3 only), which is not this test's
    assert {2, 3} <= set(honest["peer0"]) & set(honest["peer1"]), {n: sorted(r) for n, r in honest.items()}
    assert 1 in set(honest["peer0"]) | set(honest["peer1"]), {n: sorted(r) for n, r in honest.items()}
    for round_ in sorted(set(honest["peer0"]) & set(honest["peer1"])):
        r0, r1 = honest["peer0"][round_], honest["peer1"][round_]
        assert r0["global_params_sha256"] == r1["global_params_sha256"], f"round {round_}: θ_global differs"
        if round_ >= 2:
            assert sorted(r0["outer/peers"]) == ["peer0", "peer1"], "a round with the attacker was committed"
    assert not any(r["committed"] and r["round"] >= 2 for r in _rounds(tmp_path, "peer2"))


def test_checks_that_fail_only_on_members_that_lost_parts_say_so_and_nothing_else_does():
    """A 12-peer swarm: a reducer killed mid-serving had sent its averages to some members and not to others. Those
    with every average failed the checks (the others answered that their all-reduce failed) and, before, sat out the
    survivors' retry, which then failed for lack of their parts: the round was lost on all 11 survivors. Such checks
    now raise MembersLostParts (averager.py joins the retry then); an equivocation, a malformed answer, a timeout or
    a refusal are not that, and a failure of a member's own all-reduce is heard only as an INTERNAL_ERROR answer."""
    import asyncio
    import time

    from hivemind.averaging.partition import AllreduceException
    from hivemind.proto import averaging_pb2

    from p2p_diloco.net.averaging.verify import MembersLostParts, PartVerifier, Verification, hear_answer

    own, other = [bytes([i]) * 32 for i in range(4)], [bytes([i]) * 32 for i in (0, 1, 2, 9)]
    lost = averaging_pb2.MessageFromLeader(
        code=averaging_pb2.INTERNAL_ERROR,
        suggested_leader=repr(AllreduceException("its all-reduce failed: lost parts of reducer(s) ['x']")).encode())
    digests = averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, gathered=own)
    answers = {  # member index -> its answer to our call
        "lost": {1: digests, 2: lost, 3: lost},
        "lost and equivocated": {1: averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, gathered=other),
                                 2: lost, 3: digests},
        "lost and refused": {1: averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID), 2: lost, 3: lost},
        "timed out": {1: digests, 2: digests, 3: averaging_pb2.MessageFromLeader(
            code=averaging_pb2.INTERNAL_ERROR, suggested_leader=b"TimeoutError()")},
        "agreed": {1: digests, 2: digests, 3: digests}}

    class Member(PartVerifier):
        _verify_until = time.monotonic() + 60

        def __init__(self, heard):
            self.heard = heard

        async def _call_verify(self, group_id, v, j):
            hear_answer(v, j, self.heard[j])

    class GroupInfo:
        group_id = b"g"

    async def check(heard):
        names = [f"p{i}" for i in range(4)]
        v = Verification(names, names, 0)
        try:
            await asyncio.wait_for(Member(heard)._verify_parts(GroupInfo(), v, own), timeout=5)
        except AllreduceException as e:
            return type(e).__name__, str(e)
        return None

    out = {case: asyncio.run(check(heard)) for case, heard in answers.items()}
    assert out["lost"][0] == MembersLostParts.__name__ and "member p2 could not verify: AllreduceException(" \
        "\"its all-reduce failed" in out["lost"][1]
    for case in ("lost and equivocated", "lost and refused", "timed out"):
        assert out[case][0] == "AllreduceException", (case, out[case])
    assert out["agreed"] is None


def test_calls_carry_one_hash_and_answers_carry_the_digests_only_where_averages_differ():
    """The checks cost O(N) bytes per member: a call carries the hash of the caller's digests (32 bytes, whatever N),
    the callee answers with the same hash when its own is equal, and with its digests per reducer only when they
    differ, which still names the reducer that equivocated. A member whose hash differs and whose digests never
    come fails the round; so does one whose call and answer disagree."""
    import asyncio
    import time
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2

    from p2p_diloco.net.averaging.verify import PartVerifier, Verification, combine

    names = ["p0", "p1", "p2", "p3"]
    own = [bytes([i]) * 32 for i in range(4)]
    skewed = [bytes([i]) * 32 for i in (0, 1, 9, 3)]  # reducer p2 sent p3 other bytes

    async def run():
        out = {}
        v = Verification(names, names, 0)
        v.own.set_result(own)
        v.record(1, [combine(own)])  # p1's call: the hash alone, equal to ours
        v.record(2, own)  # p2 answered with its digests (an older peer, or a mismatch it saw): the same averages
        assert not v.settled.is_set()  # p3 not heard yet
        v.record(3, [combine(skewed)])  # p3's call: another hash; its digests per reducer are still to come
        out["hash only"] = (v.settled.is_set(), v.verdict())
        v.record(3, skewed)  # our call's answer: its digests, which name the reducer
        out["named"] = (v.settled.is_set(), v.verdict())
        liar = Verification(names, names, 0)
        liar.own.set_result(own)
        liar.record(1, [combine(own)])
        liar.record(1, skewed)  # its answer does not match its call
        out["two stories"] = liar.verdict()
        malformed = Verification(names, names, 0)
        malformed.own.set_result(own)
        malformed.record(1, own[:2])
        out["malformed"] = malformed.verdict()

        class Member(PartVerifier):  # the callee's side: what it answers to a call
            _verify_until = time.monotonic() + 60
            _running_groups: dict = {}
            peer_id = "p0"

            def __init__(self, v):
                self._verifications = {b"g": v}

        callee = Verification(names, names, 0)
        callee.own.set_result(own)
        member = Member(callee)
        for case, sent in (("equal", [combine(own)]), ("differs", [combine(skewed)])):
            request = averaging_pb2.MessageFromLeader(group_id=b"g", gathered=sent)
            index = 1 if case == "equal" else 3
            answer = await member._answer_verify(request, SimpleNamespace(remote_id=names[index]))
            out[case] = list(answer.gathered)
        return out

    out = asyncio.run(run())
    assert out["hash only"][0] is False and out["hash only"][1].startswith("member(s) ['p3'] hold other averages")
    assert out["named"][0] and "reducer p2 sent different averaged bytes" in out["named"][1]
    assert "p3 got 0909" in out["named"][1] and "p0, p1, p2 got 0202" in out["named"][1]
    assert "member p1 could not verify: sent two different sets of digests" in out["two stories"]
    assert "member p1 could not verify: sent 2 malformed digests" in out["malformed"]
    assert out["equal"] == [combine(own)] and out["differs"] == own  # 32 bytes, or the digests to compare
