"""Rounds that survive a member's death (issue 23, item 2): the survivors of a failed all-reduce run it again at
once, among themselves, within the same round attempt.

Why it is safe. A member that dies before or while sending makes every reducer refuse every sender (a partial
average is never served, net/averaging/allreduce.py), so no member completes the first attempt. Each survivor then
waits for the network to show the death (the dead process's connections close: its p2pd dies with it), and keeps the
members it is still connected to (or, below, reaches again), in the group's order. The retry's group id is derived from the first group's id
and the kept members: a survivor whose view differs computes another id, its parts are refused as parts of an
unknown group, and that retry fails everywhere, as the first attempt did. Every survivor restores its own
contribution (the first attempt overwrote its buffers with averaged parts it received) and the retry is an ordinary
all-reduce of the kept members, with the quorum, weights, screening and reducer checks of any round: a dead member's
contribution is in on every survivor or on none.

A member that did complete the first attempt (it had every average before a reducer died) is alive and connected,
so it is kept. If its reducer checks then fail only because members answer that their own all-reduce failed
(verify.py ``MembersLostParts``), nobody commits the attempt (a member commits only when every member it reaches
confirmed the same averages), so it joins the retry with its own contribution restored, like the others (a 12-peer
swarm with a reducer killed mid-serving failed that round on all 11 survivors before). If its checks pass (it could
not reach the members that lost parts, and a majority confirmed), it commits and takes part in no retry: the retry
fails for lack of its parts, and the others repair from the round it committed.

Under load a survivor also loses its connections to members that are alive (32 peers on 2 cores: 4 of 30 survivors
kept 28 to 30 of the 31 members left, their retries had other ids, and the retry failed on all 30,
benchmarks/scale.md): it dials the members it is no longer connected to, and keeps those that answer within
:data:`PING_S` (a dead member's port is closed: the dial fails at once, or the ping times out).

A stalled member (frozen: no FIN, no RST) stays connected, and the attempt fails only when its parts' timeout passes
(``averaging.next_chunk_timeout``). Each survivor then pings the members it is still connected to, over its own
averager's connections (:meth:`Survivor.rpc_ping`, :data:`PING_S` at most): a frozen machine answers nothing (its
p2pd is frozen with it), and the member is left out of the retry like a dead one. Only silence leaves a member out:
an error is an answer, or our own network's failure, and leaves nobody out. An alive member too slow to answer within
:data:`PING_S` is left out by some survivors and not others: their retries have different ids and fail, as the first
attempt did.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import AsyncIterator, Optional, Sequence

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

logger = logging.getLogger(__name__)

SETTLE_S = 1.0  # how long a survivor lets the network show a death (closed connections) before it looks
PING_S = 2.0  # how long a member still connected has to answer a survivor's ping (a frozen one never does)
GROUP_WAIT_S = 10.0  # how long a part waits for its retry group to be registered by this member
ABANDONED = "matchmaking abandoned"  # an attempt whose matchmaking the host ended: nothing was sent (seam.py)


def retry_group_id(first_id: bytes, kept: Sequence) -> bytes:
    """The same on every survivor with the same view; another view, another id."""
    digest = hashlib.sha256(first_id + b"".join(p.to_bytes() for p in kept)).digest()
    return digest[:len(first_id)] if first_id else digest


def retry_spread(next_chunk_timeout: float) -> float:
    """How much later than the first survivor the last may start the retry: one whose connection to the dead member
    closed learns of the death at once, one that waits for the dead member's parts only when their timeout
    (``next_chunk_timeout``) passes; then each settles and pings (:data:`SETTLE_S`, :data:`PING_S`). Seen in CI
    (a member behind a failed router): one survivor started 7 s before the other two, its reducer gave up on their
    parts at the chunk timeout, and the retry failed on all three."""
    return next_chunk_timeout + SETTLE_S + PING_S


def retry_timeouts(kwargs: dict, next_chunk_timeout: float) -> dict:
    """The all-reduce's keyword arguments for a retry: the reducers wait for the senders' parts, and the senders
    for the reducers' averages, longer by :func:`retry_spread` (a member truly dead in the retry costs it that)."""
    spread = retry_spread(next_chunk_timeout)
    return {**kwargs, **{k: kwargs[k] + spread for k in ("sender_timeout", "reducer_timeout") if kwargs.get(k)}}


def kept_members(peer_ids: Sequence, me, connected: set) -> list[int]:
    """Indices of the members a survivor keeps: itself and those it still reaches (``connected``), in the group's
    order."""
    return [i for i, p in enumerate(peer_ids) if p == me or p in connected]


class Survivor:
    """Mixin for the averager (net/averaging/averager.py). Expects ``self._p2p``, ``self.peer_id``,
    ``self._running_groups``, ``self._matchmaking`` and a ``self._survive`` flag (``averaging.survive_losses``)."""

    _groups_changed: Optional[asyncio.Condition] = None

    def _conditions(self) -> asyncio.Condition:
        if self._groups_changed is None:
            self._groups_changed = asyncio.Condition()
        return self._groups_changed

    async def _survivors(self, group_info: GroupInfo) -> Optional[tuple[GroupInfo, list[int]]]:
        """After a failed all-reduce: the retry group of the members still here, or None (nobody is gone, or fewer
        than two are left)."""
        await asyncio.sleep(SETTLE_S)  # no event tells us a remote process died: its closed connections do
        listed = {info.peer_id for info in await self._p2p.list_peers()}
        others = [p for p in group_info.peer_ids if p != self.peer_id]
        connected, redialed = await asyncio.gather(self._answering([p for p in others if p in listed]),
                                                   self._answering([p for p in others if p not in listed], dial=True))
        keep = kept_members(group_info.peer_ids, self.peer_id, connected | redialed)
        if len(keep) == len(group_info.peer_ids) or len(keep) < 2:
            return None
        kept = [group_info.peer_ids[i] for i in keep]
        retry = GroupInfo(retry_group_id(group_info.group_id, kept), tuple(kept),
                          tuple(group_info.gathered[i] for i in keep))
        return retry, keep

    async def _answering(self, peers: Sequence, dial: bool = False) -> set:
        """Those of ``peers`` that answer a ping within :data:`PING_S`, all at once; any error counts as an answer
        (a member we are connected to), except with ``dial`` (members we lost our connection to: only an answer
        keeps them, a failed dial is a dead member's closed port)."""
        async def ping(peer) -> None:
            stream = await self.get_stub(self._p2p, peer, namespace=self.prefix).rpc_ping(
                averaging_pb2.MessageFromLeader())
            try:
                await anext(stream)
            finally:
                await stream.aclose()

        async def answers(peer) -> bool:
            try:
                await asyncio.wait_for(ping(peer), PING_S)
            except asyncio.TimeoutError:
                return False
            except Exception as e:  # noqa: BLE001 - refused, or our own p2pd gone: not a frozen member either way
                logger.debug(f"ping {peer}: {e!r}")
                return not dial
            return True

        answered = await asyncio.gather(*(answers(p) for p in peers))
        return {p for p, ok in zip(peers, answered) if ok}

    async def rpc_ping(self, request: averaging_pb2.MessageFromLeader,
                       context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """A survivor asks whether we are frozen (above): any answer says no. A stream, as ``rpc_verify_parts``."""
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)

    @contextlib.asynccontextmanager
    async def _registered(self, group_info: GroupInfo):
        """Serve parts of the retry group while it runs (hivemind registers only the group it formed)."""
        self._running_groups[group_info.group_id] = asyncio.get_running_loop().create_future()
        async with self._conditions():
            self._conditions().notify_all()
        try:
            yield
        finally:
            self._running_groups.pop(group_info.group_id, None)

    async def _wait_for_group(self, group_id: bytes, timeout: float = GROUP_WAIT_S) -> None:
        """A part arrived for a group we have not registered (yet): a retry group a faster survivor started. Not
        longer than :data:`GROUP_WAIT_S`, whatever :func:`retry_spread` is: anyone may send parts for any group id,
        and an outsider's parts in a private run are answered BAD_GROUP_ID within its call's timeout (test_private;
        waiting a retry's spread there made the answer a TimeoutError)."""
        condition = self._conditions()
        with contextlib.suppress(asyncio.TimeoutError):
            async with condition:
                await asyncio.wait_for(condition.wait_for(lambda: group_id in self._running_groups), timeout)

    async def _abandon_matchmaking(self, reason: str) -> None:
        """The host found the leader we wait for dead (net/averaging/seam.py ``PendingAverage``): end our step's
        matchmaking now, unless a group holds us already. In this process's event loop, so nothing changes between
        the check and the cancel: a follower that has joined a leader, a leader with followers, or a group already
        assembled go on as they are (the others count on our parts); otherwise no member's all-reduce can hold us."""
        matchmaking = self._matchmaking
        step = matchmaking.step_control
        if step is None or step.done() or matchmaking.current_leader is not None or matchmaking.current_followers \
                or matchmaking.assembled_group.done():
            return
        logger.debug(f"{ABANDONED}: {reason}")
        # what hivemind's matchmaking waits for: it ends now with this error, as the step does (the step's own cancel
        # would not do: hivemind refuses to cancel a step that is running, and the host could no longer cancel it)
        matchmaking.assembled_group.set_exception(MatchmakingException(f"{ABANDONED}: {reason}"))
