"""A downloaded state is checked before it is adopted (issue 24, findings 1 and 8): bounded while it arrives, by the
size this model's state can have, then refused if its shapes or dtypes differ, if it holds NaN or Inf, or if its
bytes are not what the donor's digest and the run's round say."""

from __future__ import annotations

import math
import threading
import types

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.config import Config
from p2p_diloco.net.averaging.state_pipe import StateBudget
from p2p_diloco.net.consensus import SyncTarget
from p2p_diloco.net.membership import Membership
from p2p_diloco.ops.metrics import MetricsSink
from p2p_diloco.train.global_state import GlobalState
from p2p_diloco.train.outer import OuterNesterov, state_digests

pytestmark = pytest.mark.timeout(60)


def _member():
    params = [torch.ones(3), torch.zeros(2, 2)]
    state = GlobalState(params, OuterNesterov(params, lr=0.7, momentum=0.9))
    return Membership(Config(), None, types.SimpleNamespace(peer_id="me"), "prefix", "me", state, "fp",
                      MetricsSink(), threading.Event())


def _offer(member, tensors, round_=5, **meta):
    n = len(member.state.params)
    digest = state_digests(tensors[:n], tensors[n:], meta.get("quorum") or ())[1]
    metadata = {"round": round_, "digest": digest, "fingerprint": "fp", "name": "donor", **meta}
    return metadata, tensors, SyncTarget(round_, digest, ["donor"])


def test_a_sound_state_passes_and_each_fault_is_named():
    me = _member()
    good = [t.clone() + 1 for t in me.state.tensors()]
    assert me._check_state(*_offer(me, good)) is None
    nan = [t.clone() for t in good]
    nan[0][1] = math.nan
    assert me._check_state(*_offer(me, nan)) == "it holds NaN or Inf"
    inf = [t.clone() for t in good]
    inf[-1][0, 0] = math.inf
    assert me._check_state(*_offer(me, inf)) == "it holds NaN or Inf"
    assert me._check_state(*_offer(me, [t.double() for t in good])) == "tensor shapes or dtypes differ"
    assert me._check_state(*_offer(me, good[:-1])) == "tensor shapes or dtypes differ"
    assert me._check_state(*_offer(me, good, round_="5")) == "its round is not a number"
    assert me._check_state(*_offer(me, good, fingerprint="other")) == "not a state of this run's model"
    metadata, tensors, target = _offer(me, good)
    assert "donor's digest" in me._check_state({**metadata, "digest": "0" * 64}, tensors, target)


def test_the_donors_quorum_group_is_part_of_what_its_digest_certifies():
    """The peer ids of the group that committed the round come with the state and are hashed into its digest: a
    donor cannot serve the run's θ_global with another group (which would move whose majority the next round
    needs) without the digest showing it."""
    me = _member()
    good = [t.clone() + 1 for t in me.state.tensors()]
    metadata, tensors, target = _offer(me, good, quorum=["QmA", "QmB"])
    assert me._check_state(metadata, tensors, target) is None
    assert "donor's digest" in me._check_state({**metadata, "quorum": ["QmA", "QmC"]}, tensors, target)
    assert "donor's digest" in me._check_state({**metadata, "quorum": []}, tensors, target)
    assert me._check_state({**metadata, "quorum": "QmA"}, tensors, target) == \
        "its round's quorum is not a list of peer ids"


def _message(nbytes: int, first: bool, metadata: bytes = b"") -> averaging_pb2.DownloadData:
    part = runtime_pb2.Tensor(buffer=b"\0" * nbytes, dtype="float32" if first else "")
    return averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)


def test_a_download_is_cut_off_past_the_size_this_models_state_can_have():
    averaged = [torch.zeros(1000), torch.zeros(10, 10)]  # 1,100 values: a state of at most 4 x 4,400 bytes + 1 MiB
    budget = StateBudget(averaged)
    budget.take(_message(4000, True, metadata=b"x" * 100))
    for _ in range(3):
        budget.take(_message(4400, True))  # θ_global and outer state of honest size
    with pytest.raises(ValueError, match="larger than this model's state"):
        for _ in range(10_000):  # a donor streaming forever is stopped within the bound, not at the timeout
            budget.take(_message(64 * 1024, False))
    with pytest.raises(ValueError, match="metadata is repeated"):
        budget = StateBudget(averaged)
        budget.take(_message(10, True, metadata=b"m"))
        budget.take(_message(10, False, metadata=b"m"))
    with pytest.raises(ValueError, match="larger than this model's state"):
        budget = StateBudget(averaged)
        for _ in range(20):  # more tensors than the state has, each tiny
            budget.take(_message(1, True))
