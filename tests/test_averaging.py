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

SHAPES = [torch.Size([700, 1500]), torch.Size([37])]  # ~1M values
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _tensors(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _worker(index, initial_peers, codec, scale, results, die_after_parts):
    """One peer: fill the buffers with known tensors, average once, report (result, sha256, tensors)."""
    torch.set_num_threads(1)
    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht

    if die_after_parts is not None:  # fault injection: this peer's reducer dies after streaming N averaged parts
        original = averaging.CanonicalAllReduceRunner._accumulate_parts_streaming

        async def dying(self, stream, sender_index):
            sent = 0
            async for msg in original(self, stream, sender_index):
                if sent == die_after_parts:
                    os._exit(17)  # the averager process vanishes mid-stream, as on SIGKILL
                sent += 1
                yield msg

        averaging.CanonicalAllReduceRunner._accumulate_parts_streaming = dying

    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    cfg = AveragingConfig(codec=codec, matchmaking_time=8, request_timeout=3, allreduce_timeout=40,
                          next_chunk_timeout=5, part_size_bytes=2 ** 16)  # ~10 parts per reducer
    averager = averaging.Averager(dht, cfg, "test", SHAPES, expected_group_size=3)
    try:
        with averager.pseudo_grads() as buffers:
            for b, t in zip(buffers, _tensors(index, scale)):
                b.copy_(t)
        weight = 100 * (index + 1)
        result = averager.average(Contribution(f"p{index}", round=0, digest="d", tokens=weight), weight)
        with averager.pseudo_grads() as buffers:
            digest = hashlib.sha256(b"".join(b.numpy().tobytes() for b in buffers)).hexdigest()
            out = [b.numpy().copy() for b in buffers]  # numpy: no torch shared memory in the test
        results.put((index, result, digest, out))
    finally:
        averager.close()
        dht.shutdown()


def _run_group(codec: str, scale: float, die_after_parts=None, victim=2, timeout=120):
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    workers = []
    try:
        maddrs = visible_maddrs(boot)
        for i in range(3):
            fault = die_after_parts if i == victim else None
            workers.append(ctx.Process(target=_worker, args=(i, maddrs, codec, scale, results, fault)))
            workers[-1].start()
        expected = 3 if die_after_parts is None else 2
        out = {}
        while len(out) < expected:
            index, result, digest, tensors = results.get(timeout=timeout)
            out[index] = (result, digest, [torch.from_numpy(t) for t in tensors])
        return out
    finally:
        for w in workers:
            w.join(timeout=15)
            if w.is_alive():
                w.kill()
                w.join()
        boot.shutdown()


def _weighted_mean(scale: float) -> list[torch.Tensor]:
    weights = [100 * (i + 1) for i in range(3)]
    per_peer = [_tensors(i, scale) for i in range(3)]
    return [sum(w * t[j] for w, t in zip(weights, per_peer)) / sum(weights) for j in range(len(SHAPES))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("codec,scale,rtol", [("scaled_fp16", 1e-4, 2e-3), ("fp32", 1.0, 1e-6)])
def test_three_peers_get_identical_bytes_equal_to_weighted_mean(process_tag, codec, scale, rtol):
    out = _run_group(codec, scale)
    assert all(result.ok for result, _, _ in out.values()), [r.error for r, _, _ in out.values()]
    assert len({digest for _, digest, _ in out.values()}) == 1, "peers hold different bytes"
    expected = _weighted_mean(scale)
    for result, _, tensors in out.values():
        assert result.group_size == 3 and result.tokens == 600 and sorted(result.peers) == ["p0", "p1", "p2"]
        assert result.bytes_sent > 0 and result.bytes_received > 0
        for got, want in zip(tensors, expected):
            # scaled fp16 keeps ~11 significant bits of each value relative to the part's spread; small pseudo-
            # gradients (1e-4) must survive, which plain fp16 would flush towards zero
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())
    if codec == "scaled_fp16":
        payload = sum(s.numel() for s in SHAPES)
        sent = sum(result.bytes_sent for result, _, _ in out.values())
        # each peer sends 2(N-1)/N of the payload: 16 bits per value on the wire, plus a small header per part
        assert sent < 3 * 2 * (2 / 3) * payload * 2 * 1.05


@pytest.mark.timeout(180)
def test_reducer_killed_mid_stream_fails_the_round_on_every_survivor(process_tag):
    out = _run_group("scaled_fp16", 1e-3, die_after_parts=1, victim=2)
    assert set(out) == {0, 1}
    for result, _, _ in out.values():
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

    from p2p_diloco.net.dht import publish_status, read_roster, roster_key, start_dht

    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        me = PeerStatus(name="a", peer_id="id-a", round=3, digest="d", tokens_per_s=123.5, tokens_trained=4096)
        assert publish_status(dht, "run_x", me, ttl=30, timeout=5)
        future = dht.store(roster_key("run_x"), subkey="id-b", value={**asdict(me), "name": "b", "peer_id": "id-b",
                                                                        "from_the_future": [1, 2]},
                           expiration_time=get_dht_time() + 30, return_future=True)
        assert future.result(timeout=5)
        roster = sorted(read_roster(dht, "run_x", timeout=5), key=lambda s: s.name)
        assert [s.name for s in roster] == ["a", "b"]
        assert roster[0] == me and roster[1].tokens_per_s == 123.5 and roster[1].tokens_trained == 4096
    finally:
        dht.shutdown()
