"""The bootstrap node: a DHT-only node with a stable identity that peers use to find each other.

It holds no model and takes no part in averaging; any live peer can serve as an initial peer too, so losing the
bootstrap node never stops a running swarm.

It is also the relay of the run's home peers (libp2p circuit relay v2, in p2pd): with ``network.reachability =
public`` (the default here: a bootstrap node must be reachable anyway) its p2pd is told it is public, and serves
relayed connections of up to 30 min and 4 GiB each way, 16 per peer. hivemind 1.1.12's p2pd then races, at
start-up, between that relay and go-libp2p's default one (2 min, 128 KiB per relayed connection: useless for an
all-reduce): the node asks its own relay for its limits and restarts p2pd until the large one serves
(net/nat.py). In a private swarm its warden keeps connections, and so the relay, with members only
(net/security/warden.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from p2p_diloco.config import NetworkConfig

logger = logging.getLogger("p2p_diloco.bootstrap")

DEFAULTS = {
    "network.host_maddrs": ["/ip4/0.0.0.0/tcp/31337"],
    "network.identity_path": "bootstrap.key",
    "network.reachability": "public",
}
RELAY_STARTS = 8  # each start keeps the small relay with probability ~1/2 (measured 4 of 8)


def run_bootstrap(cfg: NetworkConfig, stop_event: threading.Event, *, maddrs_file: Optional[str] = None,
                  echo: Callable[[str], None] = print) -> None:
    """Serve the DHT until ``stop_event`` is set. Prints the addresses to give peers and a command to join."""
    from p2p_diloco.net.dht import visible_maddrs  # hivemind loads in ~2 s: not for --help or bad input

    node = _Node(cfg, echo, maddrs_file, stop_event)
    try:
        node.start(_start_with_relay(cfg, echo))
        maddrs = visible_maddrs(node.dht)
        echo(f"bootstrap node {node.dht.peer_id} is up; identity file: "
             f"{cfg.identity_path or '(none: new id each start)'}")
        for maddr in maddrs:
            echo(f"  {maddr}")
        public = [m for m in maddrs if "/127.0.0.1/" not in m and "/::1/" not in m] or maddrs
        echo("join with:")
        echo(f"  p2p-diloco peer --initial-peers {public[0]}")
        _serve(node, cfg, stop_event, echo)
        echo("bootstrap node stopping")
    finally:
        node.close()


def _swarm_keys(cfg: NetworkConfig):
    """The access keys of a private swarm's secret (not bound to a run: a bootstrap serves them all), else None."""
    if cfg.secret is None and cfg.secret_file is None:
        return None
    from p2p_diloco.net.security.access import AccessKeys, read_secret

    return AccessKeys.derive(read_secret(cfg.secret, cfg.secret_file))


class _Node:
    """The bootstrap's DHT node under watch (net/supervise.py): when its process or its p2pd dies, a new node with
    the same identity, settings and listen ports replaces it; after repeated failures NetworkLost ends the process
    (exit code 3: systemd's Restart= starts it again)."""

    def __init__(self, cfg: NetworkConfig, echo: Callable[[str], None], maddrs_file: Optional[str],
                 stop_event: threading.Event):
        self.cfg, self.echo, self.maddrs_file, self.stop_event = cfg, echo, maddrs_file, stop_event
        self.dht = None
        self.supervisor = None

    def start(self, dht):
        from p2p_diloco.net.dht import visible_maddrs
        from p2p_diloco.net.supervise import Supervisor, Watch
        from p2p_diloco.net.security.warden import Warden
        from p2p_diloco.ops.doctor import ServeSpeedTest

        self.dht = dht
        dht.run_coroutine(ServeSpeedTest(_swarm_keys(self.cfg)))  # for p2p-diloco doctor's throughput line
        if _swarm_keys(self.cfg) is not None:  # its relay for members only (p2pd has no hook: the warden closes)
            dht.run_coroutine(Warden())
        if self.maddrs_file:
            _write_atomically(self.maddrs_file, "\n".join(visible_maddrs(dht)) + "\n")
        watch = Watch(dht)
        if self.supervisor is None:
            self.supervisor = Supervisor(watch, self._restart, logger, what="the DHT node", then="serving again",
                                         stop_event=self.stop_event)
        return watch

    def _restart(self):
        from dataclasses import replace

        from p2p_diloco.net.failfast import close_host_side, drop_unclaimed_descriptors, fresh_shared_locks
        from p2p_diloco.net.supervise import pinned_maddrs

        if self.dht.is_alive():
            self.dht.shutdown()
        close_host_side(self.dht)  # its pipes, before the new DHT process is forked: it would inherit them
        fresh_shared_locks()  # a DHT process killed holding one of hivemind's would block the new one for good
        drop_unclaimed_descriptors()  # the dead process's share of commands it never read
        host = pinned_maddrs(self.cfg.host_maddrs, self.supervisor.watch.bound)  # where peers know this node
        return self.start(_start_with_relay(replace(self.cfg, host_maddrs=host), self.echo))

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()
        if self.dht is not None:
            self.dht.shutdown()


def _serve(node: _Node, cfg: NetworkConfig, stop_event: threading.Event, echo: Callable[[str], None]) -> None:
    """Until stopped, with the node under watch; a private swarm's node re-reads its secret file and the
    revocation list (net/security/auth.py)."""
    from p2p_diloco.net.security.auth import REFRESH_S, Access
    from p2p_diloco.net.supervise import CHECK_EVERY_S

    access = None
    if cfg.secret is None and cfg.secret_file is None:
        echo("open swarm: this node answers anyone (set network.secret_file to serve a private run's members only)")
    else:
        access = Access(cfg.secret, cfg.secret_file, revokers=cfg.revokers)
        echo(f"private swarm: this node answers holders of secret {access.keys.fingerprint} only")
        if not cfg.revokers and cfg.identity_path:
            echo(f"revocations: off (network.revokers is empty); to revoke with this node's key, give every node "
                 f"--network.revokers={node.dht.peer_id} and revoke with --network.identity_path={cfg.identity_path}")
    refreshed = time.monotonic()
    while not stop_event.wait(CHECK_EVERY_S):  # the node's helpers and the list in the DHT: no event, so poll
        node.supervisor.ensure()
        if access is not None and time.monotonic() - refreshed >= REFRESH_S:
            refreshed = time.monotonic()
            access.refresh(node.dht, timeout=REFRESH_S / 2)


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _start_with_relay(cfg: NetworkConfig, echo: Callable[[str], None]):
    """Start the DHT node; if it is to be public, restart it until its relay grants the large limits."""
    from p2p_diloco.net.dht import start_dht, visible_maddrs
    from p2p_diloco.net.nat import own_relay_limits
    from p2p_diloco.net.reachability import DEFAULT_RELAY_LIMIT, RelayInfo, is_public_ip, limits_text

    force = None if cfg.reachability == "auto" else cfg.reachability
    for attempt in range(1, RELAY_STARTS + 1):
        dht = start_dht(cfg, force_reachability=force)
        if force != "public":
            echo("relay: serves once AutoNAT finds this node public (network.reachability=public skips that)")
            return dht
        if not any(is_public_ip(m.split("/")[2]) for m in visible_maddrs(dht)):
            echo("relay: off (no public address: a relay must have one; network.announce_maddrs can add it)")
            return dht
        limits = own_relay_limits(dht)
        if limits is not None and tuple(limits) != DEFAULT_RELAY_LIMIT:
            echo(f"relay: on; {limits_text(RelayInfo('', *limits))}")
            return dht
        if attempt == RELAY_STARTS:
            echo(f"relay: could not get p2pd's configured relay in {RELAY_STARTS} starts (limits {limits}); "
                 f"home peers cannot average through this node")
            return dht
        logger.info(f"relay: p2pd kept go-libp2p's default relay (limits {limits}); restarting it")
        dht.shutdown()
