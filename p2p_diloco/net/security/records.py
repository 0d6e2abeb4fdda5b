"""Signed DHT records: a record stored under a subkey that names a PeerID (the roster, run settings, finished peers,
hivemind's matchmaking and state-donor records) must be signed by that PeerID's own libp2p key, so no other node
can forge or overwrite it (the keys and signatures: net/security/identity.py).

Every node of a swarm (peers, bootstrap nodes, ``status``) runs with an identity whose private key we hold
(:func:`provide_identity`) and with :class:`PeerSignatureValidator` in its DHT: hivemind calls it on every record
this node stores (``sign_value``: we sign those under our own PeerID), on every store request another node sends us,
and on every record another node returns to us (``validate``). A record under a PeerID subkey without a valid
signature of that PeerID is refused on store and dropped on read, and logged once per PeerID. Exempt: the revocation
list, whose subkeys name the revoked peer (its records are MAC'd with the run's secret instead: net/security/access.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from p2p_diloco.config import ConfigError
from p2p_diloco.net.security.identity import Identity, IdentityError, check_sealed, is_peer_id, peer_id_bytes, seal, unseal

logger = logging.getLogger(__name__)
CACHE_SIZE = 4096  # verified records remembered (a roster read checks every entry from every node that answers)


def named_peer(subkey: bytes) -> Optional[bytes]:
    """The PeerID (raw) a record's subkey names: raw PeerID bytes (hivemind's records) or a base58 string (ours)."""
    try:
        value = MSGPackSerializer.loads(subkey)
    except Exception:  # anything a stranger can send
        return None
    if isinstance(value, bytes):
        return value if is_peer_id(value) else None
    return peer_id_bytes(value) if isinstance(value, str) and 40 <= len(value) <= 60 else None


class PeerSignatureValidator(RecordValidatorBase):
    """hivemind's record validator for records under PeerID subkeys (see the module docstring)."""

    def __init__(self, identity: Identity, exempt_keys: Iterable[str] = ()):
        self.identity = identity
        self.exempt = frozenset(DHTID.generate(source=key).to_bytes() for key in exempt_keys)
        self.refused = 0
        self._verified: dict = {}
        self._logged: set = set()

    def _protected(self, record: DHTRecord) -> Optional[bytes]:
        return None if record.key in self.exempt else named_peer(record.subkey)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._protected(record) != self.identity.peer_id:
            return record.value  # not ours to sign: others refuse it if it names another peer
        return seal(self.identity, record.key, record.subkey, record.value, record.expiration_time)

    def validate(self, record: DHTRecord) -> bool:
        peer = self._protected(record)
        if peer is None:
            return True
        ok = self._verified.get(record)
        if ok is None:
            ok = check_sealed(peer, record.key, record.subkey, record.value, record.expiration_time)
            if len(self._verified) >= CACHE_SIZE:
                self._verified.clear()
            self._verified[record] = ok
        if not ok:
            self._refuse(peer)
        return ok

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = unseal(record.value) if self._protected(record) is not None else None
        return record.value if parts is None else parts[0]

    def _refuse(self, peer: bytes) -> None:
        self.refused += 1
        if peer not in self._logged and len(self._logged) < CACHE_SIZE:
            self._logged.add(peer)
            from hivemind.p2p import PeerID

            logger.warning(f"ignored a DHT record in the name of {PeerID(peer)} not signed by it (forged or altered)")

    @property
    def priority(self) -> int:
        return 20  # validated first, stripped before any validator that reads the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerSignatureValidator)


def provide_identity(identity_path: Optional[str], identity: Optional[Identity] = None
                     ) -> tuple[Identity, str, bool, Callable[[], None]]:
    """The identity a node runs with: (identity, the key file for p2pd, whether p2pd should check that the PeerID is
    not in use, a cleanup to call once p2pd has read the file). ``network.identity_path``: loaded, or created (an
    Ed25519 key) if missing; else ``identity`` (a node restarted in the same process) or a fresh Ed25519 key, in a
    private temporary file that the cleanup removes."""
    if identity_path:
        path = Path(identity_path).expanduser()
        existed = path.is_file()
        try:
            if existed:
                identity = Identity.load(str(path))
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                identity = Identity.generate()
                identity.write(str(path))
        except IdentityError as e:
            raise ConfigError(f"network.identity_path: {path}: {e}") from None
        except OSError as e:
            raise ConfigError(f"network.identity_path: cannot create {identity_path}: {e.strerror}") from None
        return identity, str(path), existed, lambda: None
    identity = identity or Identity.generate()
    folder = tempfile.mkdtemp(prefix="p2p-diloco-id-")  # mode 0700: ours alone
    path = os.path.join(folder, "identity.key")
    identity.write(path)
    return identity, path, False, lambda: shutil.rmtree(folder, ignore_errors=True)
