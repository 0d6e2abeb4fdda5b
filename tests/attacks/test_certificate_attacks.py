"""A stranger's made-up θ_global has no commit certificate (issue 24: θ_global only from what a group committed), in
a real DHT: the product's own nodes, one per identity, with the run's record checks installed. Two honest members
sign round 5's digest; two outside nodes (their own keys, no secret) sign another digest of round 5 naming
themselves as its group, and one of them also stores a commit record in an honest member's name. A peer at round 4,
whose round was committed by the two members and itself, refuses the strangers' state (none of its round's group
signed it) and would take the run's; the record in the member's name never reaches it."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import Config, NetworkConfig
from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.net.dht import start_dht
from p2p_diloco.net.keys import commits_key, publish_commits, read_commits
from p2p_diloco.net.membership import Membership
from p2p_diloco.net.security import schema
from p2p_diloco.ops.metrics import MetricsSink
from p2p_diloco.train.global_state import GlobalState
from p2p_diloco.train.outer import OuterNesterov

PREFIX, RUN = "certified_0123456789abcdef", "certified"
RUN_D, FORGED_D = "ab" * 32, "ef" * 32


@pytest.mark.timeout(120)
def test_a_strangers_self_signed_state_is_refused_and_a_members_name_cannot_be_borrowed(process_tag):
    net = NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=20.0)
    first = start_dht(net)
    nodes = [first]
    try:
        joined = NetworkConfig(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=20.0)
        for _ in range(4):
            nodes.append(start_dht(joined))
        for node in nodes:
            schema.install(node, PREFIX, RUN)
        member_a, member_b, stranger_x, stranger_y, me = nodes
        ids = {name: str(node.peer_id) for name, node in zip("abxyc", nodes)}
        for node in (member_a, member_b):
            assert publish_commits(node, PREFIX, str(node.peer_id), [(5, RUN_D)]).result(timeout=20)
        for node in (stranger_x, stranger_y):
            assert publish_commits(node, PREFIX, str(node.peer_id), [(5, FORGED_D)]).result(timeout=20)
        # the stranger's record in member a's name: unsigned by a, so every node refuses it (its own stores it
        # unsigned at most; readers drop it)
        stranger_x.store(commits_key(PREFIX), subkey=ids["a"], value={"peer_id": ids["a"], "commits": [[5, FORGED_D]]},
                         expiration_time=get_dht_time() + 600, return_future=True).result(timeout=20)

        seen = read_commits(me, PREFIX, timeout=10)
        assert seen.get(ids["a"]) == [(5, RUN_D)] and seen.get(ids["x"]) == [(5, FORGED_D)], seen

        params = [torch.ones(3)]
        state = GlobalState(params, OuterNesterov(params, lr=0.7, momentum=0.9))
        state.round, state.quorum = 4, sorted([ids["a"], ids["b"], ids["c"]])
        cfg = Config()
        member = Membership(cfg, me, types.SimpleNamespace(peer_id=ids["c"]), PREFIX, "me", state, "fp",
                            MetricsSink(), threading.Event())
        for name in "abc":  # what its roster reads showed: the three of its round's group alive
            member._known[ids[name]] = (PeerStatus(name=name, peer_id=ids[name], round=4, digest="00"),
                                        get_dht_time() + 60)
        forged = member._certificate({"round": 5, "digest": FORGED_D, "quorum": sorted([ids["x"], ids["y"]])})
        assert not forged.ok and forged.chained and forged.signed == 2, forged  # its own group signed it ...
        # ... none of our round's group did
        assert "0 of the 2 peers alive or signed of the group" in forged.why, forged.why
        run = member._certificate({"round": 5, "digest": RUN_D, "quorum": sorted([ids["a"], ids["b"]])})
        assert run.ok and run.chained and run.signed == 2, run
        # and the strangers cannot make the run's own group sign theirs: a's name on their digest was refused
        borrowed = member._certificate({"round": 5, "digest": FORGED_D, "quorum": sorted([ids["a"], ids["x"]])})
        assert not borrowed.ok and borrowed.signed == 1, borrowed
    finally:
        for node in nodes:
            node.shutdown()
