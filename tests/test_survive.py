"""Rounds that survive a member's death (net/averaging/survive.py): the pure rules of the retry group."""

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
