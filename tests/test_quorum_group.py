"""The quorum is counted over the group that committed the round before (issue 24: one DHT node with a few generated
keys stalled an open run by publishing roster entries at its round; benchmarks/quorum_inflation.py). Pure: the rule,
the digest that carries the group, the state that keeps it, and the leader it prefers."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from p2p_diloco.net.averaging.contribution import Contribution, count_quorum
from p2p_diloco.net.consensus import PeerStatus, alive_of, designated_leader
from p2p_diloco.train.global_state import GlobalState, parse_quorum
from p2p_diloco.train.outer import OuterNesterov, state_digests

pytestmark = pytest.mark.timeout(60)


def _group(members, at="x", electorate=0, alive=0):
    """Contributions of ``members`` (peer ids) at round 3, digest ``at`` (a dict overrides a member's digest); each
    member sees ``alive`` members of the last committing group alive."""
    digests = at if isinstance(at, dict) else {}
    return ([Contribution(p, 3, digests.get(p, "x" if digests else at), 10, electorate=electorate,
                          live_quorum=alive) for p in members], list(members))


def test_strangers_roster_entries_do_not_stop_the_group_that_holds_most_of_the_last_committers():
    contributions, ids = _group(["A", "B"], electorate=6)  # each member sees 4 strangers' entries at its round
    assert count_quorum(contributions, ids, 0).ok is False  # the roster rule: 2 of 6, the stall measured
    verdict = count_quorum(contributions, ids, 0, quorum=["A", "B"])
    assert (verdict.ok, verdict.holders, verdict.size) == (True, 2, 2)


def test_joiners_hold_the_round_but_are_not_counted():
    contributions, ids = _group(["A", "J1", "J2", "J3"], electorate=4)
    verdict = count_quorum(contributions, ids, 1, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.holders, verdict.size) == (False, 1, 3)
    assert "holds 1 of the 3 peers that committed it at round 3" in verdict.why_not(4, 3)
    contributions, ids = _group(["A", "B", "J1"], electorate=4)
    assert count_quorum(contributions, ids, 2, quorum=["A", "B", "C"]).ok  # joiners go on with the majority


def test_a_member_of_another_state_is_not_counted_and_its_own_verdict_is_the_roster_rules():
    contributions, ids = _group(["A", "B", "C"], at={"A": "x", "B": "x", "C": "old"}, electorate=3)
    verdict = count_quorum(contributions, ids, 0, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.holders) == (True, 2)  # A and B; C holds another θ_global
    # C does not hold the state the group averages (it does not commit either way): the list it knows is not that
    # state's, so it goes by the roster
    assert count_quorum(contributions, ids, 2, quorum=["A", "B", "C"]).over == "peers"


@pytest.mark.parametrize("seed", range(30))
def test_two_disjoint_groups_never_both_commit(seed):
    """Any last committers M, any joiners, any split into two disjoint groups, strangers' entries inflating every
    roster view, and any of M alive beyond the two groups, every member seeing every peer of the round and the
    same ones alive: at most one group commits."""
    rng = random.Random(seed)
    m = [f"M{i}" for i in range(rng.randint(1, 9))]
    peers = m + [f"J{i}" for i in range(rng.randint(0, 6))]
    for _ in range(200):
        first = [p for p in peers if rng.random() < 0.5]
        second = [p for p in peers if p not in first and rng.random() < 0.8]
        alive = len({p for p in first + second if p in m} | {p for p in m if rng.random() < 0.3})
        verdicts = []
        for group in (first, second):
            seen = len(first) + len(second) + rng.randint(0, 30)  # every peer of the round, and strangers' entries
            contributions, ids = _group(group, electorate=seen, alive=alive)
            verdicts.append(bool(group) and all(count_quorum(contributions, ids, me, quorum=m).ok
                                                for me in range(len(group))))
        assert not all(verdicts), (m, first, second, alive)


def test_members_of_the_group_that_died_stop_counting_once_their_entries_expire():
    contributions, ids = _group(["A", "J"], electorate=9, alive=3)  # B and C still have live entries: 1 of 3
    verdict = count_quorum(contributions, ids, 0, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.holders, verdict.size) == (False, 1, 3)
    contributions, ids = _group(["A", "J"], electorate=9, alive=1)  # their entries expired (strangers': no say)
    verdict = count_quorum(contributions, ids, 1, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.holders, verdict.size) == (True, 1, 1)
    contributions, ids = _group(["A", "J"], electorate=2, alive=2)  # B is alive, only slow: A alone is half
    verdict = count_quorum(contributions, ids, 1, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.size) == (False, 2)
    assert "holds 1 of the 2 peers that committed it still alive" in verdict.why_not(2, 3)
    contributions, ids = _group(["A", "J"], electorate=2, alive=0)  # a member without a view: not a view
    assert not count_quorum(contributions, ids, 1, quorum=["A", "B", "C"]).ok


def test_a_group_without_any_member_of_it_commits_only_once_none_is_alive_then_by_the_roster():
    contributions, ids = _group(["J1", "J2"], electorate=2, alive=1)
    assert not count_quorum(contributions, ids, 0, quorum=["A", "B", "C"]).ok  # A lives: its group may commit
    contributions, ids = _group(["J1", "J2"], electorate=2)  # a run restarted by peers with new keys
    assert count_quorum(contributions, ids, 0, quorum=["A", "B", "C"]).ok
    contributions, ids = _group(["J1", "J2"], electorate=5)
    assert not count_quorum(contributions, ids, 0, quorum=["A", "B", "C"]).ok


def test_the_last_round_counts_the_whole_group_that_committed_the_round_before_not_the_roster():
    """At the run's last round a member's entry gone may be a finisher's, not a death: nobody has a view of who is
    alive (consensus.alive_of gives 0), so a group commits only with more than half of the whole list. Strangers'
    entries inflating the roster view (the roster rule the last round kept before) no longer make it stop short;
    two stragglers of 16 whose other 14 finished (entries expired) cannot commit a second final θ_global."""
    me = PeerStatus("a", "A", 3, "x")
    live = [PeerStatus("b", "B", 3, "x"), PeerStatus("s1", "S1", 3, "x"), PeerStatus("s2", "S2", 3, "x")]
    assert alive_of(["A", "B", "C"], me, live) == 2 and alive_of(["A", "B", "C"], me, live, final=True) == 0
    contributions, ids = _group(["A", "B"], electorate=8, alive=alive_of(["A", "B", "C"], me, live, final=True))
    assert count_quorum(contributions, ids, 0).ok is False  # the roster rule: strangers' entries at 8 views
    verdict = count_quorum(contributions, ids, 0, quorum=["A", "B", "C"])
    assert (verdict.ok, verdict.holders, verdict.size) == (True, 2, 3)
    listed = [f"P{i:02d}" for i in range(16)]
    stragglers, _ = _group(listed[:2], electorate=2, alive=2)  # what they would see alive: each other
    assert count_quorum(stragglers, listed[:2], 0, quorum=listed).ok  # before the last round: they go on
    stragglers, _ = _group(listed[:2], electorate=2, alive=0)  # at the last round
    assert not count_quorum(stragglers, listed[:2], 0, quorum=listed).ok


def test_every_member_of_the_state_reaches_the_same_verdict():
    for members in itertools.combinations(["A", "B", "C", "D", "J"], 3):
        contributions, ids = _group(members, electorate=5)
        verdicts = {count_quorum(contributions, ids, me, quorum=["A", "B", "C", "D"]).ok for me in range(3)}
        assert len(verdicts) == 1


def test_the_digest_carries_the_group_and_is_unchanged_without_one():
    params, state = [torch.ones(3)], [torch.zeros(3)]
    plain = state_digests(params, state)
    assert state_digests(params, state, []) == plain
    with_group = state_digests(params, state, ["B", "A"])
    assert with_group[0] == plain[0] and with_group[1] != plain[1]  # θ's own digest is θ's alone
    assert state_digests(params, state, ["A", "B"]) == with_group  # the order it is given in does not matter
    assert state_digests(params, state, ["A", "C"])[1] != with_group[1]


def test_the_state_keeps_its_group_through_a_commit_a_download_and_a_checkpoint():
    params = [torch.ones(3)]
    state = GlobalState(params, OuterNesterov(params, lr=0.7, momentum=0.9))
    before = state.digest
    state.apply([torch.full((3,), 0.1)], num_contributions=2, members=["a", "b"], quorum=["Qb", "Qa"])
    assert state.quorum == ["Qa", "Qb"] and state.digest != before
    round_, digest, tensors, _, quorum = state.snapshot()
    other_params = [torch.zeros(3)]
    other = GlobalState(other_params, OuterNesterov(other_params, lr=0.7, momentum=0.9))
    other.load(round_, tensors, quorum=quorum)
    assert other.digest == digest
    saved = state.state_dict()
    again_params = [torch.zeros(3)]
    again = GlobalState(again_params, OuterNesterov(again_params, lr=0.7, momentum=0.9))
    again.load_state_dict(saved)
    assert (again.quorum, again.digest) == (["Qa", "Qb"], digest)
    again.load_state_dict({k: v for k, v in saved.items() if k != "quorum"})  # a checkpoint from before it
    assert again.quorum == [] and again.digest != digest  # unknown: the peer repairs to the run's state


def test_a_donors_quorum_list_is_checked_before_anything_is_hashed():
    assert parse_quorum(None) == [] and parse_quorum(["b", "a"]) == ["a", "b"]
    for bad in ("ab", [1], ["a", "a"], [""], ["a b"], ["x" * 129], ["a"] * 5000, {"a": 1}):
        assert parse_quorum(bad) is None, bad


def test_the_leader_is_one_of_the_last_committers_while_one_can_lead():
    me = PeerStatus("m", "M5", 3, "x")
    live = [PeerStatus("s", "A1", 3, "x"), PeerStatus("t", "A2", 3, "x"),  # strangers' entries, smaller ids
            PeerStatus("q", "M2", 3, "x"), PeerStatus("j", "J0", 3, "x")]
    assert designated_leader(me, live) == "A1"
    assert designated_leader(me, live, quorum=["M2", "M5"]) == "M2"
    assert designated_leader(me, live, passed_over=["M2"], quorum=["M2", "M5"]) == "M5"
    assert designated_leader(me, live[:2], quorum=["Q9"]) == "A1"  # none of them live: any peer at the round
    # we joined the round outside the list; its only peer we see at the round is a leader we passed over (dead):
    # we lead, rather than name it again (a 16-peer swarm with kills: a survivor named a dead leader 4 times)
    joiner, dead = PeerStatus("n", "N7", 3, "x"), PeerStatus("d", "D0", 3, "x")
    assert designated_leader(joiner, [dead], quorum=["D0", "Q1"]) == "D0"
    assert designated_leader(joiner, [dead], passed_over=["D0"], quorum=["D0", "Q1"]) == "N7"


def test_the_group_waits_for_the_last_committers_a_roster_read_missed():
    """16 peers on 2 cores: the leader's roster read missed two peers whose heartbeat was late, started the last
    round's group as soon as the 14 it saw had joined, and the two, a second later, lost the round. The peers that
    committed our round with us are waited for too, unless they announced a leave."""
    from p2p_diloco.net.consensus import expected_group

    me = PeerStatus("m", "M0", 3, "x")
    live = [PeerStatus("a", "A1", 3, "x"), PeerStatus("b", "B2", 2, "y")]  # B2 behind: counted, as before
    assert expected_group(me, live) == 3
    assert expected_group(me, live, quorum=["M0", "A1", "C3", "D4"]) == 5  # C3, D4 committed round 3 with us
    assert expected_group(me, live, quorum=["M0", "A1", "C3", "D4"], left=["D4"]) == 4  # D4 said it leaves
    assert expected_group(me, live, floor=16) == 16  # round 1: the run's declared size, whatever one read showed
    assert expected_group(me, live, quorum=["M0", "A1", "C3", "D4"], floor=2) == 5


def test_the_leader_waits_only_for_missed_last_committers_that_answer_a_ping(monkeypatch):
    """A member of the list that died (killed in its inner steps) would cost every round after it the leader's whole
    window (16 peers with a kill each round: the median wait for a group went from 3 to 10 s); the leader pings the
    listed peers its read missed and waits only for those that answer. Followers do not ping."""
    from types import SimpleNamespace

    from p2p_diloco.config import load_config
    from p2p_diloco.net import dht as dht_module
    from p2p_diloco.net.exchange import Exchange

    asked = []

    def answering(dht, peer_ids, timeout):
        asked.append(list(peer_ids))
        return {"C3"}  # D4 is dead

    monkeypatch.setattr(dht_module, "answering", answering)
    cfg = load_config(overrides={"run.expected_peers": 16})
    state = SimpleNamespace(params=[], quorum=["M0", "A1", "C3", "D4", "E5"], round=3)
    stale = set()
    peer = SimpleNamespace(cfg=cfg, state=state, round=3, dht=object(),
                           membership=SimpleNamespace(left={"E5"}, stale=lambda: stale))
    exchange = Exchange(peer, "none")
    me, live = PeerStatus("m", "M0", 3, "x"), [PeerStatus("a", "A1", 3, "x")]
    assert exchange._group_size(me, live, lead=True) == 3 and asked == [["C3", "D4"]]  # M0, A1, and C3
    assert exchange._group_size(me, live, lead=False) == 2 and len(asked) == 1
    # a live entry that missed two heartbeats is pinged too: D4's (dead) is not waited for, C3's (late) is
    stale.update({"C3", "D4"})
    live = [PeerStatus("a", "A1", 3, "x"), PeerStatus("c", "C3", 3, "x"), PeerStatus("d", "D4", 3, "x")]
    assert exchange._group_size(me, live, lead=True) == 3 and asked[-1] == ["C3", "D4"]
    stale.clear()
    assert exchange._group_size(me, live, lead=True) == 4 and len(asked) == 2  # none stale: D4's entry counts
    peer.round = 0  # round 1: the run's declared size
    assert exchange._group_size(me, live, lead=False) == 16


def test_an_entry_is_stale_once_it_missed_two_heartbeats():
    import threading
    import types

    import torch
    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.config import Config
    from p2p_diloco.net.membership import Membership
    from p2p_diloco.ops.metrics import MetricsSink
    from p2p_diloco.train.global_state import GlobalState
    from p2p_diloco.train.outer import OuterNesterov

    params = [torch.ones(2)]
    me = Membership(Config(), None, types.SimpleNamespace(peer_id="me"), "prefix", "me",
                    GlobalState(params, OuterNesterov(params, lr=0.7, momentum=0.9)), "fp", MetricsSink(),
                    threading.Event())
    ttl, now = me.cfg.averaging.roster_ttl, get_dht_time()
    me._known = {"fresh": (PeerStatus("f", "fresh", 1, "x"), now + ttl - 1),       # its last heartbeat: 1 s ago
                 "late": (PeerStatus("l", "late", 1, "x"), now + ttl / 2),        # missed one
                 "dead": (PeerStatus("d", "dead", 1, "x"), now + ttl / 3 - 1)}   # missed two
    assert me.stale() == {"dead"}
