"""Reducer checks (``averaging.verify_parts``): before a member commits a round, it compares the digests of the
averaged parts it received with every other member's; a reducer that sent different bytes to different members
fails the round on every member that sees it, and is named in the error.

The exchange (after a member's all-reduce has ended well): every member calls every other member over a libp2p
stream authenticated to the remote PeerID, so nobody can send digests in another member's name. A member's digests
are one sha256 per reducer, over the digests of that reducer's parts in order; the caller sends one hash of them
(:func:`combine`), and the callee answers once its all-reduce has ended: with the same hash if its own is equal,
else with its digests per reducer, which name the reducer that sent different bytes (the caller's own answer to
the callee's call carries its digests likewise). So a member sends and receives 32 bytes per message whatever the
group's size, about 4 (N − 1) messages per round, and N digests only towards members whose averages differ. The
first digests of a member to arrive (its call or its answer) count, and a member whose call and answer differ fails
the round. Each member thus hears from every member it can reach.

A member does not commit unless every member it reaches answered with digests equal to its own: an answer that its
all-reduce failed, a refusal, or other digests fail the round. A member it cannot reach at all (the connection
fails, or no answer before the all-reduce's deadline) is left out of the comparison: it died or the network between
them failed. Members that reach each other always compare, so an equivocation between them is always caught.

And a member commits only with a majority: the members that confirmed the same digests, itself included, must be
more than half of the group (two client-mode members, which can never dial each other, do not count each other).
Those members all hold every average, so they all commit these bytes, and the rest, a minority, repair from them.
Without this rule a member cut off right after its all-reduce (a home router down: CI's NAT test) committed the
round alone while the others failed it, and the others, a majority at the round before, then committed a round of
the same number without it: two θ_global for one round until it repaired. The price: in a group of two, a member
whose partner died after the all-reduce fails the round too (it cannot tell a dead partner from a cut link); in
larger groups one death before the checks leaves a majority that commits.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import AsyncIterator, Iterable, Optional, Sequence

from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, P2PDaemonError
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.net.averaging.reducer_checks import describe_equivocations, equivocations

logger = logging.getLogger(__name__)
DIGEST_BYTES = 32
# the call could not reach the member at all (it died, or the network failed): not an answer. A timeout is not
# among them: a member that is slow to answer may be alive, and its digests may differ from ours
UNREACHABLE = (P2PDaemonError, ConnectionError, asyncio.IncompleteReadError)
KEEP_CLOSED = 8  # verifications of groups already over, kept to answer late calls with our digests
CLOSED = "closed"  # a group of ours that is over without a verification (it failed before, or checks are off)
ITS_ALLREDUCE_FAILED = "its all-reduce failed"  # how a member answers when it has no digests: its all-reduce failed


def combine(digests: Sequence[bytes]) -> bytes:
    """One hash of a member's digests per reducer: what a call carries. Members that hold the same averages send
    the same 32 bytes whatever the group's size (the checks cost O(N) bytes per member, not O(N²)); a callee whose
    hash differs answers with its digests per reducer, so both sides can name the reducer that equivocated."""
    return hashlib.sha256(b"".join(digests)).digest()


class MembersLostParts(AllreduceException):
    """The checks failed only because members answered that their own all-reduce failed (they lost a reducer's parts
    to a death): nobody can commit this attempt, since every member that reaches them hears the same (averager.py
    then joins the survivors' retry, survive.py)."""


def part_digest(msg: runtime_pb2.Tensor, attestation: bytes = b"") -> bytes:
    """sha256 of an encoded part as every recipient decodes it: its codec tag, shape and bytes, and the members'
    signed summaries that came with it (attest.py)."""
    h = hashlib.sha256(f"{msg.dtype}|{msg.compression}|{list(msg.size)}|".encode())
    h.update(msg.buffer)
    if attestation:
        h.update(hashlib.sha256(attestation).digest())
    return h.digest()


class ReducerDigests:
    """One running digest per reducer, over the digests of its averaged parts in the order they were registered."""

    def __init__(self, num_reducers: int):
        self._hashes = [hashlib.sha256() for _ in range(num_reducers)]

    def add(self, reducer_index: int, digest: bytes) -> None:
        self._hashes[reducer_index].update(digest)

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self._hashes]


class Verification:
    """What one member knows of one group's digests: its own (once its all-reduce ended), and the others'."""

    def __init__(self, peer_ids: Sequence, names: Sequence[str], me: int, apart: Iterable[int] = ()):
        self.peer_ids, self.names, self.me = list(peer_ids), list(names), me
        self.apart = set(apart) - {me}  # members that can never reach us nor we them (client mode, both)
        self.own: asyncio.Future = asyncio.get_event_loop().create_future()  # our digests, or why we have none
        self.views: dict[int, list[bytes]] = {}  # members' digests per reducer, where they sent them
        self.combined: dict[int, bytes] = {}  # members' hash of those digests (combine): all a call carries
        self.failures: dict[int, str] = {}
        self.lost: set[int] = set()  # members that answered that their all-reduce failed (no digests to compare)
        self.unreached: dict[int, str] = {}  # members we could not reach at all: left out of the comparison
        self.expected = set(range(len(peer_ids))) - {me}
        self.settled = asyncio.Event()
        self.messages, self.bytes = 0, 0  # digest messages sent and received, and their digests' bytes (the cost)
        self.seconds = 0.0  # from our digests known to the verdict

    def count(self, digests: Sequence[bytes]) -> None:
        self.messages += 1
        self.bytes += DIGEST_BYTES * len(digests)

    def record(self, index: int, digests: Sequence[bytes]) -> None:
        """A member's digests: one per reducer (``full``), or their hash alone (what calls carry, :func:`combine`)."""
        digests = list(digests)
        full = len(digests) == len(self.peer_ids) > 1
        if not (full or len(digests) == 1) or any(len(d) != DIGEST_BYTES for d in digests):
            self.fail(index, f"sent {len(digests)} malformed digests")
        elif index in self.combined and self.combined[index] != (combine(digests) if full else digests[0]):
            self.fail(index, "sent two different sets of digests")
        else:
            self.combined.setdefault(index, combine(digests) if full else digests[0])
            if full:
                self.views.setdefault(index, digests)
            self.unreached.pop(index, None)  # it reached us after all
        self.check_settled()

    def fail(self, index: int, reason: str) -> None:
        self.failures.setdefault(index, reason)
        self.check_settled()

    def lost_parts(self, index: int, reason: str) -> None:
        """The member answered that its own all-reduce failed: it has no averages to compare."""
        if index not in self.failures:
            self.lost.add(index)
        self.fail(index, reason)

    def only_lost_parts(self) -> bool:
        """The round fails only because members' all-reduces failed: no equivocation, no other failure."""
        return bool(self.failures) and set(self.failures) <= self.lost and not self._equivocations()

    def unreachable(self, index: int, reason: str) -> None:
        if index not in self.combined and index not in self.failures:
            self.unreached[index] = reason
            self.check_settled()

    def check_settled(self) -> None:
        """Settled: every member answered or is unreachable (and every member whose averages differ from ours sent
        its digests per reducer, which name the culprit), or the round has failed already (no need to wait)."""
        heard = self.expected <= set(self.combined) | set(self.unreached) and not self._unexplained()
        if self.failures or heard or self._equivocations():
            self.settled.set()

    def _own_combined(self) -> Optional[bytes]:
        return combine(self.own.result()) if self.own.done() and self.own.exception() is None else None

    def _unexplained(self) -> list[int]:
        """Members whose hash differs from ours and whose digests per reducer we do not have (yet)."""
        own = self._own_combined()
        return [j for j, c in self.combined.items() if own is not None and c != own and j not in self.views]

    def _equivocations(self) -> dict:
        own = self._own_combined()
        if own is None:
            return {}
        views = {self.names[j]: [d.hex() for d in digests] for j, digests in self.views.items()}
        views.update({self.names[j]: [d.hex() for d in self.own.result()] for j, c in self.combined.items()
                      if c == own})  # the same hash: the same digests
        views[self.names[self.me]] = [d.hex() for d in self.own.result()]
        return equivocations(views, self.names)

    def verdict(self) -> Optional[str]:
        """None if every member we reached sent digests equal to ours; else why the round must fail."""
        found = self._equivocations()
        if found:
            return describe_equivocations(found)
        if self.failures:
            return "; ".join(f"member {self.names[j]} could not verify: {why}" for j, why in self.failures.items())
        missing = self.expected - set(self.combined) - set(self.unreached)
        if missing:
            return f"no part digests from member(s) {sorted(self.names[j] for j in missing)} in time"
        if self._unexplained():
            return (f"member(s) {sorted(self.names[j] for j in self._unexplained())} hold other averages than ours "
                    f"(their digests per reducer did not come in time)")
        electorate = len(self.peer_ids) - len(self.apart)
        confirmed = 1 + len(set(self.combined) - self.apart)
        if 2 * confirmed <= electorate:
            return (f"only {confirmed} of the group's {electorate} members, ourselves included, confirmed these "
                    f"averages: not a majority (could not reach {sorted(self.names[j] for j in self.unreached)})")
        return None


class PartVerifier:
    """Mixin of :class:`~p2p_diloco.net.averaging.CanonicalAverager`: the ``rpc_verify_parts`` handler and
    :meth:`_verify_parts`. Expects ``self._p2p``, ``self.prefix``, ``self._running_groups``, ``self.get_stub``."""

    # hivemind collects a servicer's rpc_* handlers once per class and caches them on it: without these, a class
    # whose parent (DecentralizedAverager) collected first would inherit the parent's list, without ours
    _rpc_handlers = None
    _stub_type = None
    _verifications: dict  # group id -> Verification, or a future of one while a call waits for it to open
    _verify_until: float = 0.0  # time.monotonic() when the all-reduce in progress must be over

    def _open_verification(self, group_info, names: Sequence[str], apart: Iterable[int] = ()) -> Verification:
        v = Verification(group_info.peer_ids, names, group_info.peer_ids.index(self.peer_id), apart)
        waiting = self._verifications.get(group_info.group_id)
        self._verifications[group_info.group_id] = v
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            waiting.set_result(v)  # a call that arrived before we opened it
        return v

    def _close_verification(self, group_id, v: Optional[Verification], error: Optional[BaseException]) -> None:
        """The group's all-reduce is over: calls still waiting for our digests get an answer now."""
        if v is not None and not v.own.done():
            v.own.set_exception(AllreduceException(f"{ITS_ALLREDUCE_FAILED}: {error!r}"[:200]))
            v.own.exception()  # retrieved: no "never retrieved" warning when no call awaited it
        waiting = self._verifications.pop(group_id, None)
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            waiting.set_result(None)  # a call waited for a verification we never opened: it is told so
        # a member that settles later than us still gets our digests (or why we have none) at once
        self._verifications[group_id] = v if v is not None else CLOSED
        for old in [g for g, x in self._verifications.items() if not isinstance(x, asyncio.Future)][:-KEEP_CLOSED]:
            del self._verifications[old]

    async def rpc_verify_parts(self, request: averaging_pb2.MessageFromLeader,
                               context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """A group member sends the digests of the averaged parts it received; we answer with ours. A stream, not a
        unary call: hivemind 1.1.12's client loses its unary-call reader for good when a response arrives for a
        call just cancelled (InvalidStateError in its reader task), and ours are cancelled once a round is settled."""
        yield await self._answer_verify(request, context)

    async def _answer_verify(self, request, context) -> averaging_pb2.MessageFromLeader:
        v = await self._verification_for(request.group_id)
        if v is None:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        if context.remote_id not in v.peer_ids or context.remote_id == self.peer_id:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        v.count(request.gathered)
        v.record(v.peer_ids.index(context.remote_id), list(request.gathered))
        try:
            own = await asyncio.wait_for(asyncio.shield(v.own), timeout=self._verify_deadline())
        except Exception as e:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.INTERNAL_ERROR, suggested_leader=repr(e)[:200]
                                                   .encode())
        # our hash alone when the caller's equals it; else our digests per reducer, which name whoever equivocated
        answer = [combine(own)] if list(request.gathered) == [combine(own)] else own
        v.count(answer)
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, group_id=request.group_id, gathered=answer)

    async def _verification_for(self, group_id) -> Optional[Verification]:
        found = self._verifications.get(group_id)
        if isinstance(found, Verification) or found is CLOSED:
            return found if found is not CLOSED else None
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
        begun = time.monotonic()
        v.own.set_result(own)
        v.check_settled()  # a group of one has nobody to hear from; others may all have called already
        calls = {j: asyncio.create_task(self._call_verify(group_info.group_id, v, j)) for j in sorted(v.expected)}
        try:
            await asyncio.wait_for(v.settled.wait(), timeout=self._verify_deadline())
            # members our call did not reach that reached us since, with averages other than ours: only their digests
            # per reducer name whoever equivocated, so each is asked once more (CI: an honest member's two calls
            # failed at once, the others' calls then brought their hashes alone, and its verdict named nobody)
            again = [j for j in v._unexplained() if calls[j].done()]
            if again:
                recalls = [asyncio.create_task(self._call_verify(group_info.group_id, v, j)) for j in again]
                calls.update(zip(again, recalls))
                await asyncio.wait_for(asyncio.gather(*recalls), timeout=self._verify_deadline())
        except asyncio.TimeoutError:
            pass  # the verdict names who is missing
        finally:
            for call in calls.values():
                call.cancel()
        v.seconds = time.monotonic() - begun
        verdict = v.verdict()
        if v.unreached:
            logger.warning(f"reducer check: left out member(s) we could not reach: "
                           f"{ {v.names[j]: why for j, why in v.unreached.items()} }")
        if verdict is not None:
            failed = MembersLostParts if v.only_lost_parts() else AllreduceException
            raise failed(f"reducer check failed: {verdict}")

    async def _call_verify(self, group_id, v: Verification, j: int) -> None:
        stub = self.get_stub(self._p2p, v.peer_ids[j], namespace=self.prefix)
        stream = None
        try:
            request = averaging_pb2.MessageFromLeader(group_id=group_id, gathered=[combine(v.own.result())])
            stream = await asyncio.wait_for(stub.rpc_verify_parts(request), timeout=self._verify_deadline())
            v.count(request.gathered)
            answer = await asyncio.wait_for(anext(stream), timeout=self._verify_deadline())
            v.count(answer.gathered)
        except (*UNREACHABLE, StopAsyncIteration) as e:  # StopAsyncIteration: the stream closed without an answer
            v.unreachable(j, repr(e)[:200])
            return
        except Exception as e:
            v.fail(j, f"no answer ({e!r})"[:200])
            return
        finally:
            if stream is not None:
                await stream.aclose()
        hear_answer(v, j, answer)


def hear_answer(v: Verification, j: int, answer: averaging_pb2.MessageFromLeader) -> None:
    """Member ``j``'s answer to our call: its digests, or why it has none (its all-reduce failed: lost parts)."""
    if answer.code == averaging_pb2.ACCEPTED:
        v.record(j, list(answer.gathered))
        return
    why = answer.suggested_leader.decode(errors="replace") or averaging_pb2.MessageCode.Name(answer.code)
    if answer.code == averaging_pb2.INTERNAL_ERROR and ITS_ALLREDUCE_FAILED in why:
        v.lost_parts(j, why)
    else:
        v.fail(j, why)
