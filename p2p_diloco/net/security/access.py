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
(a list of PeerIDs every node refuses) removes one member without a new secret. So that a member cannot revoke the
others, a revocation also needs the signature of one of the run's **revokers** (``network.revokers``: Ed25519
PeerIDs, whose public key the PeerID holds; :meth:`AccessKeys.revocation` with ``signer``); a run that names none
takes no revocation at all (rotating the secret still removes members).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ed25519
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
    revokers: tuple = ()  # base58 Ed25519 PeerIDs one of which must sign a revocation; empty: none is taken

    @classmethod
    def derive(cls, secret: bytes, run_id: str = "", revokers=()) -> "AccessKeys":
        return cls(dht=_hkdf(secret, b"dht"), revoke=_hkdf(secret, b"revoke"),
                   member=_hkdf(secret, b"member|" + run_id.encode()), run_id=run_id,
                   fingerprint=_hkdf(secret, b"fingerprint", 4).hex(), revokers=tuple(revokers))

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
    def revocation(self, peer: str, at: Optional[float] = None, signer=None) -> dict:
        """A record saying that ``peer`` (base58 PeerID) is no longer a member, as of ``at`` (unix time); with
        ``signer`` (an identity with ``peer_id_b58`` and ``sign``: net/security/identity.py), signed by it too."""
        at = time.time() if at is None else float(at)
        record = {"at": at, "mac": _mac(self.revoke, b"revoke", peer.encode(), repr(at).encode()).hex()}
        if signer is not None:
            record["by"] = signer.peer_id_b58
            record["sig"] = signer.sign(self._revocation_message(peer, at)).hex()
        return record

    def is_revocation(self, peer: str, record) -> bool:
        if not isinstance(record, Mapping) or not isinstance(record.get("at"), float):
            return False
        expected = _mac(self.revoke, b"revoke", peer.encode(), repr(record["at"]).encode()).hex()
        if not (isinstance(record.get("mac"), str) and hmac.compare_digest(expected, record["mac"])):
            return False
        by, sig = record.get("by"), record.get("sig")
        return by in self.revokers and isinstance(sig, str) and ed25519_verify(
            by, self._revocation_message(peer, record["at"]), sig)

    def _revocation_message(self, peer: str, at: float) -> bytes:
        return b"|".join((b"p2p-diloco revocation v1", self.fingerprint.encode(), peer.encode(), repr(at).encode()))

    def revoked_peers(self, records: Mapping[str, object]) -> set[str]:
        """The peers (base58) of the valid records among ``records`` (peer → record); forged ones are ignored."""
        return {peer for peer, record in records.items() if self.is_revocation(str(peer), record)}


# The revokers' keys, read from their PeerIDs. identity.verify does the same for any PeerID (RSA too) but loads
# hivemind (its PeerID); this module stays pure, and config validation (network.revokers) runs before hivemind loads.
ED25519_PEER_ID = bytes.fromhex("002408011220")  # identity multihash of a PublicKey{Ed25519, 32 bytes} protobuf


def ed25519_public_key(peer: str) -> Optional[bytes]:
    """The 32-byte public key an Ed25519 PeerID (base58, ``12D3KooW...``) holds; None for anything else."""
    try:
        raw = base58.b58decode(peer.encode() if isinstance(peer, str) else b"")
    except ValueError:
        return None
    return raw[len(ED25519_PEER_ID):] if len(raw) == 38 and raw.startswith(ED25519_PEER_ID) else None


def ed25519_verify(peer: str, message: bytes, signature_hex: str) -> bool:
    key = ed25519_public_key(peer)
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(key).verify(bytes.fromhex(signature_hex), message)
        return key is not None
    except (InvalidSignature, ValueError, TypeError):
        return False


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

