"""The canonical all-reduce with real processes on loopback: every peer gets the same bytes, equal to the weighted
mean within the codec's tolerance, and a round that loses a reducer's part is reported as failed, never applied."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from dataclasses import asdict

import pytest
import torch

from p2p_diloco.net.averaging import Contribution, choose_participants
from p2p_diloco.config import AveragingConfig, NetworkConfig
from p2p_diloco.ops.procs import join_or_kill

SHAPES = [torch.Size([700, 1500]), torch.Size([37])]  # ~1M values
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _tensors(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _worker(index, initial_peers, setups, results, die_after_parts):
    """One peer: for each averaging setup in turn, fill the buffers with known tensors, average once, report
    (setup index, result, sha256, tensors, error-feedback residual or None)."""
    torch.set_num_threads(1)
    from p2p_diloco.net import averaging
    from p2p_diloco.net.averaging.allreduce import CanonicalAllReduceRunner
    from p2p_diloco.net.dht import start_dht

    if die_after_parts is not None:  # fault injection: this peer's reducer dies after streaming N averaged parts
        original = CanonicalAllReduceRunner._accumulate_parts_streaming

        async def dying(self, stream, sender_index):
            sent = 0
            async for msg in original(self, stream, sender_index):
                if sent == die_after_parts:
                    os._exit(17)  # the averager process vanishes mid-stream, as on SIGKILL
                sent += 1
                yield msg

        CanonicalAllReduceRunner._accumulate_parts_streaming = dying

    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    try:
        for i, (setup, scale) in enumerate(setups):
            cfg = AveragingConfig(matchmaking_time=8, request_timeout=3, allreduce_timeout=40, next_chunk_timeout=5,
                                  part_size_bytes=2 ** 16, **setup)  # ~10 parts per reducer at 16 bits
            averager = averaging.Averager(dht, cfg, f"test{i}", SHAPES, expected_group_size=3)
            try:
                with averager.pseudo_grads() as buffers:
                    for b, t in zip(buffers, _tensors(index, scale)):
                        b.copy_(t)
                weight = 100 * (index + 1)
                result = averager.average(Contribution(f"p{index}", round=0, digest="d", tokens=weight), weight)
                with averager.pseudo_grads() as buffers:
                    digest = hashlib.sha256(b"".join(b.numpy().tobytes() for b in buffers)).hexdigest()
                    out = [b.numpy().copy() for b in buffers]  # numpy: no torch shared memory in the test
                ef = averager.error_feedback
                residual = [r.numpy().copy() for r in ef.pending] if ef is not None else None
                results.put((i, index, result, digest, out, residual))
            finally:
                averager.close()
    finally:
        dht.shutdown()


def _run_group(setups: list[tuple[dict, float]], die_after_parts=None, victim=2, timeout=120):
    """Three peers average once per (averaging config, scale of the inputs); returns
    {setup index: {peer index: (result, sha256, tensors, residual)}}."""
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    workers = []
    try:
        maddrs = visible_maddrs(boot)
        for i in range(3):
            fault = die_after_parts if i == victim else None
            workers.append(ctx.Process(target=_worker, args=(i, maddrs, setups, results, fault)))
            workers[-1].start()
        # every peer's report; the victim's too when its main process reports its dead averager (HelperDied), which
        # may come before a survivor's: it is not kept (what it holds is not asserted on)
        wanted = {i for i in range(3) if die_after_parts is None or i != victim}
        out = {}
        while len(out) < len(setups) or any(not wanted <= set(peers) for peers in out.values()):
            setup, index, result, digest, tensors, residual = results.get(timeout=timeout)
            if index not in wanted:
                continue
            residual = [torch.from_numpy(r) for r in residual] if residual is not None else None
            out.setdefault(setup, {})[index] = (result, digest, [torch.from_numpy(t) for t in tensors], residual)
        return out
    finally:
        join_or_kill(workers, timeout=15)
        boot.shutdown()


def _weighted_mean(scale: float) -> list[torch.Tensor]:
    weights = [100 * (i + 1) for i in range(3)]
    per_peer = [_tensors(i, scale) for i in range(3)]
    return [sum(w * t[j] for w, t in zip(weights, per_peer)) / sum(weights) for j in range(len(SHAPES))]


# one group of 3 peers averages once with each setup (processes start once for all of them)
SETUPS = {"scaled_fp16": (dict(codec="scaled_fp16"), 1e-4), "fp32": (dict(codec="fp32"), 1.0),
          "int8": (dict(codec="int8"), 1e-3), "int4+ef": (dict(codec="int4", error_feedback=True), 1e-3)}


@pytest.fixture(scope="module")
def averaged(module_process_tag):
    out = _run_group(list(SETUPS.values()))
    return {name: out[i] for i, name in enumerate(SETUPS)}


def _identical_and_complete(peers: dict) -> None:
    assert all(result.ok for result, *_ in peers.values()), [r.error for r, *_ in peers.values()]
    assert len({digest for _, digest, *_ in peers.values()}) == 1, "peers hold different bytes"
    for result, *_ in peers.values():
        assert result.group_size == 3 and result.tokens == 600 and sorted(result.peers) == ["p0", "p1", "p2"]
        assert result.bytes_sent > 0 and result.bytes_received > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,rtol", [("scaled_fp16", 2e-3), ("fp32", 1e-6)])
def test_three_peers_get_identical_bytes_equal_to_weighted_mean(averaged, name, rtol):
    peers, scale = averaged[name], SETUPS[name][1]
    _identical_and_complete(peers)
    expected = _weighted_mean(scale)
    for _, _, tensors, _ in peers.values():
        for got, want in zip(tensors, expected):
            # scaled fp16 keeps ~11 significant bits of each value relative to the part's spread; small pseudo-
            # gradients (1e-4) must survive, which plain fp16 would flush towards zero
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())
    if name == "scaled_fp16":
        payload = sum(s.numel() for s in SHAPES)
        sent = sum(result.bytes_sent for result, *_ in peers.values())
        # each peer sends 2(N-1)/N of the payload: 16 bits per value on the wire, plus a small header per part
        assert sent < 3 * 2 * (2 / 3) * payload * 2 * 1.05


def _block_step(values: torch.Tensor, codec) -> torch.Tensor:
    """Per value: the step between two codes of its block (absmax / qmax)."""
    blocks = torch.nn.functional.pad(values.reshape(-1), (0, -values.numel() % codec.block)).view(-1, codec.block)
    step = (blocks.abs().amax(dim=1, keepdim=True) / codec.qmax).expand_as(blocks)
    return step.reshape(-1)[: values.numel()].view(values.shape)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["int8", "int4+ef"])
def test_block_codecs_give_identical_bytes_the_quantized_mean_and_the_senders_residual(averaged, name):
    """Senders encode their parts (the reducer's own too), reducers accumulate the decoded parts in fp32 and encode
    the average once: every peer decodes the same bytes, equal to the average of the quantized contributions up to
    the average's own rounding; with error feedback each peer holds exactly what the wire lost of its contribution."""
    from p2p_diloco.net.averaging.codecs import BLOCK_CODECS

    peers, (setup, scale) = averaged[name], SETUPS[name]
    codec = BLOCK_CODECS[setup["codec"]]
    _identical_and_complete(peers)
    weights = [100 * (i + 1) for i in range(3)]
    inputs = [_tensors(i, scale) for i in range(3)]
    quantized = [[codec.round_trip(t) for t in ts] for ts in inputs]
    mean = [sum(w * q[j] for w, q in zip(weights, quantized)) / sum(weights) for j in range(len(SHAPES))]
    _, _, tensors, _ = peers[0]
    for got, want in zip(tensors, mean):
        assert ((got - want).abs() <= _block_step(want, codec) * 0.5001 + 1e-12).all()
    payload = sum(s.numel() for s in SHAPES) * codec.bits_per_value / 8
    sent = sum(result.bytes_sent for result, *_ in peers.values())
    assert 0.95 < sent / (3 * 2 * (2 / 3) * payload) < 1.05, "not the codec's bits on the wire"
    for index, (_, _, _, residual) in peers.items():
        if setup.get("error_feedback"):
            for r, x, q in zip(residual, inputs[index], quantized[index]):
                assert torch.equal(r, x - q), "the residual is not what the wire lost of our contribution"
        else:
            assert residual is None


@pytest.mark.timeout(180)
def test_reducer_killed_mid_stream_fails_the_round_on_every_survivor(process_tag):
    out = _run_group([(dict(codec="scaled_fp16"), 1e-3)], die_after_parts=1, victim=2)[0]
    assert set(out) == {0, 1}
    for result, *_ in out.values():
        assert not result.ok, "a round that lost a reducer's parts must not be reported as good"
        assert result.error


def test_participants_are_the_majority_of_one_theta():
    c = [Contribution("a", 3, "x", 10), Contribution("b", 3, "x", 10), Contribution("c", 2, "y", 10)]
    assert choose_participants(c) == [0, 1]
    # a tie goes to the higher round; members with no tokens contribute nothing
    c = [Contribution("a", 3, "x", 10), Contribution("b", 4, "y", 10), Contribution("c", 4, "y", 0)]
    assert choose_participants(c) == [1]
    # every member computes the same answer whatever the order of the list
    assert [c[i].name for i in choose_participants(c[::-1])] == ["b"]


@pytest.mark.timeout(60)
def test_roster_round_trip_ignores_fields_it_does_not_know(process_tag):
    """Peers of a newer version may publish more fields: older peers must still read their entries."""
    from p2p_diloco.net.consensus import PeerStatus
    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.keys import publish_status, read_roster, roster_key

    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:  # a record under a peer id must be signed by that peer (net/security/records.py): ours, written twice
        me = PeerStatus(name="a", peer_id=str(dht.peer_id), round=3, digest="d", tokens_per_s=123.5,
                        tokens_trained=4096)
        assert publish_status(dht, "run_x", me, ttl=30, timeout=5)
        assert [s.name for s in read_roster(dht, "run_x", timeout=5)] == ["a"]
        future = dht.store(roster_key("run_x"), subkey=me.peer_id, value={**asdict(me), "name": "b",
                                                                           "from_the_future": [1, 2]},
                           expiration_time=get_dht_time() + 30, return_future=True)
        assert future.result(timeout=5)
        roster = read_roster(dht, "run_x", timeout=5)
        assert [s.name for s in roster] == ["b"]
        assert roster[0].tokens_per_s == 123.5 and roster[0].tokens_trained == 4096
    finally:
        dht.shutdown()
