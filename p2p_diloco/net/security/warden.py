"""A private swarm's bootstrap keeps connections with members only (issue 24, finding 12).

hivemind 1.1.12's p2pd relays for whoever holds a connection to it (libp2p circuit relay v2) and offers no hook to
refuse a peer: no connection gater, no pre-shared key. What it does offer is the list of connected peers and a
disconnect. So a private swarm's bootstrap runs a warden in its DHT process: every ``POLL_S`` it lists the peers
connected to its p2pd and keeps those that showed they hold the secret: a DHT request signed with it (the DHT's
authorizer notes its libp2p-authenticated sender, auth.py: every member's first act is a DHT request to its
initial peers), else a membership proof (the swarm secret's MAC of the peer's PeerID, as the speed test checks it,
access.py) that the warden asks for over a stream on the connection itself. A peer whose answer is missing or
wrong, or that is revoked, is disconnected, and its relay reservation and relayed connections go with the
connection. Every node started with a secret answers (:class:`AnswerMembership`, registered by
``net.dht.start_dht``), so members never notice the warden.

What it bounds: a stranger's first connection, and with it its relay slot, lasts about ``POLL_S + RETRY_S`` when it
does not answer the protocol (one that stalls its answers: ``POLL_S + TRIES * ANSWER_TIMEOUT_S + RETRY_S``); the
warden then knows it for ``REMEMBER_S`` and closes each new connection of it at its next look, within ``POLL_S``.
So no relayed connection of a stranger lives longer than that, where p2pd alone lets it run for 30 minutes and
4 GiB; a stranger dialing again in a loop still holds a connection much of the time, but none that carries a
stream for more than a moment (its slot and its circuits end with each one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from p2p_diloco.net.security.access import AccessKeys

logger = logging.getLogger(__name__)

MEMBER_PROTOCOL = "/p2p-diloco/member-proof/1"
POLL_S = 0.5  # s between two looks at p2pd's connections (p2pd tells no one of a new connection: we must ask)
ANSWER_TIMEOUT_S = 5.0  # s for a peer to open the stream and send its proof
TRIES = 2  # a member too loaded to answer, or whose handler is not registered yet, is asked again
RETRY_S = 2.0  # s between the two
REMEMBERED = 4096  # strangers closed at sight when they come back (the oldest forgotten first) ...
REMEMBER_S = 600.0  # ... for this long, unless one signs a DHT request with the secret meanwhile
_TASKS: set = set()  # asyncio keeps only weak references to tasks: ours are held here until they end


def _hold(task: asyncio.Task) -> None:
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def _authorizer_of(node):
    """This DHT node's authorizer (net/security/auth.py ``HMACAuthorizer``): the swarm's keys, the revoked PeerIDs
    and the peers it saw sign a DHT request, all kept current (a new secret file, a new revocation)."""
    return node.protocol.authorizer


class AnswerMembership:
    """Runs in the DHT process of every node that holds the secret: answer a membership-proof request with our proof
    (useless to anyone else: it is bound to our PeerID, which only our key can authenticate)."""

    def __init__(self, access: Optional[Callable] = None):
        self.access = access  # tests: a callable returning an object with ``keys``; default: the node's authorizer

    async def __call__(self, _dht, node) -> None:
        access = self.access or (lambda: _authorizer_of(node))
        own = node.peer_id.to_bytes()

        async def handle(_info, _reader, writer: asyncio.StreamWriter) -> None:
            try:
                keys = getattr(access(), "keys", None)
                if keys is not None:
                    writer.write(keys.proof(own))
                    await writer.drain()
            except Exception as e:  # noqa: BLE001 - the asker went away
                logger.debug(f"membership proof not sent: {e!r}")
            finally:
                writer.close()

        await node.p2p.add_binary_stream_handler(MEMBER_PROTOCOL, handle)


class Warden:
    """Runs in a private bootstrap's DHT process: close every connection of a peer that cannot prove membership
    (module docstring). ``closed`` counts closings, ``members`` the peers checked and kept; both live in the
    process the warden runs in (tests run it in their own)."""

    def __init__(self, access: Optional[Callable] = None):
        self.access = access
        self.closed = 0
        self.members: dict = {}  # PeerID -> the secret's fingerprint its proof was checked with
        self.strangers: dict = {}  # PeerID -> (the secret's fingerprint it failed with, until when it is known)
        self._checking: set = set()

    async def __call__(self, _dht, node) -> None:
        _hold(asyncio.create_task(self.watch(node.p2p, self.access or (lambda: _authorizer_of(node)))))

    async def watch(self, p2p, access: Callable) -> None:
        while True:
            try:
                await self.look(p2p, access)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - p2pd restarting; the supervisor replaces the node
                logger.debug(f"warden: could not list the connections: {e!r}")
            await asyncio.sleep(POLL_S)  # polled: p2pd's control API has no notice of a new connection

    async def look(self, p2p, access: Callable) -> None:
        """One look at the connections: keep members, check new peers, close the revoked and known strangers."""
        authorizer = access()
        keys, revoked = getattr(authorizer, "keys", None), getattr(authorizer, "revoked", ())
        if keys is None:
            return
        vouched = getattr(authorizer, "vouched", {})
        connected = {info.peer_id for info in await p2p.list_peers()}
        self.members = {peer: seen for peer, seen in self.members.items() if peer in connected}
        for peer in connected:
            if peer.to_base58() in revoked:
                await self._close(p2p, peer, "revoked")
            elif vouched.get(peer) == keys.fingerprint:
                self.members[peer] = keys.fingerprint
                self.strangers.pop(peer, None)
            elif self._known_stranger(peer, keys.fingerprint):
                await self._close(p2p, peer, "closed before")
            elif self.members.get(peer) != keys.fingerprint and peer not in self._checking:
                self._checking.add(peer)
                _hold(asyncio.create_task(self._check(p2p, peer, keys, access)))

    async def _check(self, p2p, peer, keys: AccessKeys, access: Callable) -> None:
        try:
            why = "no answer"
            for attempt in range(TRIES):
                if attempt:
                    await asyncio.sleep(RETRY_S)  # a node that just connected registers its handler after it joins
                why = await self._ask(p2p, peer, keys)
                vouched = getattr(access(), "vouched", {}).get(peer) == keys.fingerprint  # its DHT request came
                if why is None or vouched:  # in meanwhile (a member's first act, before its answer is registered)
                    self.members[peer] = keys.fingerprint
                    return
                if why == "a wrong membership proof":
                    break
            self._remember(peer, keys.fingerprint)
            await self._close(p2p, peer, why)
        finally:
            self._checking.discard(peer)

    @staticmethod
    async def _ask(p2p, peer, keys: AccessKeys) -> Optional[str]:
        """None if ``peer`` sent a valid proof, else why not."""
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, MEMBER_PROTOCOL),
                                                       ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "no answer"
        except Exception:  # noqa: BLE001 - p2pd: the peer has no handler for the protocol (not one of ours)
            return "no membership proof"
        try:
            proof = await asyncio.wait_for(reader.readexactly(len(keys.proof(b""))), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "no answer"
        except Exception:  # noqa: BLE001 - closed before a whole proof: a node without the secret
            return "no membership proof"
        finally:
            writer.close()
        return None if keys.verify(peer.to_bytes(), proof) else "a wrong membership proof"

    def _remember(self, peer, fingerprint: str) -> None:
        self.strangers.pop(peer, None)
        if len(self.strangers) >= REMEMBERED:
            del self.strangers[next(iter(self.strangers))]
        self.strangers[peer] = (fingerprint, time.monotonic() + REMEMBER_S)

    def _known_stranger(self, peer, fingerprint: str) -> bool:
        known = self.strangers.get(peer)
        return known is not None and known[0] == fingerprint and time.monotonic() < known[1]

    async def _close(self, p2p, peer, why: str) -> None:
        if self.closed < 100 or self.closed % 100 == 0:  # a stranger that reconnects in a loop floods no log
            logger.warning(f"warden: closed the connection of {peer.to_base58()[:16]}…: {why}")
        self.members.pop(peer, None)
        self.closed += 1
        try:
            await p2p._client.disconnect(peer)  # hivemind's P2P wraps no disconnect; its daemon client has one
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug(f"warden: disconnect {peer}: {e!r}")
