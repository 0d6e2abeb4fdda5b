"""Calls into a dead helper process fail at once, and nothing that waits on one waits forever (net/supervise.py
finds the death; this module makes every caller hear of it).

hivemind talks to its DHT process and its averager process through pipes: a call writes a command, with an MPFuture
for the answer, and waits on that future, in most calls without a deadline. Once the process is dead nobody reads
the pipe (a write blocks as soon as it is full) and nobody answers the future. :class:`GuardedPipe` stands in for the
host side of such a pipe: a command for a helper known dead is refused at once (its futures fail with
:class:`HelperDied`), and :meth:`GuardedPipe.fail_all` fails every future still waiting. :class:`FailFast` gives
hivemind.DHT that pipe, waits for its answers in slices, and drains the pipe of a dead node so that a writer blocked
on it goes on.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import weakref
from typing import Optional

CHECK_EVERY_S = 2.0  # how often a call waiting for a DHT answer looks whether the node died meanwhile


class HelperDied(RuntimeError):
    """A helper process of the network stack is gone: the call that needed it gets this at once."""


class GuardedPipe:
    """The host side of a hivemind helper's command pipe (the DHT's, the averager's): a call on a helper known dead
    fails at once, and every call waiting for an answer (an MPFuture sent with it) fails as soon as the helper is
    marked down (:meth:`fail_all`), whatever it waits with. ``owner.down_reason()`` says whether it is down."""

    def __init__(self, pipe, owner):
        self._pipe, self._owner = pipe, owner
        self._waiting: weakref.WeakSet = weakref.WeakSet()

    def send(self, message) -> None:
        futures = _futures(message)
        reason = self._owner.down_reason()
        if reason is not None:
            self._refuse(futures, reason)
            return
        self._waiting.update(futures)
        try:
            self._pipe.send(message)
        except (OSError, ValueError) as e:  # the pipe was closed under us (the helper was marked down)
            self._refuse(futures, self._owner.down_reason() or f"a helper process takes no calls ({e!r})")

    @staticmethod
    def _refuse(futures: list, reason: str) -> None:
        for future in futures:  # a command that waits for nothing (a setting, a shutdown) is dropped
            _fail(future, reason)

    def fail_all(self, reason: str) -> None:
        for future in list(self._waiting):
            _fail(future, reason)

    def __getattr__(self, name):
        return getattr(self._pipe, name)


def _futures(message) -> list:
    """The futures a hivemind command carries: ``(method, args, kwargs)`` with MPFutures among the kwargs."""
    if not (isinstance(message, tuple) and len(message) == 3 and isinstance(message[2], dict)):
        return []
    return [v for v in message[2].values() if hasattr(v, "set_exception") and hasattr(v, "done")]


def _fail(future, reason: str) -> None:
    if not future.done():
        try:
            future.set_exception(HelperDied(reason))
        except Exception:  # noqa: BLE001 - it was answered meanwhile
            pass


class FailFast:
    """Mixin for hivemind.DHT (net/dht.py): calls from the host process fail at once with :class:`HelperDied` once
    :meth:`mark_down` was called or the DHT process is gone, instead of blocking on a pipe nobody reads."""

    down: Optional[str] = None

    def __init__(self, *args, **kwargs):
        quiet_tracebacks()  # before the DHT process (and later the averager) is forked: they inherit it
        super().__init__(*args, **kwargs)
        self._outer_pipe = GuardedPipe(self._outer_pipe, self)

    # hivemind's calls without return_future wait for their answer with no deadline: here in slices, so that a
    # node found dead ends the wait (start-up calls too, before any watchdog runs)
    def run_coroutine(self, coro, return_future: bool = False):
        future = super().run_coroutine(coro, return_future=True)
        return future if return_future else self._answer(future)

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        future = super().get(key, latest=latest, return_future=True, **kwargs)
        return future if return_future else self._answer(future)

    def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **kwargs):
        future = super().store(key, value, expiration_time, subkey=subkey, return_future=True, **kwargs)
        return future if return_future else self._answer(future)

    def _answer(self, future):
        while True:
            try:
                return future.result(timeout=CHECK_EVERY_S)
            except TimeoutError:
                if future.done():  # the call itself timed out
                    raise
                reason = self.down_reason()
                if reason is not None:
                    raise HelperDied(reason) from None

    async def _run_coroutine(self, coro, future) -> None:
        """In the DHT's process: hivemind's, except for a future the host already failed (:meth:`mark_down`, its
        p2pd died while the coroutine ran). hivemind sets it anyway, which raises InvalidStateError twice, and
        asyncio logs the task's error as "Task exception was never retrieved" (test_supervise, CI)."""
        from concurrent.futures import InvalidStateError

        try:
            result = await coro(self, self._node)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as hivemind does
            if not future.done():  # as hivemind logs it
                logging.getLogger("hivemind.dht.dht").exception("Caught an exception when running a coroutine:")
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(e)
            return
        with contextlib.suppress(InvalidStateError):  # the host gave up on it meanwhile: nobody waits for it
            future.set_result(result)

    def down_reason(self) -> Optional[str]:
        if self.down is not None:
            return self.down
        if os.getpid() == self._parent_pid and self._popen is not None and self._popen.poll() is not None:
            return f"the DHT process died (exit {self.exitcode})"
        return None

    def shutdown(self) -> None:
        """hivemind's graceful shutdown, or a SIGKILL to a process whose node is down (it could only time out)."""
        if self.down is not None and os.getpid() == self._parent_pid and self.is_alive():
            self.kill()
            self.join(5)
            return
        super().shutdown()

    def mark_down(self, reason: str) -> None:
        """Fail every call now and later; when the DHT process is dead, also stop any writer blocked on its pipe."""
        self.down = self.down or reason
        pipe = self._outer_pipe
        if isinstance(pipe, GuardedPipe):
            pipe.fail_all(self.down)
        if os.getpid() == self._parent_pid and not self.is_alive():
            # a writer blocked on the full pipe (nobody reads it now) goes on once the pipe is emptied: read it here
            threading.Thread(target=_drain, args=(self._inner_pipe,), name="dht-pipe-drain", daemon=True).start()


def close_host_side(helper, join_s: float = 1.0) -> None:
    """Once a hivemind helper process (the DHT's, the averager's) has ended, in the process that started it: close
    the host's ends of its command pipe and its sentinel pipe, after the host threads that read that pipe (the
    averager's state fetcher, our drain) have ended. Left to the garbage collector, they outlive a network-stack
    restart (the old objects sit in reference cycles), and the helpers forked for the new stack inherit them for good:
    +9 descriptors per restart in the soak (benchmarks/soak.md)."""
    if os.getpid() != getattr(helper, "_parent_pid", None):
        return
    helper.join(join_s)  # hivemind's shutdown() may end with a SIGTERM it does not wait for
    if helper.is_alive():
        return
    outer, inner = _raw(getattr(helper, "_outer_pipe", None)), _raw(getattr(helper, "_inner_pipe", None))
    fetchers = _readers_of(outer)  # the averager's state fetcher, told to stop as hivemind's own shutdown does
    if fetchers and inner is not None:
        with contextlib.suppress(OSError, ValueError):
            inner.send(("_SHUTDOWN", None))
    if _joined(fetchers, join_s) and outer is not None:
        outer.close()  # the DHT's write end: our drain of its read end (mark_down) now reads EOF and ends
    if _joined(_readers_of(inner), join_s) and inner is not None:
        inner.close()  # never under a thread still reading it
    popen = getattr(helper, "_popen", None)
    if popen is not None:  # multiprocessing's sentinel pipe, two descriptors (the exit code is known: is_alive,
        popen.close()      # join and exitcode still answer, unlike after Process.close())


def fresh_shared_locks() -> None:
    """Before the helpers of a new network stack are forked, once the old ones are gone: new process-shared locks
    for hivemind's futures. MPFuture guards the pipe its futures report through (and SharedBytes the allocation of
    their shared state) with ``mp.Lock``s created once in the main process and inherited by every helper it forks.
    A helper killed while it held one (SIGKILL, the OOM killer) leaves it held for good, and every helper forked
    later blocks on it the first time it answers a future: a new DHT process never became ready ("could not join the
    swarm within 30 s" with no initial peers, in CI after a test killed helpers). hivemind's own last resort,
    ``MPFuture.reset_backend``, replaces the same three locks and also the backend's pipe and thread, which the old
    futures would keep open; only the locks are needed here."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock = mp.Lock(), mp.Lock(), mp.Lock()


def drop_unclaimed_descriptors(timeout_s: float = 1.0) -> None:
    """Once the helpers of a stack have ended, before the next ones start: close the descriptors no process will now
    claim. A future sent to a helper (in every DHT and averager command) carries its shared state as a descriptor,
    which multiprocessing passes through the sender's resource sharer: the sender keeps a duplicate until the
    receiver asks for it. A helper killed before it read the command never asks, and the duplicate stayed open in
    this process for good (one hivemind future chunk of /dev/shm per command in flight). The sharer starts again at
    its next use."""
    from multiprocessing import resource_sharer

    resource_sharer.stop(timeout=timeout_s)


def _raw(pipe):
    return pipe._pipe if isinstance(pipe, GuardedPipe) else pipe


def _joined(threads: list[threading.Thread], timeout: float) -> bool:
    for thread in threads:
        thread.join(timeout)
    return not any(t.is_alive() for t in threads)


def _readers_of(pipe) -> list[threading.Thread]:
    """Threads of this process whose target was started with ``pipe`` among its arguments (Thread keeps them in
    ``_args`` while it runs)."""
    if pipe is None:
        return []
    return [t for t in threading.enumerate()
            if t is not threading.current_thread() and any(a is pipe for a in getattr(t, "_args", ()) or ())]


def _drain(pipe, quiet_s: float = 10.0) -> None:
    """Read and drop what is written into a dead helper's pipe until nothing came for ``quiet_s`` s; then close it."""
    try:
        while pipe.poll(quiet_s):
            pipe.recv_bytes()
    except (OSError, EOFError):
        pass
    try:
        pipe.close()
    except OSError:
        pass


# hivemind logs an ordinary failed round ("could not find a group") and a pipe closed as its process ends with a full
# traceback; our own WARN line already says what happened. These loggers keep their one line, without the traceback,
# unless hivemind logs at DEBUG level.
QUIET_LOGGERS = ("hivemind.averaging.averager", "hivemind.dht.dht")


class _OneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not logging.getLogger("hivemind").isEnabledFor(logging.DEBUG):
            error = record.exc_info[1]
            if error is not None and type(error).__name__ not in record.getMessage():
                record.msg, record.args = f"{record.getMessage()} ({type(error).__name__})", None
            record.exc_info, record.exc_text = None, None
        return True


def quiet_tracebacks() -> None:
    for name in QUIET_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _OneLine) for f in target.filters):
            target.addFilter(_OneLine())
