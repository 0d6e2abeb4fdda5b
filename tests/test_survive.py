"""Rounds that survive a member's death (net/averaging/survive.py): the pure rules of the retry group; what a
follower watches while it waits for a group (net/watches.py)."""

from __future__ import annotations

from hivemind.p2p import PeerID

from p2p_diloco.net.averaging.survive import PING_S, SETTLE_S, kept_members, retry_group_id, retry_timeouts


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


def test_a_retry_waits_for_survivors_that_learn_of_the_death_a_chunk_timeout_later():
    """CI: a member behind a failed router; one survivor's connection to it closed and it started the retry 7 s
    before the two that waited out its parts' timeout; its reducer gave up on their parts at the chunk timeout and
    the retry failed on all three. The retry's senders and reducers now wait longer by that spread."""
    kwargs = {"sender_timeout": 5.0, "reducer_timeout": 10.0, "part_size_bytes": 2 ** 19}
    widened = retry_timeouts(kwargs, next_chunk_timeout=5.0)
    spread = 5.0 + SETTLE_S + PING_S
    assert widened == {"sender_timeout": 5.0 + spread, "reducer_timeout": 10.0 + spread, "part_size_bytes": 2 ** 19}
    assert widened["sender_timeout"] > 7.0 and kwargs["sender_timeout"] == 5.0  # the first attempt's stay
    assert retry_timeouts({"sender_timeout": None}, 5.0) == {"sender_timeout": None}  # no timeout: none to widen


def test_a_survivor_keeps_the_members_it_reaches_again_and_leaves_out_the_dead_and_the_frozen(monkeypatch):
    """After a failed all-reduce a survivor pings the group's other members (Survivor._survivors). One it is still
    connected to is kept unless it is silent (frozen); any error is an answer there. One it lost its connection to
    (32 peers on 2 cores: 4 of 30 survivors lost connections to live members and their retries had other ids) is
    dialed again and kept only if it answers: a failed dial is a dead member's closed port."""
    import asyncio
    import types

    from hivemind.averaging.group_info import GroupInfo

    from p2p_diloco.net.averaging import survive

    monkeypatch.setattr(survive, "SETTLE_S", 0.0)
    monkeypatch.setattr(survive, "PING_S", 0.3)
    me, alive, refusing, frozen, redialed, dead, lost = _ids(7)
    behaviour = {alive: "answer", refusing: "error", frozen: "silent", redialed: "answer", dead: "error",
                 lost: "silent"}

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_ping(self, request):
            async def stream():
                if behaviour[self.peer] == "error":
                    raise ConnectionError("dial failed")
                if behaviour[self.peer] == "silent":
                    await asyncio.sleep(10)
                yield request
            return stream()

    class P2P:
        async def list_peers(self):
            return [types.SimpleNamespace(peer_id=p) for p in (alive, refusing, frozen)]

    class Averager(survive.Survivor):
        peer_id, prefix, _p2p = me, "run", P2P()

        def get_stub(self, p2p, peer, namespace):
            return Stub(peer)

    members = (me, alive, refusing, frozen, redialed, dead, lost)
    group = GroupInfo(b"g" * 20, members, tuple(b"" for _ in members))
    retry, keep = asyncio.run(Averager()._survivors(group))
    assert [members[i] for i in keep] == [me, alive, refusing, redialed]
    assert retry.peer_ids == (me, alive, refusing, redialed)
    assert retry.group_id == survive.retry_group_id(group.group_id, [me, alive, refusing, redialed])


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
