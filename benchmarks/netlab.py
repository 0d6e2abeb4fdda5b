"""An emulated internet in Linux network namespaces, for tests and benchmarks: public hosts, and home hosts each
behind its own NAT router, with shaped (optionally asymmetric) links. Needs root, ``ip`` and ``tc``; homes need
``nft`` (nftables). Also the JSON-lines workers the benchmark scripts run in those namespaces (:class:`Worker`).

A test and benchmark tool, not part of the installed package: the scripts here import it as ``netlab``, the tests
after putting benchmarks/ on ``sys.path``.

One lab, all of it inside namespaces whose names carry the lab's random tag (``nl<tag>-...``):

  ``nl<tag>-net``       the "internet": a bridge ``sw`` with one port per public interface; no address of its own
  ``nl<tag>-<name>``    a public host: ``eth0`` = PUBLIC.x on the bridge
  ``nl<tag>-<name>-r``  a home router: ``wan`` = PUBLIC.x on the bridge, ``lan`` = 192.168.1.1; nftables masquerades
                        what leaves ``wan`` and drops every connection that starts from the internet side (a stock
                        home router: no port forwarding, no UPnP)
  ``nl<tag>-<name>``    a home host: ``eth0`` = 192.168.1.2 behind its router (every home uses the same private
                        range, as real ones do)

Nothing is created in the root namespace (veth pairs are made directly between lab namespaces) and nothing routes
out of the lab, so two labs never see each other and the machine's own network is never touched; the lab removes
exactly the namespaces it created, on exit, on SIGTERM/SIGHUP and at interpreter exit.

Why PUBLIC is 192.0.0.64/26 and not 10.x: libp2p (go-multiaddr's ``manet.IsPublicAddr``) ignores private and
reserved ranges for everything NAT-related (AutoNAT dial-backs, relay addresses, hole punching), so an emulated
internet must use addresses it considers public. 192.0.0.0/24 is IANA's "IETF protocol assignments" block, never
routed on the internet; go-multiaddr 0.12 (in hivemind 1.1.12's p2pd) lists only its first /26 as unroutable.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional

PUBLIC_PREFIX = "192.0.0"   # hosts .100 upwards, home routers' WAN .200 upwards (see the module docstring)
LAN_PREFIX = "192.168.1"    # every home's private network: router .1, host .2
NFT_RULES = """
table ip nat {
  chain postrouting { type nat hook postrouting priority srcnat; oifname "wan" masquerade; }
}
table inet filter {
  chain input { type filter hook input priority filter; policy accept; iifname "wan" ct state new drop; }
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept;
    iifname "lan" oifname "wan" accept;
  }
}
"""


def sh(*args: str, check: bool = True, input: Optional[str] = None) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable_reason(nat: bool = True) -> Optional[str]:
    """Why a lab cannot be built here (None if it can): not root, no ``ip``/``tc``/``nft``, or namespaces refused."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") + (("nft",) if nat else ()) if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2{' nftables' if 'nft' in missing else ''})"
    probe = f"nl{secrets.token_hex(3)}-probe"
    out = sh("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"cannot create network namespaces: {out.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    namespace: str
    address: str                  # the address others use: its own (public) or its router's (home)
    router: Optional[str] = None  # the router's namespace (home hosts)
    local_address: str = ""       # the address on its own eth0

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the host."""
        return ["ip", "netns", "exec", self.namespace]


class Internet:
    """Public hosts and NATed home hosts on one emulated internet. Use as a context manager."""

    def __init__(self, tag: Optional[str] = None):
        self.tag = tag or secrets.token_hex(3)
        self.net = f"nl{self.tag}-net"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._ports = 0
        self._port_of: dict[str, str] = {}  # namespace -> its port on the bridge
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, object] = {}

    # ---------------------------------------------------------------------------------------------- building
    def __enter__(self) -> "Internet":
        atexit.register(self.remove)
        self._catch_signals()
        try:
            self._add_namespace(self.net)
            self._ip(self.net, "link", "add", "sw", "type", "bridge")
            self._ip(self.net, "link", "set", "sw", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def add_public(self, name: str) -> Host:
        """A host with a public address on the internet."""
        address = f"{PUBLIC_PREFIX}.{100 + len([h for h in self.hosts.values() if h.router is None])}"
        ns = self._new_host_namespace(name)
        self._plug(ns, "eth0", address)
        host = Host(name, ns, address, local_address=address)
        self.hosts[name] = host
        return host

    def add_home(self, name: str) -> Host:
        """A host behind its own NAT router (masquerade, no inbound connections)."""
        wan = f"{PUBLIC_PREFIX}.{200 + len([h for h in self.hosts.values() if h.router is not None])}"
        ns = self._new_host_namespace(name)
        router = f"{ns}-r"
        self._add_namespace(router)
        self._plug(router, "wan", wan)
        self._ip(router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._ip(router, "addr", "add", f"{LAN_PREFIX}.1/24", "dev", "lan")
        self._ip(router, "link", "set", "lan", "up")
        self._ip(ns, "addr", "add", f"{LAN_PREFIX}.2/24", "dev", "eth0")
        self._ip(ns, "link", "set", "eth0", "up")
        self._ip(ns, "route", "add", "default", "via", f"{LAN_PREFIX}.1")
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", router, "nft", "-f", "-", input=NFT_RULES)
        host = Host(name, ns, wan, router=router, local_address=f"{LAN_PREFIX}.2")
        self.hosts[name] = host
        return host

    def _new_host_namespace(self, name: str) -> str:
        if name in self.hosts or not name.replace("-", "").isalnum() or len(name) > 12:
            raise ValueError(f"bad or duplicate host name {name!r} (letters, digits, dashes; at most 12)")
        ns = f"nl{self.tag}-{name}"
        self._add_namespace(ns)
        return ns

    def _add_namespace(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        with self._lock:
            self._namespaces.append(ns)
        self._ip(ns, "link", "set", "lo", "up")

    def _plug(self, ns: str, dev: str, address: str) -> None:
        """A veth from ``ns`` (named ``dev``, holding ``address``/24) to a new port of the internet's bridge."""
        self._ports += 1
        port = f"port{self._ports}"
        self._ip(self.net, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
        self._ip(self.net, "link", "set", port, "master", "sw", "up")
        self._ip(ns, "addr", "add", f"{address}/24", "dev", dev)
        self._ip(ns, "link", "set", dev, "up")
        self._port_of[ns] = port

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        sh("ip", "-n", ns, *args)

    # ---------------------------------------------------------------------------------------------- shaping
    def shape(self, name: str, down_mbit: Optional[float], up_mbit: Optional[float]) -> None:
        """Limit a host's link to the internet (Mbit/s each way; None: unlimited). A home host's link is its
        router's: upload on the router's WAN side, download on its LAN side."""
        host = self.hosts[name]
        if host.router is None:
            up, down = (host.namespace, "eth0"), (self.net, self._port_of[host.namespace])
        else:
            up, down = (host.router, "wan"), (host.router, "lan")
        for (ns, dev), mbit in ((up, up_mbit), (down, down_mbit)):
            _tbf(ns, dev, mbit)

    def set_rate(self, mbit: Optional[float]) -> None:
        """Every host's link limited to ``mbit`` Mbit/s each way (None: unlimited)."""
        for name in self.hosts:
            self.shape(name, mbit, mbit)

    # ---------------------------------------------------------------------------------------------- faults
    def router_down(self, name: str) -> None:
        """The home's router loses its internet link: packets vanish (no RST, no FIN), like a pulled cable."""
        self._ip(self._router(name), "link", "set", "wan", "down")

    def router_up(self, name: str) -> None:
        router = self._router(name)
        self._ip(router, "link", "set", "wan", "up")

    def _router(self, name: str) -> str:
        router = self.hosts[name].router
        if router is None:
            raise ValueError(f"{name} is not a home host")
        return router

    # ---------------------------------------------------------------------------------------------- removal
    def remove(self) -> None:
        """Delete every namespace this lab created (their interfaces go with them). Safe to call twice."""
        with self._lock:
            namespaces, self._namespaces = self._namespaces, []
        for ns in reversed(namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self._restore_signals()

    def _catch_signals(self) -> None:
        """SIGTERM/SIGHUP end the process through the usual exit path (context managers, atexit), so the lab is
        removed; only from the main thread, where Python handles signals."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)
            if previous in (signal.SIG_DFL, None):
                self._previous_handlers[sig] = previous
                signal.signal(sig, _exit_on_signal)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous or signal.SIG_DFL)
        self._previous_handlers = {}


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _tbf(ns: str, dev: str, mbit: Optional[float]) -> None:
    if mbit is None:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        return
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.004), 64 * 1024)  # >= rate / HZ, so tbf can reach its rate
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
       "burst", str(burst), "latency", "100ms")


class NetLab(Internet):
    """N public hosts on one bridge, every link shaped alike (the benchmarks' flat network)."""

    def __init__(self, n: int, tag: Optional[str] = None):
        super().__init__(tag)
        self.n = n

    def __enter__(self) -> "NetLab":
        super().__enter__()
        try:
            for i in range(self.n):
                self.add_public(f"h{i}")
        except BaseException:
            self.remove()
            raise
        return self

    @property
    def namespaces(self) -> list[str]:
        return [self.hosts[f"h{i}"].namespace for i in range(self.n)]

    def address(self, i: int) -> str:
        return self.hosts[f"h{i}"].address

    def exec_prefix(self, i: int) -> list[str]:
        return self.hosts[f"h{i}"].exec_prefix


# ---------------------------------------------------------------------------------------------- benchmark workers

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
