"""The canonical butterfly all-reduce: reducers stream the encoded average itself; any lost part fails the run.

hivemind's stock ``AllReduceRunner`` sends each sender ``lossy(avg - its part)`` and keeps a peer's own values for a
lost reducer's part (HIVEMIND.md, facts 1 and 2). Here senders encode their parts with the run's codec (wire.py), a
reducer decodes and accumulates them in fp32, encodes the average of each of its parts once, and every recipient
(the reducer included) decodes those same bytes; a reducer's own contribution enters its average as its recipients
would decode it, so the average does not depend on who reduced which part. A reducer that loses a sender stops
serving; a peer that misses any part records the reducer as failed. See averaging.py for how a round is judged.

Screening (screening.py): a reducer checks every part it receives (decodable, the shape due, finite, the weight every
member derived from the gathered tokens). A bad part makes it stop serving every sender with a PROTOCOL_VIOLATION
that names the culprit (in the message's ``peer_id``) and carries the evidence: the part as the culprit signed it
(evidence.py). The round fails on every member, nothing partial is applied, and each member judges the evidence
itself to learn whom to leave out next: the culprit if the evidence holds, else the reducer that accused it. Parts of members whose
weight is 0 (not participants) are not even decoded: an excluded member cannot fail the round by what it sends.
With a robust ``aggregator`` (aggregators.py) the reducer holds every sender's copy of a part, then combines them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor

from p2p_diloco.net.averaging.aggregators import Aggregator
from p2p_diloco.net.averaging.attest import Attesting, unseal
from p2p_diloco.net.averaging.attacks import ReducerAttacks
from p2p_diloco.net.averaging.evidence import Accusation, judge
from p2p_diloco.net.averaging.holding import HoldingPartReducer
from p2p_diloco.net.averaging.screening import part_problem
from p2p_diloco.net.averaging.verify import ReducerDigests, part_digest
from p2p_diloco.net.averaging.wire import WireCodec, decode_part

logger = logging.getLogger(__name__)


class ReducerRefused(AllreduceException):
    """A reducer that is alive refused a sender's contribution, or sent an average its attestation disowns: the round
    fails everywhere on that evidence, but no member is lost, so our own reducer goes on judging its senders (every
    culprit it finds is named in this round, not one more round later)."""


class CanonicalAllReduceRunner(Attesting, ReducerAttacks, AllReduceRunner):
    """Butterfly all-reduce whose reducers stream the encoded average itself; any lost part fails the whole run."""

    def __init__(self, *, average_codec: WireCodec, fault=None, weights=None, aggregator: Aggregator = Aggregator(),
                 attack=None, equivocate: bool = False, identity=None, **kwargs):
        super().__init__(**kwargs)
        self.identity = identity  # our libp2p key: we sign each part we send (evidence.py); None: unsigned (benchmarks)
        self.evidence: dict = {}  # PeerID -> (part index, its message) that we refused, shown with our refusal
        self.sign_seconds = 0.0  # time spent signing our parts
        # the weight each sender must send (screening.member_weights); None: trust the message (benchmarks' callers)
        self.weights = dict(zip(self.ordered_peer_ids, weights)) if weights is not None else None
        self.attack = attack  # faults.Attack acting on what we send (tests): shape, weight
        self.malformed: dict = {}  # PeerID -> why its contribution was refused (by us, or by a reducer that told us)
        self.refused: dict = {}  # PeerID -> why: the senders our reducer refused itself (the only ones it accuses)
        self.aggregator = aggregator
        if aggregator.holds_parts:
            self.tensor_part_reducer = HoldingPartReducer(self.tensor_part_reducer.part_shapes,
                                                          len(self.sender_peer_ids), aggregator)
        self.codec: WireCodec = kwargs["compression"]  # senders' parts (it records error-feedback residuals)
        self.average_codec = average_codec  # the averages reducers send back
        self.fault = fault  # faults.Fault to strike once this reducer has streamed an averaged part (tests)
        self.equivocate = equivocate  # fault.attack=equivocate: other averaged bytes to every other sender (tests)
        self.tensor_part_container.return_deltas = False
        self.failed_reducers: set = set()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._encoded_averages: dict[int, asyncio.Future] = {}
        self._parts_received = [0] * len(self.ordered_peer_ids)  # averaged parts registered, by reducer index
        self.part_digests = ReducerDigests(len(self.ordered_peer_ids))  # what we received, for reducer checks
        own = self.tensor_part_container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        self._own_infos = [info for _, info in own]  # where each of our parts lies in its tensor
        # the part shapes each reducer screens against, the same on every member: to judge a refusal's evidence
        self._part_shapes = [tuple(part.shape for part, _ in parts)
                             for parts in self.tensor_part_container._input_parts_by_peer]
        self._init_attesting()  # signed part summaries; averages checked against them (attest.py)
        self._unjudged = 0  # senders' streams whose first part our reducer has not judged yet
        self._all_judged = asyncio.Event()
        self._all_judged.set()

    def _judging(self, streams: int) -> None:
        self._unjudged += streams
        (self._all_judged.set if self._unjudged == 0 else self._all_judged.clear)()

    async def verdicts(self, timeout: float) -> None:
        """Wait, at most ``timeout`` s, until our reducer has judged the first part of every sender's stream it holds:
        a round that fails on another reducer's refusal fails here at once, while our reducer may still be screening
        a culprit of its own; its verdict then joins ``malformed`` (named in this round, and left out from the next)
        instead of being lost."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._all_judged.wait(), timeout)

    async def _encode_average(self, part_index: int, averaged: torch.Tensor):
        """Encode the average of one of our parts once; every recipient (us included) gets these same bytes."""
        if part_index not in self._encoded_averages:
            if self.attack is not None:
                averaged = self.attack.on_average(averaged)  # fault.attack=skew_reduce: a wrong average (tests)
            self._encoded_averages[part_index] = asyncio.get_event_loop().run_in_executor(
                None, self.average_codec.compress, averaged, self._own_infos[part_index])
        return await self._encoded_averages[part_index]

    @property
    def reducer_peak_bytes(self) -> int:
        """The most bytes our reducer held at once to combine a part: its accumulator, or every sender's copy."""
        reducer = self.tensor_part_reducer
        if isinstance(reducer, HoldingPartReducer):
            return reducer.peak_bytes
        return 4 * max((shape.numel() for shape in reducer.part_shapes), default=0)

    def _expected_weight(self, peer_id, sent: float) -> float:
        return sent if self.weights is None else self.weights[peer_id]

    def _refusal(self) -> averaging_pb2.AveragingData:
        """What a reducer that stops serving sends: if a sender was malformed, the culprit, and as evidence the part
        it refused with the culprit's signature (evidence.py); a reducer refusing its own part shows none."""
        if not self.refused:  # what other reducers or members told us is theirs to show, not ours
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        peer, why = next(iter(self.refused.items()))
        part_index, msg = self.evidence.get(peer, (-1, averaging_pb2.AveragingData()))
        signature, summary, key = unseal(msg.peer_id) or (b"", b"", b"")
        accusation = Accusation(why, part_index, signature, key, summary)
        return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION, peer_id=peer.to_bytes(),
                                           group_id=accusation.encode(), tensor_part=msg.tensor_part,
                                           weight=msg.weight)

    async def _refuse_sender(self, sender_index: int, why: str, part_index: int = -1, msg=None) -> None:
        peer = self.sender_peer_ids[sender_index]
        logger.warning(f"reducer: sender {peer} sent a malformed contribution: {why}; failing the round")
        self.malformed.setdefault(peer, why)
        self.refused.setdefault(peer, why)
        if msg is not None:
            self.evidence.setdefault(peer, (part_index, msg))
        await self._ban_sender(peer)

    def _check_senders_intact(self) -> None:
        if self.banned_senders:
            raise AllreduceException(f"sender(s) {sorted(map(str, self.banned_senders))} failed: abort this part")

    async def _communicate_with_peer(self, peer_id):
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_parts(peer_index)
            else:
                await self._exchange_with_reducer(peer_id, peer_index)
        except BaseException as e:
            complete = self._parts_received[peer_index] == self.tensor_part_container.num_parts_by_peer[peer_index]
            if complete and isinstance(e, Exception):
                # every part of this reducer arrived; the error came later (e.g. as the stream closed)
                logger.debug(f"{self}: reducer {peer_id} complete, then {e!r}")
                return
            if isinstance(e, Exception):
                logger.warning(f"lost parts {self._parts_received[peer_index]}+ of reducer {peer_id}: {e!r}")
            self.failed_reducers.add(peer_id)
            self.tensor_part_container.register_failed_reducer(peer_index)  # unblocks output iteration; round fails
            if isinstance(e, Exception) and not isinstance(e, ReducerRefused) and peer_id != self.peer_id:
                await self._stop_reducing()
            raise

    async def _stop_reducing(self) -> None:
        """A lost reducer's parts fail this attempt here, and so everywhere (a member that completes commits only
        when every member it reaches confirmed the same averages, verify.py): stop serving our own part at once
        rather than wait for a sender that may be dead to start (the sender timeout, 15-30 s, that every survivor
        of a member killed as a sender spent before its retry). Every sender is refused without blame. Not after a
        refusal (ReducerRefused): then every sender is alive, and our reducer's verdicts on them still count (stop 40's
        CI: stopping at once there left a member naming two of three attackers in the round they failed)."""
        for peer in self.sender_peer_ids:
            if peer != self.peer_id:
                await self._ban_sender(peer)

    async def _reduce_own_parts(self, peer_index: int) -> None:
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        for part_index, part in enumerate(self.parts_for_local_averaging):
            # our contribution as the other senders' reach us: through the codec (this records our residual)
            sent, mine = await loop.run_in_executor(None, self._round_trip, part, self._own_infos[part_index])
            weight = self._expected_weight(self.peer_id, self.weight)
            if weight > 0 and not bool(torch.isfinite(mine).all()):
                await self._refuse_sender(sender_index, "NaN or Inf in its part")
                raise AllreduceException("our own contribution is not finite")
            await loop.run_in_executor(None, self._own_entry, part_index, sent, mine)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, mine, weight=weight)
            self._check_senders_intact()
            encoded = await self._encode_average(part_index, averaged)
            self.part_digests.add(peer_index, part_digest(encoded, self._attestation(part_index)))
            decoded = await loop.run_in_executor(None, decode_part, encoded)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)
            self._parts_received[peer_index] += 1

    def _round_trip(self, part, info):
        sent = self.codec.compress(part, info)
        return sent, decode_part(sent)

    async def _exchange_with_reducer(self, peer_id, peer_index: int) -> None:
        """Stream our parts to a reducer and read its averages. We call its ``rpc_aggregate_part`` as hivemind's stub
        does, but end our input only once every averaged part has arrived: the reducer's handler returns (closing
        its end of the stream) only after our input ends, so no averaged part is in flight when the stream closes
        (closing with data in flight could drop its tail, which reads as a normal end of stream). Reading the stream
        ourselves, a dead reducer ends it at once; hivemind's client would first wait for our held input."""
        handle_name = self._servicer_type._get_handle_name(self._prefix, "rpc_aggregate_part")
        _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, handle_name)
        all_received = asyncio.Event()
        delayed = self.should_delay_results(self.peer_id)  # the reducer answers only once our input has ended

        async def write():
            async for msg in self._generate_input_for_peer(peer_index):
                await P2P.send_protobuf(msg, writer)
            if not delayed:
                await all_received.wait()
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        writing = asyncio.create_task(write())
        try:
            if delayed:
                await writing
            await self._receive_averages(peer_id, peer_index, _read_stream(peer_id, reader), all_received)
        finally:
            writing.cancel()
            with contextlib.suppress(BaseException):
                await writing
            writer.close()

    async def _receive_averages(self, peer_id, peer_index: int, stream, all_received: asyncio.Event) -> None:
        def decode(numbered):
            index, msg = numbered
            if msg.code == averaging_pb2.PROTOCOL_VIOLATION and msg.peer_id:
                accused, blamed, why = self._judge_refusal(peer_id, peer_index, msg)
                self.malformed.setdefault(blamed, why)
                raise ReducerRefused(f"reducer {peer_id} refused {accused}'s contribution: "
                                         f"{'' if blamed == accused else 'void, the reducer is blamed: '}{why}")
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
            self.bytes_received += len(msg.tensor_part.buffer) + len(msg.group_id)
            averaged = decode_part(msg.tensor_part)
            fault = self._average_fault(peer_index, index, averaged, msg.group_id)
            if fault is not None:  # only the reducer can be at fault (attest.py): it is named
                self.malformed.setdefault(peer_id, fault)
                raise ReducerRefused(f"reducer {peer_id}: {fault}")
            return part_digest(msg.tensor_part, msg.group_id), averaged

        part_index, expected = 0, self.tensor_part_container.num_parts_by_peer[peer_index]
        async for digest, averaged in amap_in_executor(decode, _numbered(aiter_with_timeout(stream, self.reducer_timeout)),
                                                       max_prefetch=self.tensor_part_container.prefetch):
            self.part_digests.add(peer_index, digest)  # in part order (decoding may run ahead, in threads)
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
            self._parts_received[peer_index] += 1
            part_index += 1
            if part_index == expected:
                all_received.set()  # ends our input; the reducer then closes the stream, ending this loop
        if part_index != expected:
            raise AllreduceException(f"{peer_id} sent {part_index} of {expected} parts")

    def _judge_refusal(self, reducer, reducer_index: int, msg) -> tuple:
        """A reducer's refusal naming a culprit: (the accused, whom we blame, why), by the evidence (evidence.py)."""
        accused = PeerID(msg.peer_id)
        expected = None if self.weights is None else self.weights.get(accused, 0.0)
        blamed, why = judge(culprit=accused.to_bytes(), reducer=reducer.to_bytes(), group_id=self.group_id,
                            accusation=Accusation.decode(msg.group_id), weight=msg.weight,
                            tensor=msg.tensor_part, part_shapes=self._part_shapes[reducer_index],
                            expected_weight=expected)
        if blamed != accused.to_bytes():
            logger.warning(f"reducer {reducer} accused {accused} of a malformed contribution without evidence "
                           f"that holds: {why}")
        return accused, PeerID(blamed), why

    async def _generate_input_for_peer(self, peer_index: int):
        reducer, part_index = self.ordered_peer_ids[peer_index].to_bytes(), 0
        async for msg in super()._generate_input_for_peer(peer_index):
            msg.weight = self._expected_weight(self.peer_id, self.weight)
            if self.attack is not None:
                self.attack.on_wire(msg)
            await self._sealed(msg, reducer, part_index)  # signed, with its summary: evidence against us if bad
            part_index += 1
            self.bytes_sent += len(msg.tensor_part.buffer) + len(msg.peer_id)
            yield msg
            if self.fault is not None and self.fault.phase == "sending":
                self.fault.strike()  # a sender dies after its first part went out

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reducer side: check each part, average it over all senders, stream the encoded average back to this
        sender. A malformed part, or any sender lost, stops the serving of every sender (see _refusal)."""
        part_index, ended, unjudged = 0, "input ended", True
        peer = self.sender_peer_ids[sender_index]
        self._judging(+1)

        def judged() -> None:
            nonlocal unjudged
            if unjudged:
                unjudged = False
                self._judging(-1)

        try:
            async for part, weight, msg, (sealing, provable) in amap_in_executor(
                    lambda numbered: self._screen(*numbered, sender_index), _numbered(stream),
                    max_prefetch=self.tensor_part_container.prefetch):
                why = self._problem(part, weight, peer, part_index)
                if why is None and self._framing(sender_index):
                    why = "NaN or Inf in its part"  # fault.attack=frame: a lie about a well-formed part (tests)
                if why is None and sealing is not None:
                    if not provable:  # nothing to show the others: fail the round as if the sender were gone
                        logger.warning(f"reducer: sender {peer}: {sealing}; failing the round")
                        await self._ban_sender(peer)
                        judged()
                        yield self._refusal()
                        return
                    why = sealing
                if why is not None:
                    await self._refuse_sender(sender_index, why, part_index, msg)
                    judged()
                    yield self._refusal()
                    return
                judged()
                if part is None:  # a non-participant's: weight 0
                    part = torch.zeros(self.tensor_part_reducer.part_shapes[part_index])
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=self._expected_weight(peer, weight))
                except BannedException:
                    ended = "sender banned"
                    break
                if self.banned_senders:  # this part may now be averaged over fewer senders: serve nothing more
                    yield self._refusal()
                    return
                encoded = await self._encode_average(part_index, averaged)
                if self.equivocate and self._deceived(sender_index):
                    encoded = await self._lie(averaged, part_index)
                attestation = self._attestation(part_index)
                part_index += 1
                self.bytes_sent += len(encoded.buffer) + len(attestation)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded,
                                                  group_id=attestation)
                if self.fault is not None and self.fault.phase == "allreduce":
                    self.fault.strike()  # a reducer dies mid-serving
        except BaseException as e:
            ended = repr(e)  # GeneratorExit: the transport stopped reading; CancelledError: the stream was closed
            raise
        finally:
            judged()
            if part_index != self.tensor_part_reducer.num_parts:
                logger.warning(f"reducer: stream to sender {peer} ended after "
                               f"{part_index} of {self.tensor_part_reducer.num_parts} parts ({ended})")
                await self._ban_sender(peer)

    def _screen(self, part_index: int, msg, sender_index: int):
        """Decode a sender's part and check its seal (in the executor); a non-participant's part is not decoded (it
        enters with weight 0); an undecodable one comes back as the error's text."""
        peer, unsealed = self.sender_peer_ids[sender_index], (None, False)
        if self.weights is not None and self.weights[peer] == 0:
            return None, msg.weight, msg, unsealed
        try:
            part = decode_part(msg.tensor_part)
        except Exception as e:  # noqa: BLE001 - anything a sender can make the decoder raise
            return f"an undecodable part ({type(e).__name__})", msg.weight, msg, unsealed
        if part.dtype != torch.float32 or not bool(torch.isfinite(part).all()):
            return part, msg.weight, msg, unsealed  # screening names the fault
        return part, msg.weight, msg, self._seal_fault(sender_index, part_index, part, msg)

    def _problem(self, part, weight: float, peer, part_index: int):
        """Why this part cannot enter the average (screening.part_problem), or None; a non-participant's part is
        replaced by zeros of the right shape."""
        if part_index >= self.tensor_part_reducer.num_parts:
            return f"more than the {self.tensor_part_reducer.num_parts} parts due"
        if isinstance(part, str):
            return part
        if part is None:
            return None
        shape = self.tensor_part_reducer.part_shapes[part_index]
        return part_problem(part, shape, weight, self._expected_weight(peer, weight))


async def _numbered(stream):
    index = 0
    async for item in stream:
        yield index, item
        index += 1


async def _read_stream(peer_id, reader):
    """The reducer's messages until it closes the stream (done, or dead)."""
    while True:
        try:
            msg, err = await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
        except asyncio.IncompleteReadError:
            return
        if err is not None:
            raise AllreduceException(f"reducer {peer_id} failed: {err.message}")
        yield msg

