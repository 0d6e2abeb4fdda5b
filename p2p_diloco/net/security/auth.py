"""Access control on the wire for a private run (the keys and proofs are in access.py): the DHT's authorizer, the
revocation list in the DHT, and what each process of a peer must be told when the secret or the list changes.

hivemind's DHT takes an ``authorizer`` that signs and checks every DHT request and response (hivemind/utils/auth.py);
its only implementation, ``TokenAuthorizerBase``, needs a central server that hands out access tokens. Ours signs
with a key derived from the run's shared secret (HMAC-SHA256 over the whole serialized message, with a timestamp and
a random nonce; requests older than ``access.REPLAY_WINDOW_S`` or seen before are refused), and refuses requests
whose libp2p-authenticated sender is revoked: hivemind does not hand the connection to the authorizer, so the DHT's
process wraps its handlers to note the sender in a context variable (:func:`bind_remote_peers`).

Revocation list: DHT key ``_p2p_diloco.revoked`` (per secret, like the DHT), subkey = base58 PeerID, value = a record
MAC'd with the secret's revocation key. Any holder of the secret can write one (``p2p-diloco revoke``); records
cannot be withdrawn, and a forged one (no secret) is ignored. Peers read it with every roster heartbeat, bootstrap
nodes every ``REFRESH_S``, and refuse the revoked everywhere: DHT requests, joins, parts, state downloads.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import time
from typing import Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import PeerID
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.records import valid_entries
from p2p_diloco.net.security.access import AccessKeys, ReplayGuard, read_secret

logger = logging.getLogger(__name__)

REVOKED_KEY = "_p2p_diloco.revoked"
REVOKED_TTL = 30 * 24 * 3600.0  # s a revocation record lives in the DHT (write it again to extend)
VOUCHED_KEPT = 4096  # senders of signed DHT requests a node remembers (net/security/warden.py)
REFRESH_S = 5.0  # s between two reads of the revocation list on a bootstrap node
REMOTE_PEER: contextvars.ContextVar[Optional[PeerID]] = contextvars.ContextVar("remote_peer", default=None)


class HMACAuthorizer(AuthorizerBase):
    """Signs and checks DHT messages with the secret's DHT key; refuses revoked senders. ``refused`` counts refusals."""

    def __init__(self, keys: AccessKeys, revoked: frozenset = frozenset()):
        self.keys, self.revoked = keys, frozenset(revoked)
        self.refused = 0
        self._guard = ReplayGuard()
        # PeerID -> fingerprint of the secret one of its DHT requests was signed with (net/security/warden.py keeps
        # a private bootstrap's connections with these; the oldest forgotten first)
        self.vouched: dict = {}

    def update(self, keys: AccessKeys, revoked: frozenset) -> None:
        self.keys, self.revoked = keys, frozenset(revoked)

    async def sign_request(self, request, service_public_key) -> None:
        auth = request.auth
        auth.time, auth.nonce, auth.signature = get_dht_time(), secrets.token_bytes(16), b""
        auth.signature = self.keys.sign_message(b"request", request.SerializeToString())

    async def validate_request(self, request) -> bool:
        remote = REMOTE_PEER.get()
        if remote is not None and remote.to_base58() in self.revoked:
            return self._refuse(f"DHT request from revoked peer {remote}")
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        if not self.keys.check_message(b"request", request.SerializeToString(), signature):
            return self._refuse(f"DHT request from {remote} without this run's secret")
        if not self._guard.fresh(auth.time, auth.nonce, get_dht_time()):
            return self._refuse(f"DHT request from {remote} replayed or out of the time window")
        if remote is not None:
            self.vouched.pop(remote, None)
            self.vouched[remote] = self.keys.fingerprint
            if len(self.vouched) > VOUCHED_KEPT:
                del self.vouched[next(iter(self.vouched))]
        return True

    async def sign_response(self, response, request) -> None:
        auth = response.auth
        auth.nonce, auth.signature = request.auth.nonce, b""
        auth.signature = self.keys.sign_message(b"response", response.SerializeToString())

    async def validate_response(self, response, request) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        if auth.nonce != request.auth.nonce or not self.keys.check_message(
                b"response", response.SerializeToString(), signature):
            return self._refuse("DHT response without this run's secret (an outsider's node, or a stale secret)")
        return True

    def _refuse(self, why: str) -> bool:
        self.refused += 1
        logger.info(f"refused: {why}")
        return False


def bind_remote_peers() -> None:
    """In the DHT's process: let the authorizer see the authenticated sender of each DHT request (REMOTE_PEER)."""
    if getattr(DHTProtocol, "_p2p_diloco_bound", False):
        return
    add_handlers = DHTProtocol.add_p2p_handlers

    async def add_p2p_handlers(self, p2p, wrapper=None, **kwargs):
        return await add_handlers(self, p2p, _NoteSender(wrapper) if wrapper is not None else None, **kwargs)

    DHTProtocol.add_p2p_handlers = add_p2p_handlers
    DHTProtocol._p2p_diloco_bound = True


class _NoteSender:
    """Wraps hivemind's servicer-side AuthRPCWrapper: each rpc_* call first notes ``context.remote_id``."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        method = getattr(self._inner, name)
        if not name.startswith("rpc_"):
            return method

        async def call(request, context, *args, **kwargs):
            token = REMOTE_PEER.set(context.remote_id)
            try:
                return await method(request, context, *args, **kwargs)
            finally:
                REMOTE_PEER.reset(token)

        return call


# ---------------------------------------------------------------------------------------------- the process view
class Access:
    """A node's view of the swarm's access rules: the secret's keys (re-read from ``network.secret_file`` by
    :meth:`refresh`) and the revoked peers. None of it exists in an open run: use :func:`open_access`."""

    def __init__(self, secret: Optional[str], secret_file: Optional[str], run_id: str = "", revokers=()):
        self.secret, self.secret_file, self.run_id, self.revokers = secret, secret_file, run_id, tuple(revokers)
        self._secret = read_secret(secret, secret_file)
        self.keys = AccessKeys.derive(self._secret, run_id, self.revokers)
        self.revoked: frozenset = frozenset()

    def authorizer(self) -> HMACAuthorizer:
        return HMACAuthorizer(self.keys, self.revoked)

    def reread_secret(self) -> bool:
        """Read ``network.secret_file`` again; True if the secret changed (a bad file keeps the old secret)."""
        if self.secret_file is None:
            return False
        try:
            secret = read_secret(None, self.secret_file)
        except Exception as e:
            logger.warning(f"network.secret_file: {e}; keeping the current secret")
            return False
        if secret == self._secret:
            return False
        self._secret, self.keys = secret, AccessKeys.derive(secret, self.run_id, self.revokers)
        logger.warning(f"network.secret_file changed: now using secret {self.keys.fingerprint}; peers still holding "
                       f"the old one are outsiders from now on")
        return True

    def read_revoked(self, dht, timeout: float) -> bool:
        """Add the valid revocation records in the DHT to :attr:`revoked` (never removes); True if it grew."""
        future = dht.get(REVOKED_KEY, latest=True, return_future=True)
        try:
            found = future.result(timeout=timeout)
        except Exception as e:
            logger.debug(f"reading the revocation list failed: {e!r}")
            return False
        records = found.value if found is not None and isinstance(found.value, dict) else {}
        shaped = dict(valid_entries("revoked", records, lambda entry: entry.value))  # well-formed (net/records.py)
        revoked = self.revoked | self.keys.revoked_peers(shaped)
        grown = revoked != self.revoked
        if grown:
            logger.warning(f"revoked peers: {', '.join(sorted(revoked - self.revoked))}")
            self.revoked = frozenset(revoked)
        return grown

    def refresh(self, dht, timeout: float) -> bool:
        """Re-read the secret file and the revocation list; push changes to the DHT's process. True if any."""
        changed = self.reread_secret()
        changed = self.read_revoked(dht, timeout) or changed
        if changed:
            dht.run_coroutine(_UpdateAuthorizer(self.keys, self.revoked))
        return changed


class _UpdateAuthorizer:
    """Runs in the DHT's process (picklable, unlike a closure)."""

    def __init__(self, keys: AccessKeys, revoked: frozenset):
        self.keys, self.revoked = keys, revoked

    async def __call__(self, _dht, node) -> None:
        authorizer = node.protocol.authorizer
        if isinstance(authorizer, HMACAuthorizer):
            authorizer.update(self.keys, self.revoked)


class IsRevoked:
    """Runs in the DHT's process: is ``peer`` (base58) revoked, as its authorizer knows now? (net/security/gate.py asks.)"""

    def __init__(self, peer: str):
        self.peer = peer

    async def __call__(self, _dht, node) -> bool:
        return self.peer in getattr(node.protocol.authorizer, "revoked", ())


def revoke(dht, keys: AccessKeys, peer: str, timeout: float, signer=None) -> bool:
    """Store a revocation record of ``peer`` (base58 PeerID), signed by ``signer`` (one of the run's revokers) if
    given; True if the DHT confirmed it within ``timeout``."""
    PeerID.from_base58(peer)  # raises ValueError for a string that is not a PeerID
    future = dht.store(REVOKED_KEY, subkey=peer, value=keys.revocation(peer, time.time(), signer),
                       expiration_time=get_dht_time() + REVOKED_TTL, return_future=True)
    return bool(future.result(timeout=timeout))
