"""The averager's side of a private run: only members (a valid proof for the connection's PeerID, not revoked) may
join a group, send parts or download state (keys and proofs: access.py; the DHT's side: auth.py).

Where a member's proof travels, always checked against the libp2p-authenticated ``context.remote_id``:
  * ``rpc_join_group``: in the gathered metadata of the join request (``Contribution.proof``); the leader refuses a
    follower without a valid one;
  * the group: before the all-reduce every member checks every other member's gathered proof against the group's
    PeerIDs; one bad proof fails the round on every member (nothing is averaged, nobody commits); the checked members
    are admitted;
  * ``rpc_aggregate_part``: accepted only from admitted members, once this peer checked the group's proofs;
  * ``rpc_download_state``: a joiner first calls ``rpc_admit`` with its proof; donors serve admitted peers only.
A revoked PeerID is refused in all of these, whatever its proof. In an open run (no secret) nothing is checked.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Optional, Sequence

from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter

from p2p_diloco.net.security.access import AccessKeys
from p2p_diloco.net.security.auth import IsRevoked

logger = logging.getLogger(__name__)
ADMIT_TIMEOUT = 10.0  # s for a donor to answer rpc_admit


def contribution_proof(user: bytes) -> str:
    """The membership proof (hex) in a member's gathered Contribution (msgpack); "" if it has none."""
    try:
        proof = MSGPackSerializer.loads(user).get("proof", "")
        return proof if isinstance(proof, str) else ""
    except Exception:  # anything a stranger can send
        return ""


def gathered_proof(gather: bytes) -> bytes:
    """The membership proof inside a join request's gathered metadata ([bandwidth, mode, our msgpack dict])."""
    try:
        _, _, user = MSGPackSerializer.loads(gather)
    except Exception:
        return b""
    return _unhex(contribution_proof(user))


class MemberGate:
    """Mixin for a DecentralizedAverager: refuses non-members in every averaging RPC (see the module docstring)."""

    _access_keys: Optional[AccessKeys] = None
    _revoked: frozenset = frozenset()
    _admitted: Optional[set] = None

    def _init_gate(self, keys: Optional[AccessKeys], revoked: frozenset = frozenset()) -> None:
        self._access_keys, self._revoked, self._admitted = keys, frozenset(revoked), set()
        self._checks_in_flight: set = set()  # futures of revocation checks being awaited (see _is_revoked)

    async def _set_access(self, keys: Optional[AccessKeys], revoked: frozenset) -> None:
        """In the averager's process: a new secret re-checks everyone; a revoked peer is refused from now on."""
        if keys != self._access_keys:
            self._admitted = set()
        self._access_keys, self._revoked = keys, frozenset(revoked)
        self._admitted -= {p for p in self._admitted if p.to_base58() in self._revoked}

    @property
    def own_proof(self) -> str:
        return self._access_keys.proof(self.peer_id.to_bytes()).hex() if self._access_keys else ""

    async def _is_revoked(self, peer: PeerID) -> bool:
        """Revoked, as this process was told at the last round, or as the DHT's process knows now (the heartbeat
        hands revocations to the DHT's process at once, to ours at the start of the next round)."""
        if peer.to_base58() in self._revoked:
            return True
        # Hold the answer's future while we wait: hivemind keeps only a weak reference to it, and the handler that
        # waits on it may be reachable from nothing else, so that the garbage collector destroyed pending handlers
        # with their senders' streams ("Task was destroyed but it is pending!", a lost part, a failed round: several
        # per minute in a private run of 2 members, benchmarks/private-runs.md, 10.3).
        future = None
        try:
            future = self.dht.run_coroutine(IsRevoked(peer.to_base58()), return_future=True)
            self._checks_in_flight.add(future)
            return bool(await future)
        except Exception as e:  # the DHT's process is gone: we are shutting down
            logger.debug(f"revocation check failed: {e!r}")
            return False
        finally:
            self._checks_in_flight.discard(future)

    async def _admit(self, peer: PeerID, proof: bytes, what: str) -> bool:
        """Check ``proof`` for the authenticated ``peer``; remember it if valid. True in an open run."""
        if self._access_keys is None:
            return True
        if await self._is_revoked(peer):
            logger.warning(f"refused {what} from {peer}: revoked")
            return False
        if not self._access_keys.verify(peer.to_bytes(), proof):
            logger.warning(f"refused {what} from {peer}: no valid membership proof")
            return False
        self._admitted.add(peer)
        return True

    async def _is_admitted(self, peer: PeerID, what: str) -> bool:
        if self._access_keys is None:
            return True
        if peer in self._admitted and not await self._is_revoked(peer):
            return True
        logger.warning(f"refused {what} from {peer}: not an admitted member")
        return False

    async def _check_group(self, group_id: bytes, peer_ids: Sequence[PeerID], proofs: Sequence[str]) -> None:
        """Every member's proof, against its PeerID; raise (the round fails everywhere) on the first bad one."""
        for peer, proof in zip(peer_ids, proofs):
            if peer != self.peer_id and not await self._admit(peer, _unhex(proof), "a group"):
                error = AllreduceException(f"group member {peer} is not a member of the run")
                self._fail_waiting_parts(group_id, error)
                raise error

    def _fail_waiting_parts(self, group_id: bytes, error: BaseException) -> None:
        """Our group ends before its all-reduce began: parts already waiting for it (rpc_aggregate_part) are
        answered now. Left waiting, on a future hivemind drops when the group ends, such a handler was reachable from
        nothing and was destroyed by the garbage collector ("Task was destroyed but it is pending!")."""
        future = self._running_groups.get(group_id)
        if future is not None and not future.done():
            future.set_exception(error)
            future.exception()  # retrieved: when no part waited, no "Future exception was never retrieved" in the log

    # ------------------------------------------------------------------------------------------------ RPCs
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admit(context.remote_id, gathered_proof(request.gather), "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        # hivemind's own handler (1.1.12), with the membership check once our group's proofs are checked
        request = await anext(stream)
        if request.group_id not in self._running_groups:
            try:  # hivemind waits without a bound; a private run does not wait for strangers
                await asyncio.wait_for(self._pending_groups_registered.wait(),
                                       ADMIT_TIMEOUT if self._access_keys is not None else None)
            except asyncio.TimeoutError:
                pass
        if request.group_id not in self._running_groups and self._running_groups:
            await self._wait_for_group(request.group_id)  # a retry group a faster survivor started (survive.py)
        future = self._running_groups.get(request.group_id)
        if future is None:
            if self._access_keys is not None:
                logger.warning(f"refused parts from {context.remote_id}: no such group")
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        try:
            group = await future  # resolved once _aggregate_with_group checked every member's proof
        except AllreduceException:  # our group failed before its all-reduce began (_fail_waiting_parts)
            yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
            return
        if not await self._is_admitted(context.remote_id, "parts"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def rpc_admit(self, request: averaging_pb2.JoinRequest,
                        context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """A peer proves membership before downloading state: ``request.gather`` holds its proof (raw bytes). A
        stream of one answer, not a unary call: hivemind 1.1.12's unary-call reader dies for good when an answer
        arrives for a call the caller already cancelled (its timeout), which would wedge the caller's unary calls."""
        ok = await self._admit(context.remote_id, request.gather, "an admission")
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED if ok else averaging_pb2.PROTOCOL_VIOLATION)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._is_admitted(context.remote_id, "a state download"):
            return  # an empty answer: the downloader gets nothing
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _prove_membership(self, stub) -> None:
        """Before downloading state from a donor in a private run: present our proof (rpc_admit)."""
        if self._access_keys is None:
            return
        request = averaging_pb2.JoinRequest(gather=bytes.fromhex(self.own_proof))
        replies = await asyncio.wait_for(stub.rpc_admit(request), timeout=ADMIT_TIMEOUT)
        codes = [reply.code async for reply in aiter_with_timeout(replies, timeout=ADMIT_TIMEOUT)]
        if codes != [averaging_pb2.ACCEPTED]:
            raise AllreduceException("the donor refused our membership proof")


def _unhex(text) -> bytes:
    try:
        return bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        return b""
