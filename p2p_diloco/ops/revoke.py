"""``p2p-diloco revoke PEER_ID``: remove a member from a private run without restarting it (net/security/auth.py).

It joins the swarm's DHT as a client (with the secret), stores a revocation record of the peer, and exits. Every
peer and bootstrap node reads the list within a roster heartbeat (or net/auth.REFRESH_S) and refuses the peer from then on.
The record is signed with the key at ``network.identity_path``, which must be one of the run's
``network.revokers`` (the DHT node it joins with has a fresh identity: the revoker's own node may be running).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from p2p_diloco.config import ConfigError, NetworkConfig

STORE_TIMEOUT = 15.0  # s for the DHT to confirm the record


def run_revoke(cfg: NetworkConfig, peer: str, echo: Callable[[str], None]) -> int:
    """Revoke ``peer``; 0 once the DHT stored the record, 1 if it did not confirm in time."""
    if cfg.secret is None and cfg.secret_file is None:
        raise ConfigError("revoke: needs network.secret_file (or network.secret): only a private run has members")
    if not cfg.initial_peers:
        raise ConfigError("revoke: needs --initial-peers (the multiaddr of any live node of the run)")
    if not cfg.revokers:
        raise ConfigError("revoke: this run names no revokers, so its nodes take no revocation: give every node "
                          "--network.revokers=<a peer id whose key you hold> (or rotate the secret)")
    from hivemind.p2p import PeerID

    from p2p_diloco.net.security.auth import Access, revoke
    from p2p_diloco.net.dht import start_dht

    try:
        PeerID.from_base58(peer)
    except ValueError:
        raise ConfigError(f"revoke: {peer!r} is not a peer id (e.g. 12D3KooW... or Qm..., as in the roster)") from None
    signer = _revoker(cfg)
    access = Access(cfg.secret, cfg.secret_file, revokers=cfg.revokers)
    dht = start_dht(replace(cfg, identity_path=None), client_mode=True)
    try:
        if revoke(dht, access.keys, peer, STORE_TIMEOUT, signer):
            echo(f"revoked {peer}: peers refuse it within seconds (a roster heartbeat)")
            return 0
        echo(f"revoke: the DHT did not confirm the record within {STORE_TIMEOUT:.0f} s; try again")
        return 1
    finally:
        dht.shutdown()


def _revoker(cfg: NetworkConfig):
    """The identity that signs the record: one of ``network.revokers``, read from ``network.identity_path``."""
    from p2p_diloco.net.security.identity import Identity, IdentityError

    if not cfg.identity_path:
        raise ConfigError("revoke: this run has network.revokers: give the key of one of them with "
                          "--network.identity_path")
    try:
        signer = Identity.load(cfg.identity_path)
    except IdentityError as e:
        raise ConfigError(f"revoke: network.identity_path: {e}") from None
    if signer.peer_id_b58 not in cfg.revokers:
        raise ConfigError(f"revoke: {signer.peer_id_b58} (network.identity_path) is not among network.revokers: "
                          f"peers would ignore its revocation")
    return signer
