"""Requests to a DHT node's process whose sender ended before they were read (net/dht.py ``_RequestsIn``): the
averager's process stores its records through the peer's DHT and is shut down right before it when a peer stops."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from p2p_diloco.net.dht import DHT
from p2p_diloco.ops.procs import join_or_kill

WAIT_TIMEOUT = 60.0  # hivemind's sleep after a request it could not read: far above what the test waits


def _store_and_vanish(dht: DHT) -> None:
    dht.store("key", b"value", expiration_time=2**31, return_future=True)  # sent: its future and pipe travel as fds
    os._exit(0)  # gone before the DHT's process reads it


@pytest.mark.timeout(60)
def test_a_request_from_a_process_that_has_ended_is_dropped_and_the_next_is_served_at_once():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=WAIT_TIMEOUT)
    try:
        os.kill(dht.pid, signal.SIGSTOP)  # the DHT's process reads nothing until the sender has ended
        try:
            sender = mp.get_context("fork").Process(target=_store_and_vanish, args=(dht,))
            sender.start()
            sender.join(30)
            assert sender.exitcode == 0
        finally:
            os.kill(dht.pid, signal.SIGCONT)
        # hivemind alone sleeps WAIT_TIMEOUT after the unreadable request, serving nothing (a peer's stop ran past
        # its 12 s); dropped, the next request is served at once
        assert dht.get("missing", latest=True, return_future=True).result(timeout=20) is None
        dht.shutdown()
        assert not dht.is_alive()
    finally:
        if dht.is_alive():
            join_or_kill([dht], 1)
