"""One θ_global per round, in real averager processes: groups of one round that each hold at most half of the run
do not commit (net/consensus.py has_quorum); each pair would otherwise have committed its own bytes."""

import hashlib
import multiprocessing as mp

import pytest
import torch

from p2p_diloco.config import AveragingConfig, NetworkConfig
from p2p_diloco.net.averaging import Contribution
from p2p_diloco.ops.procs import join_or_kill

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SHAPES = [torch.Size([64, 32]), torch.Size([500])]
PEERS = 4


def _worker(index, initial_peers, electorate, results):
    """One peer in groups of two (hivemind's own matchmaking, every peer declaring): average once, report
    (index, ok, error, sha256 of the buffers)."""
    torch.set_num_threads(1)
    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht

    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    try:
        cfg = AveragingConfig(matchmaking_time=6, request_timeout=2, allreduce_timeout=30, next_chunk_timeout=5)
        averager = averaging.Averager(dht, cfg, "quorum", SHAPES, expected_group_size=2)
        try:
            with averager.pseudo_grads() as buffers:
                for b in buffers:
                    b.fill_(float(index + 1))  # every pair averages to other bytes
            result = averager.average(Contribution(f"p{index}", round=0, digest="d", tokens=10,
                                                   electorate=electorate), 10)
            with averager.pseudo_grads() as buffers:
                digest = hashlib.sha256(b"".join(b.numpy().tobytes() for b in buffers)).hexdigest()
            results.put((index, result.ok, result.error or "", result.group_size, digest))
        finally:
            averager.close()
    finally:
        dht.shutdown()


def _run(electorate: int) -> list[tuple]:
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    workers = []
    try:
        maddrs = visible_maddrs(boot)
        for i in range(PEERS):
            workers.append(ctx.Process(target=_worker, args=(i, maddrs, electorate, results)))
            workers[-1].start()
        return sorted(results.get(timeout=90) for _ in range(PEERS))
    finally:
        join_or_kill(workers, timeout=15)
        boot.shutdown()


@pytest.mark.timeout(150)
def test_two_groups_of_one_round_cannot_both_commit(process_tag):
    """Four peers of a run that each see all four (electorate 4) are split by matchmaking into groups of at most
    two: no group holds more than half, so none commits, and every peer that was in a group says why."""
    out = _run(electorate=4)
    assert not any(ok for _, ok, _, _, _ in out), out
    grouped = [error for _, _, error, _, _ in out if "could not find a group" not in error]
    assert grouped, f"no group formed at all: {out}"
    assert all("no quorum" in error for error in grouped), out
