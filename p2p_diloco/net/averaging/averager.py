"""The only user of hivemind's averager: a canonical, all-or-nothing butterfly all-reduce of pseudo-gradients.

Why not hivemind's stock all-reduce (HIVEMIND.md, facts 1 and 2):
  * its reducer sends each sender ``lossy(avg - that sender's part)``, which the sender adds to its own tensor, so every
    peer ends with different bytes; and
  * when a reducer dies its part silently keeps each peer's own values, and a failed sender is dropped from the parts
    it had not sent yet, so parts end up averaged over different peers, all reported as success.

What we do instead, keeping hivemind's matchmaking, transport and part streaming:
  * each reducer encodes the average of its part once (with the run's codec) and streams *those bytes* to every sender;
    every peer, the reducer included, decodes the same bytes, so all peers hold bit-identical results;
  * a reducer that loses any sender stops serving results at once (it would otherwise average later parts over
    fewer peers); and
  * a peer that misses any part from any reducer fails the round: a partial average is never applied.
Before the all-reduce, every member sees the same gathered metadata (round, θ_global digest, tokens) and derives the
same set of participants: members whose (round, digest) is not the group's majority contribute with weight 0, and
so do members that most others name as suspects (screening.py: a reducer refused a malformed contribution of theirs
in an earlier round). The weight each participant sends, and each reducer expects, is derived from that same list.

We subclass ``AllReduceRunner`` and override ``DecentralizedAverager._aggregate_with_group`` /
``_run_allreduce_inplace_``, which are private: hivemind is pinned to exactly 1.1.12 for this reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.net import dht as _dht  # noqa: F401  (imported first for its torch sharing-strategy setting)
from p2p_diloco.net import handlers as _handlers  # noqa: F401  (incoming streams' handlers held until they end)
from p2p_diloco.net.averaging.aggregators import Aggregator
from p2p_diloco.net.averaging.allreduce import CanonicalAllReduceRunner
from p2p_diloco.net.security.gate import MemberGate, contribution_proof
from p2p_diloco.net.security.records import PeerSignatureValidator
from p2p_diloco.net.averaging.screening import accused, member_weights, sane_contribution
from p2p_diloco.net.averaging.reducer_checks import capped_fractions, sane_bandwidths
from p2p_diloco.net.averaging.verify import MembersLostParts, PartVerifier
from p2p_diloco.net.averaging.survive import Survivor, retry_timeouts
from p2p_diloco.net.averaging.state_pipe import StateBudget, StatePipe, send_tensors, tensor_specs
from p2p_diloco.errors import first_line
from p2p_diloco.net.averaging.wire import WireCodec
from p2p_diloco.ops.procs import become_child_process, end_hard

from p2p_diloco.net.averaging.contribution import Contribution, choose_participants, count_quorum


logger = logging.getLogger(__name__)

VERDICTS_S = 3.0  # the most a round failed on a refusal waits for our reducer to judge the senders it is screening


class NoQuorum(AllreduceException):
    """The group holds at most half of the run's peers at its round (net/consensus.py has_quorum): it does not
    commit, so that no other group's θ_global of the same round is contradicted."""


class MalformedRound(Exception):
    """A reducer refused a member's contribution: the round fails on every member, the culprits are named."""

    def __init__(self, culprits: dict):
        self.culprits = culprits  # peer id (base58) -> why
        super().__init__("; ".join(f"{p}: {why}" for p, why in culprits.items()))


class CanonicalAverager(MemberGate, PartVerifier, Survivor, DecentralizedAverager):
    """DecentralizedAverager running :class:`CanonicalAllReduceRunner`; its process dies with its parent. In a
    private run (``access_keys``) it serves members only (net/security/gate.py). With ``verify_parts``, members compare the
    digests of the averaged parts they received before a round counts (net/averaging/verify.py); ``max_share`` caps the share
    of the vector one member reduces (net/averaging/reducer_checks.py)."""

    _rpc_handlers = None  # collect our own rpc_* methods (rpc_admit), not a list inherited from the parent class

    def __init__(self, *args, codec: WireCodec, average_codec: WireCodec, min_participants: int, fault=None,
                 aggregator: Aggregator = Aggregator(), weight_by_tokens: bool = True, max_weight_ratio: float = 8.0,
                 attack=None, access_keys=None, revoked: frozenset = frozenset(), verify_parts: bool = False,
                 max_share: float = float("inf"), equivocate_from: Optional[int] = None, survive_losses: bool = False,
                 **kwargs):
        self._init_gate(access_keys, revoked)
        self._average_codec = average_codec
        self._min_participants = min_participants
        self._fault = fault
        self._aggregator, self._attack = aggregator, attack
        self._weight_by_tokens, self._max_weight_ratio = weight_by_tokens, max_weight_ratio
        self._verify_parts_on, self._max_share, self._equivocate_from = verify_parts, max_share, equivocate_from
        self._verifications = {}
        self._signer = _identity_of(args[1] if len(args) > 1 else kwargs.get("dht"))  # signs our parts
        self._survive, self._reduced = survive_losses, False
        self._quorum: list[str] = []  # the peer ids that committed our θ_global's round (set before each step)
        self.state_provider = None  # set in the host process: () -> (metadata dict, tensors)
        self._state_pipe, self._state_lock = StatePipe(), None  # what we serve, from the host (state_pipe.py)
        super().__init__(*args, compression=codec, **kwargs)
        self._state_pipe.in_host(self._state_for_pipe)

    def run(self):
        become_child_process()
        self._state_pipe.in_child()
        super().run()

    def terminate(self) -> None:
        end_hard(self)  # hivemind's fallback when shutdown() timed out: this process ignores SIGTERM

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind 1.1.12 ends the averager's process without closing its client of the DHT's p2pd, which leaves
        that client's socket (/tmp/hivemind-p2pclient-*.sock) behind after every run: close it too. Only the
        client: the daemon belongs to the DHT's process."""
        try:
            await super()._shutdown(timeout)
        finally:
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()

    async def _aggregate_with_group(self, group_info, min_vector_size: int, weight: float, **kwargs):
        self._verify_until = time.monotonic() + self._allreduce_timeout - 1.0  # inside the step's own deadline
        first = group_info
        try:
            gathered = [self.serializer.loads(g) for g in group_info.gathered]
            await self._check_group(group_info.group_id, group_info.peer_ids, [contribution_proof(g[2]) for g in gathered])
            snapshot = await self._snapshot() if self._survive else None
            try:
                return await self._attempt(group_info, gathered, min_vector_size, kwargs)
            except AllreduceException as e:  # a member died before the all-reduce completed anywhere: run it again
                # with every average here, only if the checks failed on members that lost parts (verify.py): then
                # nobody commits this attempt, and the survivors' retry needs our parts too
                done_here = self._reduced and not isinstance(e, MembersLostParts)
                retry = None if snapshot is None or done_here or isinstance(e, NoQuorum) \
                    else await self._survivors(group_info)
                if retry is None:
                    raise
                group_info, keep = retry
                lost = [str(first.peer_ids[i]) for i in range(len(first.peer_ids)) if i not in keep]
                logger.warning(f"all-reduce failed ({first_line(e)}); {len(keep)} members left, without "
                               f"{', '.join(p[-6:] for p in lost)}: running it again among them")
            self._fail_waiting_parts(first.group_id, AllreduceException("the group runs again without its dead"))
            await self._restore(snapshot)
            async with self._registered(group_info):  # the others may start it up to retry_spread after us
                result = await self._attempt(group_info, [gathered[i] for i in keep], min_vector_size,
                                             retry_timeouts(kwargs, self.next_chunk_timeout or 0.0))
            return dict(result, survived=lost)
        except BaseException as e:
            for group in {first.group_id, group_info.group_id}:
                self._fail_waiting_parts(group, AllreduceException(f"the group failed: {e!r}"))
            raise MatchmakingException(f"all-reduce failed: {e!r}") from None

    async def _attempt(self, group_info, gathered, min_vector_size: int, kwargs) -> dict:
        """One all-reduce of ``group_info``'s members (``gathered``: each member's (bandwidth, mode, contribution)),
        with the quorum rule, weights, screening and reducer checks of a round."""
        verification, error, self._reduced = None, None, False
        try:
            bandwidths, mode_ids, contributions = zip(*gathered)
            contributions = [self._contribution(g) for g in contributions]
            peer_ids = [str(p) for p in group_info.peer_ids]
            members = choose_participants(contributions, peer_ids)
            weights = member_weights([c.tokens for c in contributions], members, self._weight_by_tokens,
                                     self._max_weight_ratio)
            me = group_info.peer_ids.index(self.peer_id)
            summary = dict(members=[contributions[i].name for i in members], member_of=me in members,
                           tokens=sum(contributions[i].tokens for i in members),
                           group_round=contributions[members[0]].round if members else None,
                           speeds=[c.steps_per_s for c in contributions],
                           quorum=[peer_ids[i] for i in members])  # who commits: the next round's quorum group
            if len(members) < self._min_participants:
                raise AllreduceException(f"only {len(members)} of {len(contributions)} members agree on θ_global")
            quorum = count_quorum(contributions, peer_ids, me, self._quorum)
            if not quorum.ok:  # another group may hold the majority: it alone commits this round
                raise NoQuorum(quorum.why_not(len(contributions), summary["group_round"]))
            left_out = accused(peer_ids, [c.suspects for c in contributions])  # they reduce nothing either
            download_bandwidths = [b if AveragingMode(m) != AveragingMode.CLIENT and i not in left_out else 0.0
                                   for i, (b, m) in enumerate(zip(bandwidths, mode_ids))]
            peer_fractions = await self._reducer_fractions(download_bandwidths, min_vector_size)
            if self._verify_parts_on:  # members are named with the end of their (authenticated) peer id
                labels = [f"{c.name} (…{p[-6:]})" for c, p in zip(contributions, peer_ids)]
                clients = {i for i, m in enumerate(mode_ids) if AveragingMode(m) == AveragingMode.CLIENT}
                verification = self._open_verification(group_info, labels, clients if me in clients else ())
            started = time.monotonic()
            try:
                stats = await self._allreduce_round(group_info, contributions[me].round + 1,
                                                    peer_fractions=peer_fractions, weights=weights, **kwargs)
            except MalformedRound as e:  # every member fails this round and learns whom to leave out
                stats = _malformed_summary(e.culprits, contributions, peer_ids)
            digests = stats.pop("digests", None)
            self._reduced = True  # every average arrived here: others may commit this group's round
            if self._fault is not None and self._fault.due("checks", contributions[me].round + 1):
                self._fault.strike()  # every average arrived; the members have not compared them yet
            if verification is not None and digests is not None:  # a failed round is never committed
                await self._verify_parts(group_info, verification, digests)
            checks = {} if verification is None else dict(check_s=verification.seconds, check_bytes=verification.bytes,
                                                          check_messages=verification.messages)
            return dict(summary, allreduce_seconds=time.monotonic() - started, **stats, **checks)
        except BaseException as e:
            error = e
            raise
        finally:
            self._close_verification(group_info.group_id, verification, error)

    async def _snapshot(self) -> list:
        """Our contribution as it enters the all-reduce (which overwrites the buffers with what it receives)."""
        async with enter_asynchronously(self.get_tensors()) as tensors:
            return [t.clone() for t in tensors]

    async def _restore(self, snapshot: list) -> None:
        async with enter_asynchronously(self.get_tensors()) as tensors:
            for t, saved in zip(tensors, snapshot):
                t.copy_(saved)

    async def _reducer_fractions(self, download_bandwidths, min_vector_size: int) -> list[float]:
        """The share of the vector each member reduces: hivemind's load balancing of the declared bandwidths (not
        a finite number >= 0: undeclared), capped at ``max_share`` x an equal share (net/averaging/reducer_checks.py)."""
        download = sane_bandwidths(download_bandwidths)
        sizes = await asyncio.get_event_loop().run_in_executor(
            None, load_balance_peers, self.total_size, download, min_vector_size)
        return capped_fractions(sizes, [b != 0.0 for b in download], self._max_share)

    async def _allreduce_round(self, group_info, round_: int, weights: list, **kwargs) -> dict:
        """The all-reduce of our buffers, with the test-only faults and attacks due in ``round_``."""
        fault = self._fault if self._fault and any(self._fault.due(phase, round_) for phase in ("sending", "allreduce")) \
            else None
        attack = self._attack if self._attack is not None and self._attack.due(round_) else None
        equivocate = self._equivocate_from is not None and round_ >= self._equivocate_from
        me = group_info.peer_ids.index(self.peer_id)
        async with enter_asynchronously(self.get_tensors()) as local_tensors:
            if self._attack is not None:
                self._attack.on_tensors(local_tensors, round_)
            return await self._run_allreduce_inplace_(
                local_tensors, group_info, weight=weights[me], weights=weights, aggregator=self._aggregator,
                attack=attack, fault=fault, equivocate=equivocate, identity=self._signer, **kwargs)

    def _contribution(self, gathered) -> Contribution:
        """A member's gathered record; one that is not a well-formed contribution counts as one with no tokens."""
        try:
            raw = self.serializer.loads(gathered)
        except Exception:  # noqa: BLE001 - anything a member can send
            raw = None
        return Contribution(**sane_contribution(raw))

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = CanonicalAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, average_codec=self._average_codec, **kwargs)
        self._running_groups[group_id].set_result(runner)
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)  # copy, not add: every peer ends with the same decoded bytes
        except Exception:
            if not runner.malformed:
                raise
        if runner.malformed:
            await runner.verdicts(VERDICTS_S)  # our reducer's own verdicts on senders still being screened
            raise MalformedRound({str(p): why for p, why in runner.malformed.items()})
        if runner.failed_reducers or runner.tensor_part_container.failed_size:
            raise AllreduceException(f"lost parts of reducer(s) {sorted(map(str, runner.failed_reducers))}")
        return dict(bytes_sent=runner.bytes_sent, bytes_received=runner.bytes_received,
                    reducer_bytes=runner.reducer_peak_bytes, digests=runner.part_digests.digests())

    # ------------------------------------------------------------------------------------------ state for joiners
    def get_current_state(self):
        """Runs in the host process (the state pipe's thread): a consistent snapshot of θ_global and momentum."""
        if self.state_provider is None:
            raise RuntimeError("no state to serve yet")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    def _state_for_pipe(self) -> tuple[bytes, list]:
        metadata, tensors, _ = self.get_current_state()
        return self.serializer.dumps(metadata), tensors

    async def _get_current_state_from_host_process(self):
        """In this process, for rpc_download_state: the host's snapshot through our own pipe, not hivemind's
        MPFuture, whose shared-memory copies outlived every transfer (state_pipe.py)."""
        if self._state_lock is None:
            self._state_lock = asyncio.Lock()
        async with self._state_lock:
            metadata, tensors = await asyncio.get_event_loop().run_in_executor(None, self._state_pipe.fetch)
        return metadata, tensors, None

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        served = 0
        async for message in super().rpc_download_state(request, context):
            yield message
            served += 1
            if self._fault is not None and served == 1 and self._fault.phase == "serving":
                self._fault.strike()  # armed from the round it names on: see Averager.serve_state

    async def _download_state(self, future, donors: list, timeout: float, sink=None):
        """Try ``donors`` (base58 peer ids) in order; resolve ``future`` with (metadata, tensor specs, donor) and
        write the tensors into ``sink`` (a pipe's end: no shared memory left behind, state_pipe.py), or resolve it
        with None."""
        try:
            for donor in donors:
                try:
                    result = await asyncio.wait_for(self._download_from(PeerID.from_base58(donor)), timeout)
                except Exception as e:
                    logger.warning(f"state download from {donor} failed: {e!r}")
                    continue
                if result is not None:
                    metadata, tensors = result
                    future.set_result((metadata, tensor_specs(tensors), donor))
                    del result
                    await asyncio.get_event_loop().run_in_executor(None, send_tensors, sink, tensors)
                    return
            future.set_result(None)
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            elif not isinstance(e, (OSError, EOFError)):  # the host stopped reading: nothing more to tell it
                raise
        finally:
            if sink is not None:
                sink.close()

    async def _download_from(self, donor):
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        await self._prove_membership(stub)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors = None, [], []
        budget = StateBudget(self._averaged_tensors)
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            if self._fault is not None and self._fault.phase == "download" and metadata is None:
                self._fault.strike()  # tests: mid-transfer, on the joiner's side (test_stop.py)
            budget.take(message)  # raises past the size this model's state can have: the donor is dropped
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata is not None else None

    async def _set_deadlines(self, allreduce_timeout: float, next_chunk_timeout: float, matchmaking_time: float):
        self._allreduce_timeout = allreduce_timeout
        self.next_chunk_timeout = next_chunk_timeout
        self.allreduce_kwargs.update(sender_timeout=next_chunk_timeout, reducer_timeout=2 * next_chunk_timeout)
        self._matchmaking.min_matchmaking_time = matchmaking_time
        self._matchmaking.potential_leaders.min_matchmaking_time = matchmaking_time

    async def _arm_fault(self, fault):
        self._fault = fault

    async def _set_quorum(self, quorum: list):
        """The peer ids of the group that committed the round of the θ_global we contribute against
        (net/averaging/contribution.py count_quorum): sent by the host before the step that needs it."""
        self._quorum = list(quorum)

    async def _set_leading(self, leading: bool):
        """This round, lead a group (declare ourselves in the DHT and accept joiners) or only ask the declared
        leader to join its group: hivemind's matchmaking takes a peer that does not declare for a client. A
        follower answers a join request NOT_LOOKING_FOR_GROUP (hivemind's answer for a client would be
        PROTOCOL_VIOLATION, as if the asker had misbehaved)."""
        matchmaking = self._matchmaking
        if not hasattr(matchmaking, "_reasons_to_reject"):
            matchmaking._reasons_to_reject = matchmaking._check_reasons_to_reject

            def check(request, context):
                if matchmaking.following:
                    return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
                return matchmaking._reasons_to_reject(request, context)

            matchmaking._check_reasons_to_reject = check
        matchmaking.following = not leading
        matchmaking.client_mode = self.client_mode or not leading

    async def _set_target_group_size(self, size: int):
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size
        # hivemind 1.1.12 draws each member's next group-key bits from target_group_size buckets after a group forms
        # (key_manager.update_key_on_group_assembled): a group larger than that fails with "Sample larger than
        # population" in every member. We use no key bits (one key per run), so let it size the draw by the group.
        self._matchmaking.group_key_manager.target_group_size = None


def _identity_of(dht):
    """The libp2p identity our DHT node runs with (net/security/records.py keeps it in its record validator), or None
    for a DHT started otherwise (then our parts go unsigned, and a reducer can show no evidence against us)."""
    validators = getattr(getattr(dht, "_record_validator", None), "_validators", ())
    return next((v.identity for v in validators if isinstance(v, PeerSignatureValidator)), None)


def _malformed_summary(culprits: dict, contributions, peer_ids) -> dict:
    """A round failed on a malformed contribution: who sent what, for the result and its error text."""
    malformed = {p: (contributions[peer_ids.index(p)].name if p in peer_ids else "?", why)
                 for p, why in culprits.items()}
    return dict(malformed=malformed, error="round failed, malformed contribution refused: " +
                "; ".join(f"{name} ({p}): {why}" for p, (name, why) in malformed.items()))
