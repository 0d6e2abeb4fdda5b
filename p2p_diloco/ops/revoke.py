"""``p2p-diloco revoke PEER_ID``: remove a member from a private run without restarting it (net/security/auth.py).

It joins the swarm's DHT as a client (with the secret), stores a revocation record of the peer, and exits. Every
peer and bootstrap node reads the list within a roster heartbeat (or net/auth.REFRESH_S) and refuses the peer from then on.
"""

from __future__ import annotations

from typing import Callable

from p2p_diloco.config import ConfigError, NetworkConfig

STORE_TIMEOUT = 15.0  # s for the DHT to confirm the record


def run_revoke(cfg: NetworkConfig, peer: str, echo: Callable[[str], None]) -> int:
    """Revoke ``peer``; 0 once the DHT stored the record, 1 if it did not confirm in time."""
    if cfg.secret is None and cfg.secret_file is None:
        raise ConfigError("revoke: needs network.secret_file (or network.secret): only a private run has members")
    if not cfg.initial_peers:
        raise ConfigError("revoke: needs --initial-peers (the multiaddr of any live node of the run)")
    from hivemind.p2p import PeerID

    from p2p_diloco.net.security.auth import Access, revoke
    from p2p_diloco.net.dht import start_dht

    try:
        PeerID.from_base58(peer)
    except ValueError:
        raise ConfigError(f"revoke: {peer!r} is not a peer id (e.g. 12D3KooW... or Qm..., as in the roster)") from None
    access = Access(cfg.secret, cfg.secret_file)
    dht = start_dht(cfg, client_mode=True)
    try:
        if revoke(dht, access.keys, peer, STORE_TIMEOUT):
            echo(f"revoked {peer}: peers refuse it within seconds (a roster heartbeat)")
            return 0
        echo(f"revoke: the DHT did not confirm the record within {STORE_TIMEOUT:.0f} s; try again")
        return 1
    finally:
        dht.shutdown()
