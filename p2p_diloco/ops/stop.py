"""Stopping on a signal: SIGTERM or SIGINT, sent to the process or to its whole process group, at any moment.

The first signal asks for a clean stop: the stop event is set, and the round loop finishes its step, announces that
it leaves, saves its checkpoint and shuts its helpers down (hivemind ``run_dht.py`` does the same). A peer still
looking for a group when the signal comes stops looking, unless a group holds it already (net/watches.py StopWatch). Before the command
is under way (a peer that is still starting: nothing of its own to save yet) the first signal aborts the start-up at
once instead, as KeyboardInterrupt. A second signal, or a stop still running ``STOP_GRACE_S`` after the first, ends
the process at once with exit code 128 + the signal's number (130 for SIGINT, 143 for SIGTERM): its helper processes
die with it (ops/procs.py: PR_SET_PDEATHSIG), and the checkpoint on disk is whole (ops/checkpoint.py writes it
atomically), the last one saved. The one exception to ``STOP_GRACE_S``: a checkpoint being written (``unhurried``)
is let finish, since a large model's may take longer; a second signal does not wait for it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

STOP_GRACE_S = 12.0
"""Longest clean stop, in seconds, before the process ends itself: inside the 15 s an operator (or systemd's, Docker's
or Kubernetes' grace period, 10 to 90 s) may give, with room for the helpers to die with it."""

CLOSE_S = STOP_GRACE_S - 2.0
"""What a peer's clean close plans to take at most: inside the grace, with room for the process's own end."""

logger = logging.getLogger("p2p_diloco")
_unhurried = threading.Condition()  # guards _writes: blocks under way that a stop's deadline lets finish
_writes: list[str] = []


def on_stop_signals(stop: threading.Event, started: Callable[[], bool] = lambda: True,
                    grace_s: float = STOP_GRACE_S) -> None:
    """Install the handler of SIGINT and SIGTERM for this process (call it from the main thread).

    ``started()``: False while the command is still starting, when the first signal raises KeyboardInterrupt in the
    main thread (the caller ends without a clean-up of work it has not begun)."""
    signals: list[int] = []

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if signals:
            logger.warning(f"got {name} again: exiting now")
            force_exit(128 + signum)
        signals.append(signum)
        logger.info(f"got {name}: stopping after the current step")
        # not stop.set() here: the handler runs in the main thread, which may hold the event's lock at that moment
        # (inside Event.wait, before it blocks), and set() would then wait for it forever. Another thread sets it
        # once the main thread has let the lock go (seen in CI: a bootstrap that logged SIGTERM and never stopped).
        threading.Thread(target=stop.set, name="stop-signal", daemon=True).start()
        threading.Thread(target=_deadline, args=(name, 128 + signum, grace_s), name="stop-deadline",
                         daemon=True).start()
        if not started():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _deadline(name: str, code: int, grace_s: float) -> None:
    """Runs beside a clean stop: the process is still there ``grace_s`` seconds after the signal, so a wait in the
    stop is stuck (a helper that died under a call, a peer that stopped answering): end it now."""
    threading.Event().wait(grace_s)
    with _unhurried:
        if _writes:
            logger.warning(f"the stop asked by {name} waits for {_writes[0]} to finish")
            _unhurried.wait_for(lambda: not _writes)
        logger.warning(f"the stop asked by {name} did not end within {grace_s:.0f} s: exiting now")
        force_exit(code)


def grace_left(started: float, part: float, most: float) -> float:
    """A helper's graceful shutdown time in a close begun at ``started`` (time.monotonic()): ``part`` of what is
    left of :data:`CLOSE_S`, at most ``most`` (its own default), at least 0.5 s."""
    return max(0.5, min(most, part * (CLOSE_S - (time.monotonic() - started))))


@contextmanager
def unhurried(what: str) -> Iterator[None]:
    """A block that a stop's deadline lets finish before it ends the process (writing a checkpoint: cut short, the
    write would leave the previous checkpoint, losing the rounds since)."""
    with _unhurried:
        _writes.append(what)
    try:
        yield
    finally:
        with _unhurried:
            _writes.remove(what)
            _unhurried.notify_all()


def force_exit(code: int) -> None:
    """End this process now, from any thread, without the interpreter's teardown or waiting for anything.

    Kept: multiprocessing's temporary folder (``pymp-*``, where torch passes shared tensors to the averager's
    process) is removed, as a normal exit would. Our helper processes die with us (ops/procs.py)."""
    tempdir = multiprocessing.current_process()._config.get("tempdir")  # the folder util.get_temp_dir() made
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):  # not logging.shutdown(): its locks may be held by the stuck thread
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or a write of this thread interrupted by the signal
            pass
    os._exit(code)
