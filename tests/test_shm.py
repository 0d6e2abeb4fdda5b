"""Shared memory left behind by state transfers and network-stack restarts (issue 28, item 7; benchmarks/soak.md):
with real processes on loopback, a donor's /dev/shm descriptors do not grow with the state transfers it serves, a
joiner keeps none of the state it downloaded, and an averager started after another was closed (a restart) does not
inherit the old one's buffers."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

import pytest
import torch

from p2p_diloco.config import AveragingConfig, ModelConfig, NetworkConfig
from p2p_diloco.ops.procs import join_or_kill

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _shapes() -> list[torch.Size]:
    from p2p_diloco.train.model import build_model

    return [p.shape for p in build_model(ModelConfig(name="tiny"), vocab_size=256, seed=0).parameters()]


def _state(shapes) -> list[torch.Tensor]:
    """θ_global and a momentum: two tensors per parameter, as a peer serves (known values)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in shapes] * 2


MPFUTURE_CHUNK = 16  # bytes: hivemind's MPFuture states share one chunk of this size per 16 futures (SharedBytes)


def _shm_fds(pid: int) -> int:
    """Descriptors of ``pid`` open on torch's shared-memory files (/dev/shm/torch_*) larger than hivemind's
    MPFuture chunks: tensors (the smallest parameter here has 128 floats). A chunk is allocated every 16 futures and
    freed when they are, so whether a process holds one more at a given moment, and a helper forked then inherits
    it, depends on how many calls were made before: not what these tests count."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            count += "torch_" in os.readlink(path) and os.stat(path).st_size > MPFUTURE_CHUNK
        except OSError:  # closed meanwhile
            pass
    return count


def _with_children(pid: int) -> list[int]:
    pids = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                pids += _with_children(int(child))
    return pids


def _donor(maddrs, shapes, replies, requests):
    """A peer serving its state; answers each request with its descriptors: (main process's shm, all its
    processes' shm, all of the main process's)."""
    torch.set_num_threads(1)
    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht

    dht = start_dht(NetworkConfig(initial_peers=maddrs, host_maddrs=LOOPBACK))
    averager = averaging.Averager(dht, AveragingConfig(), "shm", shapes, expected_group_size=2)
    state = _state(shapes)
    averager.serve_state(lambda: ({"round": 3}, [t.clone() for t in state]), 3)
    replies.put(averager.peer_id)
    try:
        while requests.get() == "count":
            me = os.getpid()
            replies.put((_shm_fds(me), sum(map(_shm_fds, _with_children(me))), len(os.listdir(f"/proc/{me}/fd"))))
    finally:
        averager.close()
        dht.shutdown()


@pytest.mark.timeout(300)
def test_state_transfers_leave_no_shared_memory_on_donor_or_joiner(process_tag):
    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    torch.set_num_threads(1)
    shapes = _shapes()
    ctx = mp.get_context("fork")
    replies, requests = ctx.Queue(), ctx.Queue()
    dht = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    donor = ctx.Process(target=_donor, args=(visible_maddrs(dht), shapes, replies, requests))
    donor.start()
    joiner = None
    try:
        donor_id = replies.get(timeout=120)
        joiner = averaging.Averager(dht, AveragingConfig(), "shm", shapes, expected_group_size=2)

        def counts():
            requests.put("count")
            return replies.get(timeout=60), _shm_fds(os.getpid())

        (donor_main, donor_all, _), joiner_before = counts()
        assert donor_main > 0  # the averaging buffers: the count sees torch's shared memory
        seen = []
        for _ in range(3):
            got = joiner.download_state([donor_id])
            assert got is not None, "the state download failed"
            metadata, tensors, donor_peer = got
            assert metadata == {"round": 3} and donor_peer == donor_id
            assert all(torch.equal(a, b) for a, b in zip(tensors, _state(shapes), strict=True))
            del got, tensors
            seen.append(counts())
        # before: the donor's main process kept each served snapshot (2 model copies) in /dev/shm, its averager
        # process a copy too, and the joiner the last state it downloaded
        assert [(d[0], d[1], j) for d, j in seen] == [(donor_main, donor_all, joiner_before)] * 3
        assert seen[2][0][2] == seen[0][0][2]  # nor any other descriptor, after the first transfer
    finally:
        requests.put("stop")
        join_or_kill([donor], timeout=30)
        if joiner is not None:
            joiner.close()
        dht.shutdown()


@pytest.mark.timeout(180)
def test_an_averager_started_after_a_released_one_does_not_inherit_its_buffers(process_tag):
    """What a network-stack restart does (net/joining.py rejoin): close and release the old averager, then fork the
    new one. Before the release, every restart's new helpers held one more model copy of /dev/shm for good."""
    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht

    torch.set_num_threads(1)
    shapes = _shapes()
    dht = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    made = []
    try:
        for _ in range(3):
            gc.collect()  # what earlier tests of this process left in reference cycles: the same count each time
            before = _shm_fds(os.getpid())
            made.append(averaging.Averager(dht, AveragingConfig(error_feedback=True), "shm", shapes))
            in_child = _shm_fds(made[-1]._averager.pid)
            assert in_child >= 2 * len(shapes)  # its buffers and error feedback's, shared with this process
            made[-1].close()
            made[-1].release()
            assert _shm_fds(os.getpid()) == before  # released here
            made[-1] = in_child
        assert made[1] == made[0] and made[2] == made[0]
    finally:
        for averager in made:
            if not isinstance(averager, int):
                averager.close()
        dht.shutdown()


def _fds(pid: int) -> int:
    """Descriptors of ``pid``, without hivemind's 16-byte MPFuture chunks (see :func:`_shm_fds`)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            count += not ("torch_" in os.readlink(path) and os.stat(path).st_size <= MPFUTURE_CHUNK)
        except OSError:  # closed meanwhile
            pass
    return count


@pytest.mark.timeout(240)
def test_helpers_that_died_leave_no_descriptor_or_thread_in_the_host(process_tag):
    """A network-stack restart after its helpers died (net/joining.py rejoin), three times in this process: a DHT
    and an averager on it, both SIGKILLed, then what rejoin does before it forks the next stack. Their command pipes,
    sentinel pipes and the host thread reading the averager's pipe are closed, not left to reference cycles (before:
    8 descriptors and a thread per restart, inherited by every helper forked after; benchmarks/soak.md), and the
    next stack starts whatever lock of hivemind's a killed helper held (fresh_shared_locks: before, a new DHT could
    block for good answering its first future). The first restart allocates what a process keeps for good
    (hivemind's future pipe, multiprocessing's shared heap): the later ones return exactly to their start."""
    import signal
    import threading

    from p2p_diloco.net import averaging
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.failfast import close_host_side, fresh_shared_locks

    torch.set_num_threads(1)
    shapes = _shapes()
    seen = []
    for i in range(3):
        gc.collect()
        before = (_fds(os.getpid()), threading.active_count())
        dht = start_dht(NetworkConfig(host_maddrs=LOOPBACK))  # fails here if a killed helper held a lock
        averager = averaging.Averager(dht, AveragingConfig(), f"fds{i}", shapes)
        for pid in (averager._averager.pid, dht.pid):
            os.kill(pid, signal.SIGKILL)
        dht.join(10)
        dht.mark_down("killed by the test")  # as the watchdog does: it starts draining the dead node's pipe
        averager.abandon("killed by the test")
        averager.close()
        averager.release()  # closes the averager's host side
        close_host_side(dht)
        fresh_shared_locks()
        seen.append((before, (_fds(os.getpid()), threading.active_count()), dht.exitcode))
    assert seen[1][1] == seen[1][0] and seen[2][1] == seen[2][0], seen
    assert all(code == -signal.SIGKILL for _, _, code in seen), seen
