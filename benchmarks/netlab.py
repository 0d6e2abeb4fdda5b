"""A private network for benchmarks: N network namespaces on one Linux bridge, links rate-limited with ``tc tbf``.

Namespace ``{tag}{i}`` holds interface ``eth0`` with address 10.78.{k}.{i+1}/24, joined to bridge ``{tag}br`` by a
veth pair. ``tag`` is random per lab (``pdb`` + 6 hex digits) and ``k`` is drawn at random, so labs of runs going on
at the same time on this machine never share a name, and a lab removes exactly the objects it created (on exit, on
SIGTERM and at interpreter exit), never another's. The bridge has no address in the root namespace and nothing routes
out: traffic stays between the namespaces. ``set_rate`` shapes both directions of every peer's link (its upload on
``eth0``, its download on the host end of its veth), so each peer has a full-duplex link of the given rate. Needs
root (``ip netns``).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
from typing import Optional



def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class NetLab:
    def __init__(self, n: int):
        self.n = n
        self.tag = tag = f"pdb{secrets.token_hex(3)}"  # interface names: at most 15 characters
        self.subnet = f"10.78.{secrets.randbelow(256)}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}{i}" for i in range(n)]

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def host_veth(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def __enter__(self) -> "NetLab":
        atexit.register(self.remove)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through __exit__, which removes the lab
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", self.host_veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "link", "set", self.host_veth(i), "master", self.bridge, "up")
                sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)  # removes its veth pair too
        sh("ip", "link", "del", self.bridge, check=False)

    def set_rate(self, mbit: Optional[float]) -> None:
        """Shape every link to ``mbit`` Mbit/s each way (None: unshaped)."""
        for i, ns in enumerate(self.namespaces):
            for prefix, dev in ((["ip", "netns", "exec", ns], "eth0"), ([], self.host_veth(i))):
                if mbit is None:
                    sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                    continue
                rate_bytes = mbit * 1e6 / 8
                burst = max(int(rate_bytes * 0.004), 64 * 1024)  # >= rate / HZ, so tbf can reach its rate
                sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                   "burst", str(burst), "latency", "100ms")

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]


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
