"""Who may take part in a private run: keys derived from the run's secret, membership proofs bound to a PeerID,
authenticated DHT requests with a replay window, and revocation records. Pure: no hivemind, no network.

Keys (HKDF-SHA256, RFC 5869, over the shared secret):
  * ``dht``    authenticates every DHT request and response of the swarm (bootstrap nodes hold it too; they know no
               run, so it depends on the secret alone);
  * ``revoke`` authenticates revocation records (per secret too: a bootstrap node refuses revoked peers as well);
  * ``member`` (also bound to the run_id): ``proof(peer) = HMAC(member, "member" | run_id | peer_id bytes)``.

libp2p authenticates the remote PeerID of every connection, so a proof is worth something only to the peer it names:
a member checks the proof against the connection's PeerID, never against what the message claims. What a secret
holder can compute, any secret holder can: this keeps outsiders (no secret, an old secret) out, and revocation
(a list of PeerIDs every node refuses) removes one member without a new secret.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2p_diloco.config.fields import ConfigError

REPLAY_WINDOW_S = 60.0  # a signed DHT request older or newer than this (clock skew included) is refused


def read_secret(secret: Optional[str], secret_file: Optional[str]) -> Optional[bytes]:
    """The run's secret (``network.secret`` or the content of ``network.secret_file``, surrounding whitespace
    stripped), or None for an open run. Raises ConfigError (one line) for a missing, unreadable or empty file."""
    if secret is not None and secret_file is not None:
        raise ConfigError("network.secret, network.secret_file: set one of them, not both")
    if secret_file is None:
        return secret.strip().encode() if secret is not None else None
    try:
        data = Path(secret_file).expanduser().read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"network.secret_file: cannot read {secret_file}: {e.strerror or e}") from None
    if not data:
        raise ConfigError(f"network.secret_file: {secret_file} is empty (put the run's secret in it)")
    return data


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869, ``cryptography``'s) with a fixed salt: extract once, expand ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"p2p-diloco access v1", info=info).derive(secret)


def _mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts``, each length-prefixed so that no two splits of the same bytes collide."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class AccessKeys:
    """The keys of one secret (and run). ``fingerprint``: a short public hash telling secrets apart in logs."""
    dht: bytes
    revoke: bytes
    member: bytes
    run_id: str
    fingerprint: str

    @classmethod
    def derive(cls, secret: bytes, run_id: str = "") -> "AccessKeys":
        return cls(dht=_hkdf(secret, b"dht"), revoke=_hkdf(secret, b"revoke"),
                   member=_hkdf(secret, b"member|" + run_id.encode()), run_id=run_id,
                   fingerprint=_hkdf(secret, b"fingerprint", 4).hex())

    def proof(self, peer_id: bytes) -> bytes:
        """This run's membership proof for ``peer_id`` (the raw bytes of a libp2p PeerID)."""
        return _mac(self.member, b"member", self.run_id.encode(), peer_id)

    def verify(self, peer_id: bytes, proof: bytes) -> bool:
        return isinstance(proof, bytes) and hmac.compare_digest(self.proof(peer_id), proof)

    # ---------------------------------------------------------------------------------------- DHT messages
    def sign_message(self, kind: bytes, body: bytes) -> bytes:
        """MAC of a DHT request or response (``kind`` b"request"/b"response") whose signature field is empty."""
        return _mac(self.dht, kind, body)

    def check_message(self, kind: bytes, body: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.sign_message(kind, body), signature)

    # ---------------------------------------------------------------------------------------- revocation
    def revocation(self, peer: str, at: Optional[float] = None) -> dict:
        """A record saying that ``peer`` (base58 PeerID) is no longer a member, as of ``at`` (unix time)."""
        at = time.time() if at is None else float(at)
        return {"at": at, "mac": _mac(self.revoke, b"revoke", peer.encode(), repr(at).encode()).hex()}

    def is_revocation(self, peer: str, record) -> bool:
        if not isinstance(record, Mapping) or not isinstance(record.get("at"), float):
            return False
        expected = self.revocation(peer, record["at"])["mac"]
        return isinstance(record.get("mac"), str) and hmac.compare_digest(expected, record["mac"])

    def revoked_peers(self, records: Mapping[str, object]) -> set[str]:
        """The peers (base58) of the valid records among ``records`` (peer → record); forged ones are ignored."""
        return {peer for peer, record in records.items() if self.is_revocation(str(peer), record)}


class ReplayGuard:
    """Refuses a (time, nonce) seen before or outside ``window`` seconds of now: a captured request cannot be sent
    again. Nonces are kept for twice the window (a request cannot be both fresh and forgotten)."""

    def __init__(self, window: float = REPLAY_WINDOW_S):
        self.window = window
        self._seen: dict[bytes, float] = {}

    def fresh(self, sent_at: float, nonce: bytes, now: float) -> bool:
        if not nonce or abs(now - sent_at) > self.window:
            return False
        if len(self._seen) > 1024:
            self._seen = {n: t for n, t in self._seen.items() if t > now}
        if self._seen.get(nonce, -1.0) > now:
            return False
        self._seen[nonce] = now + 2 * self.window
        return True

