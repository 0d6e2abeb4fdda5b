"""DHT nodes and every DHT key this project writes or reads.

Keys (all under the run's prefix ``{run_id}_{fingerprint}``, so runs and model shapes never mix):
  * ``{prefix}.0b...``           hivemind matchmaking (written by hivemind's averager)
  * ``{prefix}.all_averagers``   state donors, priority = round (written by hivemind's averager)
  * ``{prefix}.roster``          every peer's PeerStatus (round, digest of θ_global and momentum, leaving)

Run-level keys (``{safe_run_id}``: the run_id with characters other than letters, digits, ``_`` and ``-`` as ``_``):
  * ``{safe_run_id}.runs``       index of the run's prefixes: subkey = prefix, value = {"fingerprint": ...},
                                 refreshed with the roster heartbeat, so ``p2p-diloco status`` finds every
                                 prefix of a run knowing only its run_id
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional, Sequence

import hivemind
import torch
from hivemind.p2p import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import ConfigError, NetworkConfig
from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.errors import JoinError
from p2p_diloco.ops.procs import become_child_process, subprocesses_die_with_us

logger = logging.getLogger(__name__)

# hivemind switches torch to the "file_system" sharing strategy on import, which starts a torch_shm_manager daemon
# that outlives its peer by tens of seconds, outside the peer's process group. What we share (hivemind's future
# buffers, one averaging buffer per parameter) is shared before forking: file descriptors suffice, leave no daemon.
torch.multiprocessing.set_sharing_strategy("file_descriptor")


class DHT(hivemind.DHT):
    """hivemind.DHT whose background process, and the p2pd daemon it starts, die with the process that created it."""

    def run(self) -> None:
        become_child_process()
        subprocesses_die_with_us()
        super().run()


def safe_run_id(run_id: str) -> str:
    """``run_id`` with every character other than letters, digits, ``_`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


def run_prefix(run_id: str, fingerprint: str) -> str:
    """Namespace of one run: peers with another run_id, model or codec never group with us."""
    return f"{safe_run_id(run_id)}_{fingerprint}"


def start_dht(cfg: NetworkConfig, *, client_mode: Optional[bool] = None) -> DHT:
    """Start a DHT node from the [network] section; raise JoinError (one line) if it cannot join in time."""
    _check_maddrs("network.initial_peers", cfg.initial_peers)
    _check_maddrs("network.host_maddrs", cfg.host_maddrs)
    _check_maddrs("network.announce_maddrs", cfg.announce_maddrs)
    if cfg.identity_path:
        try:
            Path(cfg.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"network.identity_path: cannot create {cfg.identity_path}: {e.strerror}") from None
    kwargs = dict(
        initial_peers=list(cfg.initial_peers),
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=str(Path(cfg.identity_path).expanduser()) if cfg.identity_path else None,
        client_mode=cfg.client_mode if client_mode is None else client_mode,
        startup_timeout=cfg.join_timeout,
        bootstrap_timeout=cfg.join_timeout,
    )
    try:
        dht = DHT(start=True, await_ready=False, **kwargs)
        dht.wait_until_ready(timeout=cfg.join_timeout + 5)
    except TimeoutError:
        dht.shutdown()
        raise JoinError(f"could not join the swarm within {cfg.join_timeout:.0f} s "
                        f"(network.initial_peers={','.join(cfg.initial_peers)})") from None
    except (P2PDaemonError, OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "bootstrap" in msg.lower() or "connect" in msg.lower():
            msg = f"no initial peer reachable ({','.join(cfg.initial_peers)}): {msg}"
        raise JoinError(msg) from None
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs others can dial, with the peer id; loopback ones last."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))


def _check_maddrs(key: str, maddrs: Sequence[str]) -> None:
    for maddr in maddrs:
        if not maddr.startswith("/"):
            raise ConfigError(f"{key}: not a multiaddr: {maddr!r} (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)")
        try:
            Multiaddr(maddr)
        except Exception as e:  # the multiaddr library raises several unrelated types
            raise ConfigError(f"{key}: invalid multiaddr {maddr!r}: {e}") from None


# ---------------------------------------------------------------------------------------------- the roster
# {prefix}.roster: one subkey per peer id, value = asdict(PeerStatus), expiring unless refreshed (heartbeat).

def roster_key(prefix: str) -> str:
    return f"{prefix}.roster"


def publish_status(dht: hivemind.DHT, prefix: str, status: PeerStatus, ttl: float, timeout: float) -> bool:
    """Store this peer's status for ``ttl`` seconds; False if the DHT did not confirm within ``timeout`` seconds."""
    future = dht.store(roster_key(prefix), subkey=status.peer_id, value=asdict(status),
                       expiration_time=get_dht_time() + ttl, return_future=True)
    try:
        return bool(future.result(timeout=timeout))
    except Exception as e:  # a DHT hiccup must never crash a peer: the status is refreshed by the next heartbeat
        logger.debug(f"publishing status failed: {e!r}")
        return False


def read_roster(dht: hivemind.DHT, prefix: str, timeout: float) -> list[PeerStatus]:
    """Every unexpired peer status of the run (malformed entries are skipped); [] if the DHT does not answer."""
    future = dht.get(roster_key(prefix), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except Exception as e:
        logger.debug(f"reading the roster failed: {e!r}")
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    known = {f.name for f in fields(PeerStatus)}
    roster = []
    for entry in found.value.values():
        try:  # fields this version does not know (a newer peer's) are ignored; missing ones take their default
            roster.append(PeerStatus(**{k: v for k, v in entry.value.items() if k in known}))
        except (TypeError, AttributeError):
            continue
    return roster


# ---------------------------------------------------------------------------------------------- the run index
# {safe_run_id}.runs: one subkey per prefix of the run, value = {"fingerprint": ...}, expiring unless refreshed.

def run_index_key(run_id: str) -> str:
    return f"{safe_run_id(run_id)}.runs"


def publish_run_index(dht: hivemind.DHT, run_id: str, prefix: str, fingerprint: str, ttl: float) -> None:
    """Announce that ``prefix`` belongs to ``run_id`` for ``ttl`` seconds, without waiting for the store: the
    roster heartbeat that calls this must stay on time (a late heartbeat lets a live peer's entry expire), and
    a lost announcement only hides the run from ``status`` until the next heartbeat."""
    dht.store(run_index_key(run_id), subkey=prefix, value={"fingerprint": fingerprint},
              expiration_time=get_dht_time() + ttl, return_future=True)  # the future is dropped: nobody waits


def read_run_index(dht: hivemind.DHT, run_id: str, timeout: float) -> list[str]:
    """The prefixes of ``run_id`` announced within the roster TTL, sorted; [] if none or the DHT does not answer."""
    future = dht.get(run_index_key(run_id), latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except Exception as e:
        logger.debug(f"reading the run index failed: {e!r}")
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    return sorted(str(prefix) for prefix in found.value)
