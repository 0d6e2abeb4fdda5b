"""Reducer checks (``averaging.verify_parts``): before a member commits a round, it compares the digests of the
averaged parts it received with every other member's; a reducer that sent different bytes to different members
fails the round on every member that sees it, and is named in the error.

The exchange (after a member's all-reduce has ended well): direct calls between group members, one per pair, over
libp2p streams authenticated to the remote PeerID, so nobody can send digests in another member's name. The caller
sends its digests (one sha256 per reducer, over the digests of that reducer's parts in order) and the callee answers
with its own once its all-reduce has ended. A client-mode member calls the reachable ones; between two reachable
members the one listed first calls; two client-mode members cannot reach each other and do not compare directly
(README, "Reducer checks": what that leaves open). A member that cannot get the digests of every member it pairs
with before the all-reduce's deadline does not commit. Members that did commit while another failed is the
divergence that the next round's θ_global digest check settles (the minority repairs from the majority).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Optional, Sequence

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.net.reducer_checks import describe_equivocations, equivocations

logger = logging.getLogger(__name__)
DIGEST_BYTES = 32


def part_digest(msg: runtime_pb2.Tensor) -> bytes:
    """sha256 of an encoded part as every recipient decodes it: its codec tag, shape and bytes."""
    h = hashlib.sha256(f"{msg.dtype}|{msg.compression}|{list(msg.size)}|".encode())
    h.update(msg.buffer)
    return h.digest()


class ReducerDigests:
    """One running digest per reducer, over the digests of its averaged parts in the order they were registered."""

    def __init__(self, num_reducers: int):
        self._hashes = [hashlib.sha256() for _ in range(num_reducers)]

    def add(self, reducer_index: int, digest: bytes) -> None:
        self._hashes[reducer_index].update(digest)

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self._hashes]


def caller(me: int, other: int, clients: Sequence[bool]) -> bool:
    """Whether member ``me`` calls member ``other`` (one call per pair): a client calls a reachable member, else the
    one listed first calls. Two clients: neither (they cannot dial each other)."""
    if clients[me] != clients[other]:
        return clients[me]
    return not clients[me] and me < other


class Verification:
    """What one member knows of one group's digests: its own (once its all-reduce ended), and the others'."""

    def __init__(self, peer_ids: Sequence, names: Sequence[str], me: int, clients: Sequence[bool]):
        self.peer_ids, self.names, self.me, self.clients = list(peer_ids), list(names), me, clients
        self.own: asyncio.Future = asyncio.get_event_loop().create_future()  # our digests, or why we have none
        self.views: dict[int, list[bytes]] = {}
        self.failures: dict[int, str] = {}
        self.expected = {j for j in range(len(peer_ids)) if j != me and (caller(me, j, clients)
                                                                          or caller(j, me, clients))}
        self.settled = asyncio.Event()

    def record(self, index: int, digests: Sequence[bytes]) -> None:
        if index in self.views or index in self.failures:
            return  # the first answer counts
        if len(digests) != len(self.peer_ids) or any(len(d) != DIGEST_BYTES for d in digests):
            self.fail(index, f"sent {len(digests)} malformed digests")
            return
        self.views[index] = list(digests)
        self.check_settled()

    def fail(self, index: int, reason: str) -> None:
        if index not in self.views:
            self.failures.setdefault(index, reason)
            self.check_settled()

    def check_settled(self) -> None:
        if self.expected <= set(self.views) | set(self.failures):
            self.settled.set()

    def verdict(self) -> Optional[str]:
        """None if every expected member sent digests equal to ours; else why the round must fail."""
        if self.failures:
            return "; ".join(f"member {self.names[j]} could not verify: {why}" for j, why in self.failures.items())
        missing = self.expected - set(self.views)
        if missing:
            return f"no part digests from member(s) {sorted(self.names[j] for j in missing)} in time"
        views = {self.names[j]: [d.hex() for d in digests] for j, digests in self.views.items()}
        views[self.names[self.me]] = [d.hex() for d in self.own.result()]
        found = equivocations(views, self.names)
        return describe_equivocations(found) if found else None


class PartVerifier:
    """Mixin of :class:`~p2p_diloco.net.averaging.CanonicalAverager`: the ``rpc_verify_parts`` handler and
    :meth:`_verify_parts`. Expects ``self._p2p``, ``self.prefix``, ``self._running_groups``, ``self.get_stub``."""

    # hivemind collects a servicer's rpc_* handlers once per class and caches them on it: without these, a class
    # whose parent (DecentralizedAverager) collected first would inherit the parent's list, without ours
    _rpc_handlers = None
    _stub_type = None
    _verifications: dict  # group id -> Verification, or a future of one while a call waits for it to open
    _verify_until: float = 0.0  # time.monotonic() when the all-reduce in progress must be over

    def _open_verification(self, group_info, names: Sequence[str], modes) -> Verification:
        me = group_info.peer_ids.index(self.peer_id)
        clients = [m == AveragingMode.CLIENT for m in modes]
        v = Verification(group_info.peer_ids, names, me, clients)
        waiting = self._verifications.get(group_info.group_id)
        self._verifications[group_info.group_id] = v
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            waiting.set_result(v)  # a call that arrived before we opened it
        return v

    def _close_verification(self, group_id, v: Optional[Verification], error: Optional[BaseException]) -> None:
        """The group's all-reduce is over: calls still waiting for our digests get an answer now."""
        if v is not None and not v.own.done():
            v.own.set_exception(AllreduceException(f"its all-reduce failed: {error!r}"[:200]))
            v.own.exception()  # retrieved: no "never retrieved" warning when no call awaited it
        waiting = self._verifications.pop(group_id, None)
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            waiting.set_result(None)  # a call waited for a verification we never opened: it is told so

    async def rpc_verify_parts(self, request: averaging_pb2.MessageFromLeader,
                               context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """A group member sends the digests of the averaged parts it received; we answer with ours."""
        v = await self._verification_for(request.group_id)
        if v is None:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        if context.remote_id not in v.peer_ids or not caller(v.peer_ids.index(context.remote_id), v.me, v.clients):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        v.record(v.peer_ids.index(context.remote_id), list(request.gathered))
        try:
            own = await asyncio.wait_for(asyncio.shield(v.own), timeout=self._verify_deadline())
        except Exception as e:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.INTERNAL_ERROR, suggested_leader=repr(e)[:200]
                                                   .encode())
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, group_id=request.group_id, gathered=own)

    async def _verification_for(self, group_id) -> Optional[Verification]:
        found = self._verifications.get(group_id)
        if isinstance(found, Verification):
            return found
        if group_id not in self._running_groups:
            return None  # not a group of ours (or already over)
        if found is None:  # ours, but not opened yet: wait for it
            found = self._verifications[group_id] = asyncio.get_event_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(found), timeout=self._verify_deadline())
        except asyncio.TimeoutError:
            if self._verifications.get(group_id) is found:
                del self._verifications[group_id]
            return None

    def _verify_deadline(self) -> float:
        """Seconds a verification may still wait: the rest of the all-reduce's deadline (set in its group's start)."""
        return max(0.1, self._verify_until - time.monotonic())

    async def _verify_parts(self, group_info, v: Verification, own: list[bytes]) -> None:
        """Exchange digests with the members we pair with; raise AllreduceException naming the reducer(s) whose
        bytes differ, or the member(s) whose digests are missing, unless every one matches ours."""
        v.own.set_result(own)
        v.check_settled()  # nobody to pair with (client-mode members only besides us): settled at once
        calls = [asyncio.create_task(self._call_verify(group_info.group_id, v, j))
                 for j in sorted(v.expected) if caller(v.me, j, v.clients)]
        try:
            await asyncio.wait_for(v.settled.wait(), timeout=self._verify_deadline())
        except asyncio.TimeoutError:
            pass  # the verdict names who is missing
        finally:
            for call in calls:
                call.cancel()
        verdict = v.verdict()
        if verdict is not None:
            raise AllreduceException(f"reducer check failed: {verdict}")

    async def _call_verify(self, group_id, v: Verification, j: int) -> None:
        stub = self.get_stub(self._p2p, v.peer_ids[j], namespace=self.prefix)
        try:
            answer = await stub.rpc_verify_parts(averaging_pb2.MessageFromLeader(
                group_id=group_id, gathered=v.own.result()), timeout=self._verify_deadline())
        except Exception as e:
            v.fail(j, f"no answer ({e!r})"[:200])
            return
        if answer.code == averaging_pb2.ACCEPTED:
            v.record(j, list(answer.gathered))
        else:
            why = answer.suggested_leader.decode(errors="replace") or averaging_pb2.MessageCode.Name(answer.code)
            v.fail(j, why)
