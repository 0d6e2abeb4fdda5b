"""A peer's helper processes (DHT, averager, p2pd) die with it, even when it is killed without a chance to clean up
(HIVEMIND.md, fact 3: otherwise they linger and keep advertising a dead peer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from p2p_diloco.ops.procs import group_members


def _start(args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "p2p_diloco", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


def _read_until(proc, marker: str) -> list[str]:
    lines = []
    for line in proc.stdout:  # blocking reads: returns as soon as the process prints the marker
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"process exited before printing {marker!r}:\n{''.join(lines)[-3000:]}")


@pytest.mark.timeout(120)
def test_sigkilled_peer_takes_its_dht_averager_and_p2pd_along(tmp_path, process_tag):
    boot = _start(["bootstrap", "--network.host_maddrs=/ip4/127.0.0.1/tcp/0",
                   f"--network.identity_path={tmp_path / 'boot.key'}"])
    peer = None
    try:
        maddr = [line.strip() for line in _read_until(boot, "join with") if line.strip().startswith("/ip4/")][0]
        peer = _start(["peer", "--initial-peers", maddr, "--network.host_maddrs=/ip4/127.0.0.1/tcp/0",
                       f"--run.run_dir={tmp_path / 'peer'}", "--run.progress=false", "--run.threads=1",
                       "--model.seq_len=32", "--inner.batch_size=2", "--data.eval_batches=1"])
        _read_until(peer, "joined run")
        helpers = [pid for pid in group_members(peer.pid) if pid != peer.pid]
        names = {open(f"/proc/{pid}/comm").read().strip() for pid in helpers}
        assert "p2pd" in names and len(helpers) >= 3, f"expected DHT, averager and p2pd processes, saw {names}"

        os.kill(peer.pid, signal.SIGKILL)  # no cleanup code runs in the peer
        peer.wait(timeout=10)
        deadline = time.monotonic() + 15
        while group_members(peer.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel delivers the parent-death signals asynchronously
        left = {pid: open(f"/proc/{pid}/comm").read().strip() for pid in group_members(peer.pid)}
        assert not left, f"helpers outlived their SIGKILLed peer: {left}"
    finally:
        for proc in (peer, boot):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


@pytest.mark.timeout(30)
def test_a_forked_helper_knows_its_parent_by_pid_not_by_being_adopted_by_pid_1():
    """In a container the peer is pid 1: "my parent is pid 1" must not read as "my parent died"."""
    from p2p_diloco.ops import procs

    parent = os.getpid()
    child = os.fork()
    if child == 0:  # the forked child: the pid recorded at fork is its live parent's
        ok = procs._forking_pid == parent and not procs.parent_died(procs._forking_pid) and procs.parent_died(-1)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not procs.parent_died(None)  # a process exec'd by another program (torchrun's workers): no check
