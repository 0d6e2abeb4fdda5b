"""Pure agreement rules: which state a peer must fetch, and the chaos plan's guarantees."""

import pytest

from p2p_diloco.net.consensus import PeerStatus, majority_state, sync_target, electorate, has_quorum, quorum_size
from p2p_diloco.ops.swarm import KILL_PHASES, plan_chaos, plan_kill_each_round

pytestmark = pytest.mark.timeout(30)


def _s(name, round_, digest, **kw):
    return PeerStatus(name=name, peer_id=f"id-{name}", round=round_, digest=digest, **kw)


def test_in_sync_peer_needs_nothing():
    me = _s("a", 3, "x")
    assert sync_target(me, [me, _s("b", 3, "x"), _s("c", 2, "old")]) is None


def test_peer_behind_fetches_the_latest_round_from_its_holders_in_name_order():
    me = _s("a", 1, "x")
    target = sync_target(me, [_s("c", 3, "y"), _s("b", 3, "y"), _s("d", 2, "z")])
    assert (target.round, target.digest, target.donors) == (3, "y", ["id-b", "id-c"])


def test_minority_of_a_half_committed_round_repairs_to_the_majority():
    me = _s("a", 4, "lonely")
    target = sync_target(me, [_s("b", 4, "major"), _s("c", 4, "major"), me])
    assert (target.round, target.digest, target.donors) == (4, "major", ["id-b", "id-c"])
    # and the majority does not move towards the minority
    assert sync_target(_s("b", 4, "major"), [me, _s("c", 4, "major")]) is None


def test_leaving_peers_and_client_mode_peers_are_not_donors():
    me = _s("a", 1, "x")
    target = sync_target(me, [_s("b", 2, "y", leaving=True), _s("c", 2, "y", donor=False), _s("d", 2, "y")])
    assert target.donors == ["id-d"]
    assert sync_target(me, [_s("b", 5, "y", leaving=True)]) is None  # a leaver does not define the run's state


def test_ties_break_the_same_way_everywhere():
    states = [(3, "b"), (3, "a"), (2, "c"), (2, "c")]
    assert majority_state(states) == (2, "c")
    assert majority_state([(3, "b"), (3, "a")]) == majority_state([(3, "a"), (3, "b")]) == (3, "a")


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("peers,rounds", [(3, 6), (3, 8), (4, 8), (6, 8)])
def test_chaos_plan_keeps_two_peers_alive_and_covers_every_fault(seed, peers, rounds):
    plan = plan_chaos(seed, peers, rounds=rounds)  # rounds = 6: the fewest --chaos accepts
    assert plan == plan_chaos(seed, peers, rounds=rounds), "a seed must give one plan"
    assert all(1 <= number < rounds for number, _, _ in plan.actions), plan
    phases = {f.split(":")[1] for f in plan.faults.values()}
    assert {"allreduce", "serving"} <= phases
    kinds = [kind for _, kind, _ in plan.actions]
    assert kinds.count("join") == 2 and kinds.count("leave") == 1 and kinds.count("kill_bootstrap") == 1
    removals = len(plan.faults) + kinds.count("leave")
    assert peers + kinds.count("join") - removals >= 2
    if peers >= 4:
        assert phases & {"inner", "matchmaking"}


@pytest.mark.parametrize("peers,rounds", [(3, 4), (12, 8), (12, 13)])
def test_kill_each_round_plan_kills_one_new_member_per_round_at_a_seeded_phase(peers, rounds):
    plans = [plan_kill_each_round(seed, peers, rounds) for seed in range(30)]
    assert plans[7] == plan_kill_each_round(7, peers, rounds), "a seed must give one plan"
    for plan in plans:
        assert plan.replace and not plan.actions
        kills = sorted((int(f.split(":")[2]), f.split(":")[1], name) for name, f in plan.faults.items())
        assert [r for r, _, _ in kills] == list(range(2, rounds)), "one kill in each round from 2 to the last but one"
        assert all(f.startswith("kill:") for f in plan.faults.values())
        assert {phase for _, phase, _ in kills} <= set(KILL_PHASES)
    assert {f.split(":")[1] for plan in plans for f in plan.faults.values()} == set(KILL_PHASES)
    with pytest.raises(ValueError):
        plan_kill_each_round(0, rounds - 2, rounds)  # too few members to lose a different one each round


def test_deadlines_start_at_the_floors_and_grow_with_payload_and_slow_links():
    from p2p_diloco.net.deadlines import DeadlineEstimator

    est = DeadlineEstimator(allreduce_floor=60, chunk_floor=10, part_size_bytes=2 ** 19, payload_bytes=300_000_000)
    assert (est.deadlines(4).allreduce_timeout, est.deadlines(4).next_chunk_timeout) == (60, 10)
    est.observe(bytes_moved=450_000_000, seconds=45.0)  # 10 MB/s measured: a slow home link
    d = est.deadlines(4)
    # 2(N-1)/N x 300 MB = 450 MB at 10 MB/s = 45 s expected; 4x margin = 180 s
    assert d.allreduce_timeout == pytest.approx(180.0)
    assert d.next_chunk_timeout == pytest.approx(max(10, 8 * 2 ** 19 / 10e6))
    assert d.matchmaking_time == 0.0  # no round observed yet: the floor
    est.observe_round(600.0)  # 10-minute rounds: peers' arrivals spread more
    assert est.deadlines(4).matchmaking_time == pytest.approx(30.0)
    fast = DeadlineEstimator(60, 10, 2 ** 19, 300_000_000)
    fast.observe(450_000_000, 0.5)  # a fast link never tightens below the configured floors
    assert (fast.deadlines(4).allreduce_timeout, fast.deadlines(4).next_chunk_timeout) == (60, 10)


# ---------------------------------------------------------------------------------------------- one θ_global per round

def test_electorate_counts_the_live_peers_at_my_round_and_me():
    me = PeerStatus("a", "A", 4, "x")
    live = [PeerStatus("a", "A", 3, "old"),  # our own stale entry: we count once
            PeerStatus("b", "B", 4, "x"), PeerStatus("c", "C", 4, "y"),  # same round, any digest: in the run
            PeerStatus("d", "D", 2, "z"),  # behind: repairing, not in this round's group
            PeerStatus("e", "E", 4, "x", leaving=True)]
    assert electorate(me, live) == 3


def test_quorum_size_is_the_upper_median_of_the_members_views():
    assert quorum_size([16, 16, 16, 3]) == 16  # one member that sees few peers does not shrink the run
    assert quorum_size([16, 1000, 16]) == 16   # nor does one that claims many grow it
    assert quorum_size([0, 0]) == 0            # no views (outside a swarm): no quorum rule
    assert quorum_size([0, 8, 8]) == 8


@pytest.mark.parametrize("n", range(1, 33))
def test_two_disjoint_groups_of_one_round_never_both_have_quorum(n):
    """Every split of n peers into two groups, every member seeing all n: at most one group may commit, and one
    does whenever the split is uneven."""
    for k in range(0, n + 1):
        first, second = has_quorum(k, [n] * k), has_quorum(n - k, [n] * (n - k))
        assert not (first and second and k and n - k)
        if 2 * k != n:
            assert first or second


def test_a_group_without_views_keeps_committing():
    assert has_quorum(1, [0])  # an averager used outside a swarm announces no electorate


def test_quorum_holders_count_every_member_of_the_majority_state():
    from p2p_diloco.net.averaging.contribution import Contribution, count_quorum

    group = [Contribution("a", 3, "x", 10, electorate=4), Contribution("b", 3, "x", 0, electorate=4),  # no tokens:
             Contribution("c", 2, "old", 10, electorate=4)]  # still in no other group
    verdict = count_quorum(group, ["A", "B", "C"], 0)
    assert (verdict.ok, verdict.holders, verdict.size) == (False, 2, 4)
    verdict = count_quorum(group, ["A", "B", "C"], 0, quorum=["B", "C", "D"])  # the group that committed round 3
    assert (verdict.ok, verdict.holders, verdict.size) == (False, 1, 3)


def test_run_size_keeps_the_largest_committed_group_until_quorum_keeps_failing():
    from p2p_diloco.net.consensus import FORGET_AFTER, RunSize

    size = RunSize(floor=8)              # run.expected_peers before any commit
    assert size.electorate(3) == 8       # a roster read that missed peers does not shrink the quorum
    size.committed(6)
    assert size.electorate(3) == 8       # a smaller group does not lower it either
    size.committed(12)
    assert size.electorate(20) == 20 and size.electorate(5) == 12
    for _ in range(FORGET_AFTER - 1):
        size.no_quorum()
    assert size.electorate(5) == 12
    size.no_quorum()                     # the run really shrank: go by what we see
    assert size.electorate(5) == 5



def test_at_the_last_round_the_run_size_is_kept_and_the_peer_gives_up_instead():
    """Stragglers that missed the run's last round see only each other once the finishers' entries expire: they
    must not forget the run's size and commit a last round of their own (16-peer swarm: a second final θ_global)."""
    from p2p_diloco.net.consensus import FORGET_AFTER, RunSize

    size = RunSize(floor=16)
    size.committed(11)
    size.no_quorum(final=True)
    size.committed(11)                   # a commit in between: failures count in a row
    for _ in range(FORGET_AFTER - 1):
        size.no_quorum(final=True)
    assert size.electorate(2) == 16 and not size.given_up
    size.no_quorum(final=True)
    assert size.given_up and size.electorate(2) == 16, "the bound is kept: a group of 2 never finds a quorum"

def test_one_entry_claiming_a_far_round_is_not_followed():
    me, honest = _s("a", 10, "x"), [_s("b", 10, "x"), _s("c", 10, "x")]
    assert sync_target(me, [*honest, _s("evil", 10 ** 9, "e")]) is None
    assert sync_target(me, [*honest, _s("evil", 11, "e")]) is None, "one entry just ahead is not followed either"
    joiner = sync_target(_s("new", 0, ""), [*honest, _s("evil", 10 ** 9, "e")])
    assert (joiner.round, joiner.digest, joiner.donors) == (10, "x", ["id-b", "id-c"])
    # two entries far ahead of the others' median: not followed; two just ahead neither (two identities are no
    # certificate in a run of five: a group of two could not have committed there)
    assert sync_target(me, [*honest, _s("e1", 10 ** 9, "e"), _s("e2", 10 ** 9, "e")]) is None
    assert sync_target(me, [*honest, _s("d", 11, "y"), _s("e", 11, "y")]) is None


def test_a_round_ahead_is_followed_once_most_of_the_run_holds_it():
    """The signed entries at round r are its certificate: more than half of the peers at r - 1 or later."""
    me = _s("s", 10, "x")
    stale = [_s(f"p{i:02d}", 10, "x") for i in range(15)]  # 16 peers; a group of 9 committed round 11 without us
    fresh = [_s(f"p{i:02d}", 11, "y") for i in range(9)]
    for seen in range(1, 10):  # the members' new entries reach us one by one
        target = sync_target(me, fresh[:seen] + stale[seen:])
        assert (target is not None) == (seen >= 8), seen  # the others' median: 8 of the 15 others
    assert sync_target(me, fresh + stale[9:]).donors == [f"id-p{i:02d}" for i in range(9)]
    # identities that claim the round after the run's must outnumber the run: 16 honest at 11, 15 Sybils at 12
    run = [_s(f"h{i:02d}", 11, "y") for i in range(15)]
    sybils = [_s(f"evil{i:02d}", 12, "e") for i in range(15)]
    assert sync_target(_s("me", 11, "y"), run + sybils) is None
    assert sync_target(_s("me", 11, "y"), run + sybils + [_s("evil99", 12, "e"), _s("evil98", 12, "e")]).round == 12
    # joiners far behind lower the median: the round after it is followed on its holders outnumbering the peers at
    # the round before it (3 committed round 11; we and one other missed it; 4 joiners are still at round 5)
    joiners = [_s(f"j{i}", 5, "z") for i in range(4)]
    target = sync_target(me, [*joiners, _s("t", 10, "x"), *fresh[:3]])
    assert (target.round, target.digest) == (11, "y")
    assert sync_target(me, [*joiners, _s("t", 10, "x"), _s("u", 10, "x"), *fresh[:2]]) is None  # 2 of 5: not yet


def test_a_lone_peer_ahead_is_followed_when_nobody_contradicts_it():
    target = sync_target(_s("new", 0, ""), [_s("veteran", 100, "v")])  # a run of one peer, joined
    assert (target.round, target.donors) == (100, ["id-veteran"])
    target = sync_target(_s("a", 4, "x"), [_s("b", 5, "y")])  # the other member committed, we did not
    assert target.round == 5


def test_the_run_is_over_for_stragglers_once_most_of_their_group_finished():
    """16 peers, run.rounds 4: 12 committed round 4 and left, 3 more missed it (all 16 committed round 3 together).
    Committing their own round 4 among themselves would fork the run's last θ_global: they stop."""
    from p2p_diloco.net.consensus import finished_without

    finishers = [_s(f"f{i:02d}", 4, "x", leaving=True) for i in range(12)]
    stragglers = [_s(f"s{i}", 3, "w") for i in range(3)]
    group = [s.peer_id for s in finishers + stragglers]  # round 3's group, this straggler left out
    assert finished_without(4, finishers + stragglers, [], group) == [f"f{i:02d}" for i in range(12)]
    # the entries of some finishers expired: the finished list still names them
    recorded = [(f"id-f{i:02d}", f"f{i:02d}", 4) for i in range(12)]
    assert len(finished_without(4, finishers[:2] + stragglers, recorded, group)) == 12
    # one finisher does not stop a run that more of the group still train; nor do strangers' records, however many
    assert finished_without(4, finishers[:1] + stragglers, [], group) == []
    strangers = [(f"id-x{i}", f"x{i}", 4) for i in range(100)]
    assert finished_without(4, stragglers, strangers, group) == []
    assert finished_without(4, stragglers, strangers) == []  # at round 0 (no group yet) neither
    # three stragglers and three finishers of a group of six (the attackers left out by the honest): over
    assert finished_without(4, finishers[:3] + stragglers[:2], [], group[:3] + group[12:14]) == ["f00", "f01", "f02"]
    # peers that left before the end are not finishers; once every other peer left, one finisher is enough
    assert finished_without(4, [_s("early", 2, "v", leaving=True)], []) == []
    assert finished_without(4, [_s("early", 2, "v", leaving=True), finishers[0]], []) == ["f00"]
    assert finished_without(4, [], [("id-f00", "f00", 4)]) == ["f00"]



def test_a_leader_that_gathered_no_group_in_a_window_is_passed_over_for_the_rest_of_the_round():
    """A peer held in its inner steps had the smallest id at round 0: the two others named it the leader and failed
    round 1 every 7 s for 2 minutes (CI's test_stop fixture); a home peer whose router failed, smallest id too,
    stalled two others the same way (CI's NAT test). After one window without a group every peer that waited for it
    names the same next leader, for that round only; the leader's own view is unchanged; a peer passed over is still
    named when no other can lead."""
    from dataclasses import replace

    from p2p_diloco.net.consensus import Leaders, designated_leader

    held, a, b = _s("held", 0, "r0"), _s("a", 0, "r0"), _s("b", 0, "r0")
    held = replace(held, peer_id="id-0-held")  # ids: id-0-held < id-a < id-b
    assert designated_leader(a, [held, b]) == designated_leader(b, [held, a]) == "id-0-held"
    assert designated_leader(a, [held, b], {"id-0-held"}) == designated_leader(b, [held, a], {"id-0-held"}) == "id-a"
    assert designated_leader(a, [held, b], {"id-0-held", "id-a", "id-b"}) == "id-0-held"  # all passed over
    assert designated_leader(a, [held, replace(b, donor=False)], {"id-0-held", "id-a"}) == "id-0-held"
    assert designated_leader(replace(a, donor=False), [held], {"id-0-held"}) == "id-0-held"  # nobody else can lead

    everyone = [held, a, b]
    views = {p.name: Leaders() for p in everyone}
    named = {p.name: views[p.name].name(p, everyone) for p in everyone}
    assert set(named.values()) == {"id-0-held"}  # every peer, the held one too, names it
    for v in views.values():
        v.no_group()  # the window passes without a group: the held peer gathered nobody
    named = {p.name: views[p.name].name(p, everyone) for p in everyone}
    assert named == {"held": "id-0-held", "a": "id-a", "b": "id-a"}  # the held one joins a's group when it can
    views["b"].no_group()  # a window without a group under a as well: the next one
    assert views["b"].name(b, everyone) == "id-b"
    at = [replace(p, round=1) for p in everyone]  # the next round: everyone names the smallest id again
    assert {views[p.name].name(p, at) for p in at} == {"id-0-held"}


def test_the_first_member_back_from_a_commit_names_the_same_leader_as_the_rest():
    """16 peers on a loaded machine: two members read the roster just after committing round 2, when most entries
    still showed round 1; each named itself the leader of round 3 and gathered a group nobody joined."""
    from p2p_diloco.net.consensus import designated_leader, with_my_group

    group = [_s(f"p{i:02d}", 1, "old") for i in range(16)]
    me = _s("p12", 2, "new")
    roster = [s for s in group if s.name != "p12"]
    roster[3] = _s("p03", 2, "new")  # one entry is fresh already
    assert designated_leader(me, roster) == "id-p03"  # as read: p03 and p12 alone at round 2
    seen = with_my_group(me, roster, (2, frozenset(s.name for s in group)))
    assert designated_leader(me, seen) == "id-p00"  # as the members that read the roster later name it
    assert electorate(me, seen) == 16
    # not for another round, not for peers outside our group, and not for an entry that is elsewhere
    assert with_my_group(me, roster, (1, frozenset(s.name for s in group))) == roster
    outsider = _s("late", 1, "old")
    assert with_my_group(me, [outsider], (2, frozenset(s.name for s in group))) == [outsider]
    behind = _s("p05", 0, "older")
    assert with_my_group(me, [behind], (2, frozenset(s.name for s in group))) == [behind]


def test_stragglers_read_the_finished_list_after_the_finishers_entries_expired(monkeypatch):
    """The 16-peer fork of round 4: the 9 finishers' roster entries had expired when the 4 stragglers, whose failing
    attempts took longer than the roster TTL, looked again; the finished list still named the finishers."""
    import threading
    from types import SimpleNamespace

    from p2p_diloco.config import load_config
    from p2p_diloco.net import membership as membership_module

    finishers = [(f"id-f{i}", f"f{i}", 4) for i in range(9)]
    monkeypatch.setattr(membership_module, "read_finished", lambda dht, prefix, timeout: finishers)
    cfg = load_config(overrides={"run.rounds": "4"})
    quorum = sorted([f"id-f{i}" for i in range(9)] + [f"id-s{i}" for i in range(4)])  # round 3's group, us in it
    me = membership_module.Membership(cfg, None, SimpleNamespace(peer_id="id-s0"), "run", "s0",
                                      SimpleNamespace(round=3, digest="w", quorum=quorum), "fp", None,
                                      threading.Event())
    stragglers = [_s(f"s{i}", 3, "w") for i in range(1, 4)]
    assert me.run_is_over(stragglers)
    finishers = finishers[:3]  # three of the group finished, nine did not: not over
    assert not me.run_is_over(stragglers)


def test_a_roster_read_answered_in_part_keeps_the_entries_that_have_not_expired(monkeypatch):
    """At 16 peers on 2 loaded cores successive roster reads returned 15, 8 and 14 of 16 peers: groups formed around
    different leaders. An entry a read missed is the run's until its own expiration time."""
    import threading
    from types import SimpleNamespace

    from p2p_diloco.config import load_config
    from p2p_diloco.net import membership as membership_module

    now = [1000.0]
    reads = []
    monkeypatch.setattr(membership_module, "get_dht_time", lambda: now[0])
    monkeypatch.setattr(membership_module, "read_roster_expiring", lambda dht, prefix, timeout: reads.pop(0))
    me = membership_module.Membership(load_config(), None, SimpleNamespace(peer_id="id-p00"), "run", "p00",
                                      SimpleNamespace(round=3, digest="w"), "fp", None, threading.Event())
    full = [(_s(f"p{i:02d}", 3, "w"), 1030.0) for i in range(16)]
    reads += [full, full[:8], [(_s("p03", 4, "v"), 1040.0)] + full[4:14]]
    assert len(me.roster()) == 16
    assert len(me.roster()) == 16, "half a read does not halve the run"
    third = {s.name: s.round for s in me.roster()}
    assert len(third) == 16 and third["p03"] == 4, "the newest entry of each peer wins"
    now[0] = 1035.0  # the entries written at 1000 expired; p03's newer one has not
    reads.append([])
    assert [s.name for s in me.roster()] == ["p03"]


def test_a_straggler_whose_donors_died_fetches_from_the_peer_that_went_on():
    """Seen in the kill-each-round swarm: peer0 and peer1 committed round 2, peer1 died at round 3's checks after
    peer0 had its average, and peer0 committed round 3 alone. new0, at round 1, saw round 2 as the run's: its only
    holder (peer1's entry, not expired yet) was dead. The peer that went on to round 3 is tried next."""
    me = _s("new0", 1, "r1")
    roster = [_s("peer0", 3, "r3"), _s("peer1", 2, "r2"), _s("peer2", 1, "r1")]  # peer1 and peer2 are dead
    target = sync_target(me, roster)
    assert (target.round, target.digest, target.donors) == (2, "r2", ["id-peer1", "id-peer0"])
    # a round far past the target is not in the list: one entry claiming it proves nothing
    assert sync_target(me, [_s("peer1", 2, "r2"), _s("evil", 5, "e")]).donors == ["id-peer1"]


def test_a_round_seen_as_the_runs_is_remembered_while_a_live_peer_holds_it_or_a_later_one():
    """Later, peer1's entry expired and new1 joined from new0 at round 1: the roster (peer0 at 4, new1 at 1) no
    longer makes round 2 credible, and new0 and new1 alone would commit a second round 2. The round new0 saw
    stays its target while a live peer holds it or a later one (its digest unknown: "")."""
    me, new1 = _s("new0", 1, "r1"), _s("new1", 1, "r1")
    assert sync_target(me, [_s("peer0", 4, "r4"), new1]) is None, "without the memory"
    target = sync_target(me, [_s("peer0", 4, "r4"), new1], known_round=2)
    assert (target.round, target.digest, target.donors) == (2, "", ["id-peer0"])
    assert sync_target(me, [_s("peer0", 5, "r5"), new1], known_round=2).donors == [], "too far past it"
    assert sync_target(me, [new1], known_round=2) is None, "nobody holds it any more: forgotten"
    assert sync_target(_s("new0", 2, "r2"), [_s("peer0", 2, "r2")], known_round=2) is None


def test_membership_remembers_the_runs_round_and_the_peer_sits_out_until_it_holds_it():
    import threading
    from types import SimpleNamespace

    from p2p_diloco.config import load_config
    from p2p_diloco.net import membership as membership_module
    from p2p_diloco.net.exchange import Exchange

    state = SimpleNamespace(round=1, digest="r1", params=[])
    me = membership_module.Membership(load_config(), None, SimpleNamespace(peer_id="id-new0"), "run", "new0",
                                      state, "fp", None, threading.Event())
    first = me.behind([_s("peer0", 3, "r3"), _s("peer1", 2, "r2"), _s("peer2", 1, "r1")])
    assert first.round == 2 and me.known_round == 2
    later = me.behind([_s("peer0", 4, "r4"), _s("new1", 1, "r1")])  # peer1's entry expired
    assert (later.round, later.donors) == (2, ["id-peer0"]) and me.known_round == 2

    peer = SimpleNamespace(membership=me, round=1, state=state, cfg=load_config(), tokens_since_commit=40)
    exchange = Exchange(peer, "none")
    exchange.start([])  # would average at round 1 below the run's round 2: sends nothing
    settled = exchange.settle()
    assert not settled.committed and "behind the run: it reached round 2" in settled.result.error

    state.round, state.digest = 4, "r4"  # fetched peer0's state
    assert me.behind([_s("peer0", 4, "r4"), _s("new1", 1, "r1")]) is None and me.known_round == 0
    state.round, state.digest = 1, "r1"  # (a peer at round 1 again:) every holder of round 2 or later is gone
    assert me.behind([_s("peer0", 3, "r3"), _s("peer1", 2, "r2")]).round == 2 and me.known_round == 2
    assert me.behind([_s("new1", 1, "r1")]) is None and me.known_round == 0, "forgotten with its last holder"


def test_a_strangers_far_claim_seen_first_is_dropped_once_the_runs_peers_are_seen():
    """CI's roster-attack test: peer0 started when the roster held only an outsider's entry claiming round 10^9;
    it followed it (a fresh peer's only other entry) and, remembering it, sat out every round while the outsider's
    entry lived. Once the run's own peers are in the roster the claim is far above anything credible: forgotten."""
    import threading
    from types import SimpleNamespace

    from p2p_diloco.config import load_config
    from p2p_diloco.net import membership as membership_module

    evil = _s("evil", 10 ** 9, "e")
    state = SimpleNamespace(round=0, digest="r0", params=[])
    me = membership_module.Membership(load_config(), None, SimpleNamespace(peer_id="id-peer0"), "run", "peer0",
                                      state, "fp", None, threading.Event())
    assert me.behind([evil]).round == 10 ** 9 and me.known_round == 10 ** 9  # nothing else to go by
    assert me.behind([evil, _s("peer1", 0, "r0"), _s("peer2", 0, "r0")]) is None and me.known_round == 0
    assert sync_target(_s("peer0", 0, "r0"), [evil, _s("peer1", 0, "r0")], known_round=10 ** 9) is None
    # and it does not wait for its expected peers only until one entry past round 0 shows up: most must be
    waits = []
    me.stop_event = SimpleNamespace(wait=waits.append, is_set=lambda: len(waits) >= 3)  # stopped after 3 polls
    me.live_roster = lambda: [evil, me.status()]
    me.cfg.run.expected_peers = 3
    me.wait_for_expected_peers()
    assert len(waits) == 3, "it left the wait on one claim of a round past 0"
    waits.clear()
    me.live_roster = lambda: [_s("peer1", 4, "r4"), _s("peer2", 4, "r4"), me.status()]
    me.wait_for_expected_peers()
    assert waits == [], "two of three expected peers are past round 0: the run started without us"
    me.live_roster = lambda: [_s("peer1", 0, "r0"), evil, me.status()]
    me.wait_for_expected_peers()
    assert len(waits) == 3, "the stranger's entry was counted as the third expected peer (CI: two started alone)"
    waits.clear()
    me.live_roster = lambda: [_s("peer1", 0, "r0"), _s("peer2", 0, "r0"), evil, me.status()]
    me.wait_for_expected_peers()
    assert waits == [], "the three expected peers are present"
    # a remembered round at most LATER_DONORS above the credible one still stands (the straggler's case above)
    assert sync_target(_s("new0", 1, "r1"), [_s("peer0", 3, "r3"), _s("new1", 1, "r1")], known_round=3).round == 3
