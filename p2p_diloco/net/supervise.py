"""The network stack under watch: a peer or a bootstrap node notices within seconds that a helper process it depends
on died or stopped answering, and restarts the stack or exits non-zero.

The helpers (HIVEMIND.md, "Processes"): the DHT process (hivemind forks it), the Go ``p2pd`` daemon that process
starts, and a peer's averager process (forked too, it talks to the same p2pd). Any of them can die alone: the OOM
killer, a crash of the daemon. Left alone, a peer whose p2pd died trains by itself forever ("could not find a
group" round after round), and one whose DHT process died hangs: every call into the DHT writes into a pipe nobody
reads (it blocks once the pipe is full) and waits for an answer that never comes.

* :class:`Watchdog`: a thread that checks every :data:`CHECK_EVERY_S` seconds that the processes exist (cheap: no
  message, ``/proc`` and ``waitpid``) and every :data:`PING_EVERY_S` seconds that the DHT process and its p2pd
  answer (one ``identify`` through the DHT's process). When one is gone it marks the stack down: every waiting DHT
  call fails at once (net/failfast.py), the averager is told (its waits end), and the peer's next check restarts
  the stack.
* :class:`Supervisor`: :meth:`~Supervisor.ensure` between rounds (one call at the top of the round loop) restarts
  the stack through the caller's ``restart`` function, logging one line that says what died and what it did, and
  raises :class:`NetworkLost` (exit code 3, one line) after :data:`MAX_FAILED_RESTARTS` failed restarts in a row.
  A restart counts as failed if it raised, or if the new stack died within :data:`STABLE_S` seconds without having
  served (a peer says so through :meth:`~Supervisor.served` when a round commits through it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Optional, Sequence

from p2p_diloco.errors import JoinError
from p2p_diloco.net.failfast import HelperDied  # noqa: F401 - re-exported: what a call on a dead helper raises

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 2.0  # liveness of the processes (reads /proc: microseconds)
PING_EVERY_S = 10.0  # responsiveness of the DHT process and its p2pd (one message each way)
PING_TIMEOUT_S = 15.0  # a ping unanswered this long is a miss (2 busy cores: the DHT process may lag seconds)
PING_MISSES = 2  # misses in a row before the stack counts as unresponsive
MAX_FAILED_RESTARTS = 5  # failed restarts in a row before the process gives up (exit code 3)
STABLE_S = 60.0  # a stack that dies sooner than this after its restart, having served nothing, is a failed restart


class NetworkLost(JoinError):
    """The network stack could not be restarted: the process exits with :attr:`exit_code` and one line, so that
    its supervisor (systemd's ``Restart=on-failure``, a container's restart policy) starts it again."""

    exit_code = 3


def exit_text(code: Optional[int]) -> str:
    return "exit status unknown" if code is None else f"exit {code}"


# ---------------------------------------------------------------------------------------------- the DHT's p2pd
class _DaemonInfo:
    """Runs in the DHT's process: the pid of its p2pd, whether it answers (an ``identify`` on its control socket)
    and the multiaddrs it listens on."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    async def __call__(self, _dht, node):
        p2p = node.p2p
        child = getattr(p2p, "_child", None)  # hivemind 1.1.12: the asyncio process of p2pd (None in a replica)
        pid, code = (child.pid, child.returncode) if child is not None else (None, None)
        try:
            _, maddrs = await asyncio.wait_for(p2p._client.identify(), self.timeout)
        except Exception:  # noqa: BLE001 - no answer: the caller decides what that means
            return pid, code, None
        return pid, code, [str(m) for m in maddrs]


def daemon_info(dht, timeout: float) -> tuple[Optional[int], Optional[int], Optional[list[str]]]:
    """(p2pd's pid, its exit code if it ended, its listen multiaddrs or None if it did not answer); raises
    TimeoutError or HelperDied if the DHT process does not answer within ``timeout`` + 5 seconds."""
    return dht.run_coroutine(_DaemonInfo(timeout), return_future=True).result(timeout=timeout + 5)


def process_running(pid: int, name: str) -> bool:
    """True if ``pid`` is a live (non-zombie) process called ``name``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    comm, state = text[text.find("(") + 1:text.rfind(")")], text[text.rfind(")") + 2:].split()[0]
    return comm == name and state not in ("Z", "X")


def pinned_maddrs(host_maddrs: Sequence[str], bound: Sequence[str]) -> list[str]:
    """``host_maddrs`` with each port 0 replaced by the port the node got for it (``bound``: the multiaddrs its
    p2pd listened on), so that a restarted node listens where others know it. A host maddr on 0.0.0.0 or :: takes
    the port of any bound address of the same transport (p2pd binds one port on every interface)."""
    pinned = []
    for maddr in host_maddrs:
        parts = maddr.split("/")
        if len(parts) >= 5 and parts[3] in ("tcp", "udp") and parts[4] == "0":
            for other in bound:
                theirs = other.split("/")
                if len(theirs) >= 5 and theirs[1] == parts[1] and theirs[3] == parts[3] and \
                        (parts[2] in ("0.0.0.0", "::") or theirs[2] == parts[2]):
                    parts[4] = theirs[4]
                    break
        pinned.append("/".join(parts))
    return pinned


# ---------------------------------------------------------------------------------------------- the watchdog
class Watch:
    """The helper processes of one network stack: the DHT process (a hivemind.DHT with :class:`FailFast`), its p2pd
    and optionally an averager process (hivemind's DecentralizedAverager, a multiprocessing.Process)."""

    def __init__(self, dht, averager=None, on_down: Callable[[str], None] = lambda reason: None):
        self.dht, self.averager, self.on_down = dht, averager, on_down
        self.p2pd: Optional[int] = None
        self.bound: list[str] = []  # the multiaddrs p2pd listens on (for a restart on the same ports)
        self.started = time.monotonic()
        try:
            self.p2pd, _, maddrs = daemon_info(dht, PING_TIMEOUT_S)
            self.bound = maddrs or []
        except Exception as e:  # noqa: BLE001 - found dead at the first check instead
            logger.debug(f"p2pd's pid unknown: {e!r}")

    def dead(self) -> Optional[tuple[str, str]]:
        """(helper, what happened) for a helper that is gone, or None. Cheap: no message to any process."""
        if self.dht.down is not None:
            return "dht", self.dht.down
        if not self.dht.is_alive():
            return "dht", f"the DHT process died ({exit_text(self.dht.exitcode)})"
        if self.p2pd is not None and not process_running(self.p2pd, "p2pd"):
            return "p2pd", f"p2pd of the DHT died ({exit_text(self._p2pd_exit())})"
        if self.averager is not None and not self.averager.is_alive():
            return "averager", f"the averager process died ({exit_text(self.averager.exitcode)})"
        return None

    def _p2pd_exit(self) -> Optional[int]:
        """How p2pd ended, asked of the DHT process once it has reaped it (within a second or two)."""
        for _ in range(4):
            try:
                code = daemon_info(self.dht, 1.0)[1]
            except Exception:  # noqa: BLE001 - the DHT process does not answer either: unknown
                return None
            if code is not None:
                return code
            time.sleep(0.5)  # its child watcher reaps p2pd on its own schedule: no event reaches us
        return None

    def ping(self):
        """Ask the DHT process and its p2pd for a sign of life; returns the future of :class:`_DaemonInfo`'s answer
        (its listen multiaddrs are None if p2pd did not answer within PING_TIMEOUT_S)."""
        return self.dht.run_coroutine(_DaemonInfo(PING_TIMEOUT_S), return_future=True)

    def mark_down(self, reason: str) -> None:
        """Everything that waits on this stack stops waiting: the averager (killed when the DHT or its p2pd is gone:
        it cannot work without them, and it holds a copy of the DHT's pipe) and every DHT call."""
        if self.averager is not None and self.averager.is_alive():
            self.averager.kill()
            self.averager.join(5)
        self.dht.mark_down(reason)
        self.on_down(reason)


class Watchdog(threading.Thread):
    """Checks a :class:`Watch` every CHECK_EVERY_S seconds and pings every PING_EVERY_S; marks it down once, then
    ends. :meth:`stop` ends it without marking anything (the stack is being shut down on purpose)."""

    def __init__(self, watch: Watch):
        super().__init__(name="network-watchdog", daemon=True)
        self.watch = watch
        self.found: Optional[tuple[str, str]] = None  # (helper, what happened)
        self._stopped = threading.Event()
        self._misses = 0
        self._ping, self._pinged = None, time.monotonic()  # the ping under way (a future), when it was sent

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(CHECK_EVERY_S):
            found = self.watch.dead() or self._silent()
            if found is not None and not self._stopped.is_set():
                self.found = found
                self.watch.mark_down(found[1])
                return

    def _silent(self) -> Optional[tuple[str, str]]:
        """Ping every PING_EVERY_S without waiting for the answer here (a dead process is found meanwhile);
        PING_MISSES unanswered in a row: the stack is unresponsive."""
        now = time.monotonic()
        if self._ping is None:
            if now - self._pinged >= PING_EVERY_S:
                self._ping, self._pinged = [], now
                # sent from a thread of its own: a send into a pipe that fills as its reader dies may block, and this
                # thread must stay free to find that death
                threading.Thread(target=lambda sent: sent.append(self.watch.ping()), args=(self._ping,),
                                 name="network-ping", daemon=True).start()
            return None
        if self._ping and self._ping[0].done():
            ping = self._ping[0]
            answered = ping.exception() is None and ping.result()[2] is not None
            self._misses, self._ping = 0 if answered else self._misses + 1, None
        elif now - self._pinged > PING_TIMEOUT_S + 5:
            self._misses, self._ping = self._misses + 1, None
        if self._misses < PING_MISSES:
            return None
        return "dht", f"the DHT process or its p2pd stopped answering ({PING_MISSES} pings of " \
                      f"{PING_TIMEOUT_S:.0f} s unanswered)"


# ---------------------------------------------------------------------------------------------- the supervisor
class Supervisor:
    """Watches one network stack and restarts it when a helper died. ``restart()`` builds a new stack and returns
    its :class:`Watch`; ``what`` names the stack in the log line ("the network stack", "the DHT node")."""

    def __init__(self, watch: Watch, restart: Callable[[], Watch], log: logging.Logger = logger,
                 what: str = "the network stack", then: str = "rejoining",
                 stop_event: Optional[threading.Event] = None):
        self.restart_stack, self.log, self.what, self.then = restart, log, what, then
        self.stop_event = stop_event or threading.Event()  # set: no more restarts (the process is stopping)
        self.restarts = 0  # in this process's life
        self.failed_in_a_row = 0
        self._watchdog: Optional[Watchdog] = None
        self._arm(watch)

    def _arm(self, watch: Watch) -> None:
        self.watch = watch
        self._served = False  # by this stack: a committed round through it proves its restart worked
        self._watchdog = Watchdog(watch)
        self._watchdog.start()

    @property
    def down(self) -> Optional[tuple[str, str]]:
        """(helper, what happened) if the stack is down now, else None (a direct check too: between rounds)."""
        found = self._watchdog.found if self._watchdog is not None else None
        if found is None:
            found = self.watch.dead()
            if found is not None:
                self._watchdog.stop()
                self.watch.mark_down(found[1])
        return found

    def ensure(self) -> bool:
        """Restart the stack if a helper is gone (until one start works, or MAX_FAILED_RESTARTS in a row failed:
        then NetworkLost). Returns True if it restarted."""
        found = self.down
        if found is None:
            return False
        helper, what = found
        if time.monotonic() - self.watch.started < STABLE_S and self.restarts and not self._served:
            self.failed_in_a_row += 1  # the last restart did not hold
        else:
            self.failed_in_a_row = 0
        while not self.stop_event.is_set():
            self._check_budget(what)
            if self.failed_in_a_row:  # 2, 4, 8, 16 s: the cause may pass (memory freed, a port released)
                self.stop_event.wait(min(2.0 ** self.failed_in_a_row, 30.0))
            self.restarts += 1
            _count_restart(helper)
            try:
                watch = self.restart_stack()
            except Exception as e:  # noqa: BLE001 - JoinError, HelperDied, OSError: any start that fails
                self.failed_in_a_row += 1
                self.log.warning(f"network: {what}; restarting {self.what} failed "
                                 f"({self.failed_in_a_row} of {MAX_FAILED_RESTARTS}): {_one_line(e)}")
                continue
            self.log.warning(f"network: {what}; restarted {self.what} ({self.failed_in_a_row + 1} of "
                             f"{MAX_FAILED_RESTARTS}), {self.then}")
            self._arm(watch)
            return True
        return False

    def served(self) -> None:
        """The stack did its work (a round committed through it): if it dies now, its restart still counts as one
        that worked, however soon (helpers dying seconds apart, a round committed in between each time, no longer
        add up to giving up)."""
        self._served = True

    def _check_budget(self, what: str) -> None:
        if self.failed_in_a_row >= MAX_FAILED_RESTARTS:
            raise NetworkLost(f"network: {what}; {self.what} failed {self.failed_in_a_row} restarts in a row: "
                              f"giving up (exit code {NetworkLost.exit_code})")

    def close(self) -> None:
        """Stop watching (the stack is being shut down on purpose)."""
        if self._watchdog is not None:
            self._watchdog.stop()


def _count_restart(helper: str) -> None:
    try:
        from p2p_diloco.ops.telemetry import count_restart
    except ImportError:  # prometheus_client missing: the supervisor's own counter still counts
        return
    count_restart(helper)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]
