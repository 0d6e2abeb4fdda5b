"""model.init_from: the check of the initial θ_global between peers (end to end, with a swarm: tests/test_ranks.py)."""

from __future__ import annotations

import pytest


def _membership(digest_of_others: list[str], monkeypatch):
    import threading
    import types

    import torch

    from p2p_diloco.config import Config
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.net.membership import Membership
    from p2p_diloco.ops.metrics import MetricsSink
    from p2p_diloco.train.global_state import GlobalState
    from p2p_diloco.train.outer import OuterSGD

    state = GlobalState([torch.ones(3)], OuterSGD([torch.ones(3)], lr=1.0))
    me = Membership(Config(), None, types.SimpleNamespace(peer_id="me"), "prefix", "me", state, "fp", MetricsSink(),
                    threading.Event())
    roster = [PeerStatus(name=f"p{i}", peer_id=f"id{i}", round=0, digest=d) for i, d in enumerate(digest_of_others)]
    monkeypatch.setattr(me, "roster", lambda: roster)
    return me, state.digest


@pytest.mark.timeout(60)
def test_a_peer_whose_initial_weights_differ_from_the_runs_refuses_to_train(monkeypatch):
    from p2p_diloco.config import ConfigError

    me, mine = _membership([], monkeypatch)
    me, mine = _membership([mine, "f" * 64], monkeypatch)
    me.check_initial_state("ckpt")  # two of three hold our bytes: we train
    me, mine = _membership(["a" * 64, "a" * 64], monkeypatch)
    with pytest.raises(ConfigError, match=r"^model\.init_from: 'ckpt' gives us initial weights .* every peer must"):
        me.check_initial_state("ckpt")
