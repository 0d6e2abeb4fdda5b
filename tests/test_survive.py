"""Rounds that survive a member's death (net/averaging/survive.py): the pure rules of the retry group; what a
follower watches while it waits for a group (net/watches.py)."""

from __future__ import annotations

from hivemind.p2p import PeerID

from p2p_diloco.net.averaging.survive import kept_members, retry_group_id


def _ids(n):
    return [PeerID(bytes([0, 36]) + bytes([i]) * 36) for i in range(n)]


def test_every_survivor_with_the_same_view_derives_the_same_group_and_another_view_another():
    a, b, c, d = _ids(4)
    first = b"g" * 20
    assert retry_group_id(first, [a, b, d]) == retry_group_id(first, [a, b, d])
    assert retry_group_id(first, [a, b, d]) != retry_group_id(first, [a, b, c, d])  # c seen alive by someone
    assert retry_group_id(first, [a, b, d]) != retry_group_id(b"h" * 20, [a, b, d])  # another round's group
    assert len(retry_group_id(first, [a, b])) == len(first)


def test_a_survivor_keeps_itself_and_the_members_it_is_still_connected_to_in_the_groups_order():
    a, b, c, d = _ids(4)
    assert kept_members([a, b, c, d], me=b, connected={d, a}) == [0, 1, 3]
    assert kept_members([a, b, c, d], me=b, connected=set()) == [1]  # alone: no retry (survive.py needs two)
    assert kept_members([a, b, c, d], me=c, connected={a, b, d, c}) == [0, 1, 2, 3]  # nobody gone: no retry


def test_a_follower_gives_up_on_its_leader_only_after_pings_in_a_row_go_unanswered(monkeypatch):
    """net/watches.py LeaderWatch: a leader that answers is waited for however long; two unanswered pings in a row
    end the wait; our own DHT failing to ask is not the leader's fault."""
    from concurrent.futures import Future

    from p2p_diloco.net.watches import LeaderWatch

    class FakeDHT:
        def __init__(self, answers):
            self.answers, self.asked = list(answers), 0

        def run_coroutine(self, query, return_future=False):
            self.asked += 1
            future = Future()
            answer = self.answers.pop(0)
            future.set_exception(answer) if isinstance(answer, Exception) else future.set_result(answer)
            return future

    monkeypatch.setattr(LeaderWatch, "PERIOD_S", 0.0)
    alive = LeaderWatch(FakeDHT([True] * 5), "12D3KooWleader", timeout=1.0)
    assert [alive() for _ in range(5)] == [None] * 5
    flaky = LeaderWatch(FakeDHT([False, True, False, RuntimeError("our DHT died"), False, False]), "x", 1.0)
    said = [flaky() for _ in range(6)]
    assert said[:5] == [None] * 5, said  # never two misses in a row: an answer, or our own failure, in between
    assert said[5] == "the leader …x does not answer (2 pings in a row)"

    monkeypatch.setattr(LeaderWatch, "PERIOD_S", 3600.0)
    slow = LeaderWatch(FakeDHT([False, False]), "x", 1.0)
    assert slow() is None and slow() is None and slow.dht.asked == 1  # at most one ping per period


def test_a_stopping_peer_stops_waiting_for_a_group():
    """net/watches.py StopWatch: silent until the peer is asked to stop, then the reason its matchmaking ends (the
    averager's process ends it only if no group holds the peer yet: survive.py _abandon_matchmaking). The swarm
    case: tests/test_ranks.py, whose one-rank peer waited out the whole matchmaking window after its partner left,
    past the stop's 12 s (exit 143 in about one run of four before)."""
    import threading

    from p2p_diloco.net.watches import StopWatch, Watches

    stop = threading.Event()
    watch = Watches(StopWatch(stop), lambda: None)
    assert watch() is None and not watch.run_moved
    stop.set()
    assert watch() == "stopping: this peer leaves the run" and not watch.run_moved


def test_a_follower_stops_waiting_once_the_run_credibly_committed_its_round_without_it(monkeypatch):
    """net/watches.py RunWatch: nothing read during a healthy wait; a stranger's claim of a later round is not
    followed; once most of the run holds the next round, the wait ends and that round is remembered as the run's."""
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.net.watches import RunWatch, Watches

    class FakeMembership:
        def __init__(self):
            self.known_round, self.reads = 0, 0
            self.others = [PeerStatus(name=n, peer_id=f"Qm{n}", round=3, digest="aa") for n in "abc"]

        def status(self):
            return PeerStatus(name="me", peer_id="Qmme", round=3, digest="aa")

        def live_roster(self):
            self.reads += 1
            return list(self.others)

    members = FakeMembership()
    watch = RunWatch(members, 3)
    assert watch() is None and members.reads == 0  # the first AFTER_S seconds: no read at all
    monkeypatch.setattr(RunWatch, "PERIOD_S", 0.0)
    watch._next = 0.0
    members.others.append(PeerStatus(name="x", peer_id="Qmx", round=10 ** 6, digest="ff"))  # a stranger's claim
    assert watch() is None and not watch.run_moved and members.known_round == 0
    for s in members.others[:3]:
        s.round, s.digest = 4, "bb"  # the run committed round 4 without us
    both = Watches(lambda: None, watch)
    assert both() == "the run committed round 4 while we waited for a group of round 4"
    assert both.run_moved and members.known_round == 4
