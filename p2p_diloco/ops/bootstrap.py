"""The bootstrap node: a DHT-only node with a stable identity that peers use to find each other.

It holds no model and takes no part in averaging; any live peer can serve as an initial peer too, so losing the
bootstrap node never stops a running swarm.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

from p2p_diloco.config import NetworkConfig

logger = logging.getLogger("p2p_diloco.bootstrap")

DEFAULTS = {
    "network.host_maddrs": ["/ip4/0.0.0.0/tcp/31337"],
    "network.identity_path": "bootstrap.key",
}


def run_bootstrap(cfg: NetworkConfig, stop_event: threading.Event, *, maddrs_file: Optional[str] = None,
                  echo: Callable[[str], None] = print) -> None:
    """Serve the DHT until ``stop_event`` is set. Prints the addresses to give peers and a command to join."""
    from p2p_diloco.net.dht import start_dht, visible_maddrs  # hivemind loads in ~2 s: not for --help or bad input

    dht = start_dht(cfg)
    try:
        maddrs = visible_maddrs(dht)
        echo(f"bootstrap node {dht.peer_id} is up; identity file: {cfg.identity_path or '(none: new id each start)'}")
        for maddr in maddrs:
            echo(f"  {maddr}")
        public = [m for m in maddrs if "/127.0.0.1/" not in m and "/::1/" not in m] or maddrs
        echo("join with:")
        echo(f"  p2p-diloco peer --initial-peers {public[0]}")
        if maddrs_file:
            _write_atomically(maddrs_file, "\n".join(maddrs) + "\n")
        stop_event.wait()
        echo("bootstrap node stopping")
    finally:
        dht.shutdown()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
