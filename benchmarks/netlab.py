"""Network namespaces for benchmarks: the emulated internet of ``p2p_diloco/ops/netlab.py`` (public hosts on one
bridge, home hosts behind NAT routers, links shaped with ``tc tbf``; every lab has its own random tag, lives
entirely in its own namespaces and removes them on exit), plus the JSON-lines workers the benchmark scripts run in
those namespaces. Needs root (``ip netns``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from p2p_diloco.ops.netlab import Internet, NetLab, unavailable_reason  # noqa: F401  (re-exported for the scripts)


def link_bytes(dev: str = "eth0") -> tuple[int, int]:
    """(tx, rx) bytes of ``dev`` in the calling process's network namespace, headers included."""
    base = f"/sys/class/net/{dev}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


class Worker:
    """A process in a namespace speaking JSON lines: commands on its stdin, one answer per line on its stdout.

    It runs in a session of its own, so ``close`` ends it and everything it started (DHT, averagers, p2pd) by PID.
    """

    def __init__(self, cmd: list[str], log_path: str):
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, start_new_session=True)

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited (rc {self.proc.poll()}); see {self._log.name}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(timeout=30)
            except Exception:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def answer_commands(handlers: dict, out) -> None:
    """Worker side of :class:`Worker`: run ``handlers[cmd](**args)`` for each command line until ``quit``."""
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        if name == "quit":
            return
        out.write(json.dumps(handlers[name](**command)) + "\n")
        out.flush()
