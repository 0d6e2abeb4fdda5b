"""Process hygiene: children that die with their parent, and whole process groups ended by PID.

hivemind forks a DHT process and an averager process per peer, and the DHT process starts a Go ``p2pd``. Killing
only a peer's main process leaves all three running (HIVEMIND.md, fact 3). We ask the kernel to SIGKILL each of them
when its parent dies (``PR_SET_PDEATHSIG``), and launchers start every peer in its own process group.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import time
from typing import Optional

_PR_SET_PDEATHSIG = 1

_forking_pid: Optional[int] = None
"""In a forked child: the pid of the process that forked it (recorded just before every fork, see below)."""


def _remember_forking_process() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


# runs in the parent right before os.fork(), multiprocessing's fork and subprocess's fork with a preexec_fn, so the
# child's copy of _forking_pid names its parent. Why not "the parent is pid 1, so it died": in a container the
# peer itself is pid 1, and its helpers would kill themselves at start.
os.register_at_fork(before=_remember_forking_process)


def become_child_process() -> None:
    """First call in a forked helper process (DHT, averager): die with the parent, and leave stop signals to it.

    SIGTERM and SIGINT are ignored here: a supervisor that signals the peer's whole process group (systemd's
    default KillMode, Ctrl+C in a terminal, ``kill -- -PGID``) must not take the helpers away while the peer still
    needs them to finish its step, announce that it leaves and save. The peer shuts them down itself, and the kernel
    SIGKILLs them when it exits (PR_SET_PDEATHSIG); hivemind's fallback ``terminate()`` is a SIGKILL in our
    subclasses (:func:`end_hard`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid=_forking_pid)


def end_hard(process) -> None:
    """``multiprocessing.Process.terminate`` for our helpers: SIGKILL, since they ignore SIGTERM (see above)."""
    process.kill()


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: Optional[int] = None) -> None:
    """Make the kernel send ``sig`` to this process when the thread that forked it exits (Linux only). With
    ``parent_pid`` (the forking process), also when that parent is already gone, between fork and this call."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if parent_died(parent_pid):
        os.kill(os.getpid(), sig)


def parent_died(parent_pid: Optional[int]) -> bool:
    """True if this process's parent is no longer ``parent_pid`` (it was re-parented); False if unknown (None)."""
    return parent_pid is not None and os.getppid() != parent_pid


def subprocesses_die_with_us() -> None:
    """Make every subprocess later started by asyncio in this process die with it (used for p2pd)."""
    original = asyncio.subprocess.create_subprocess_exec
    if getattr(original, "_dies_with_parent", False):
        return

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", lambda: die_with_parent(parent_pid=_forking_pid))
        return await original(*args, **kwargs)

    create_subprocess_exec._dies_with_parent = True
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def stop_groups(pids: list[int], grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to each process-group leader in ``pids`` (each shuts its own children down), then SIGKILL
    whatever is left of those groups once none is alive or ``grace_s`` seconds have passed."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_alive(pid) for pid in pids):
        time.sleep(0.05)  # no event exists for "another session's process exited": poll /proc briefly
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def join_or_kill(processes, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for each multiprocessing process to end; kill those still running."""
    for process in processes:
        process.join(timeout=timeout)
        if process.is_alive():
            process.kill()
            process.join()


def group_alive(pgid: int) -> bool:
    """True if any process (zombies excluded) still belongs to process group ``pgid``."""
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes whose process group is ``pgid``, read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read_stat(int(entry))
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            members.append(int(entry))
    return members


def _read_stat(pid: int) -> Optional[tuple[str, int]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces: split after the last ')'
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[2])  # state, pgrp
