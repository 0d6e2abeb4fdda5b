"""The canonical butterfly all-reduce: reducers stream the encoded average itself; any lost part fails the run.

hivemind's stock ``AllReduceRunner`` sends each sender ``lossy(avg - its part)`` and keeps a peer's own values for a
lost reducer's part (HIVEMIND.md, facts 1 and 2). Here senders encode their parts with the run's codec (wire.py), a
reducer decodes and accumulates them in fp32, encodes the average of each of its parts once, and every recipient
(the reducer included) decodes those same bytes; a reducer's own contribution enters its average as its recipients
would decode it, so the average does not depend on who reduced which part. A reducer that loses a sender stops
serving; a peer that misses any part records the reducer as failed. See averaging.py for how a round is judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor

from p2p_diloco.net.verify import ReducerDigests, part_digest
from p2p_diloco.net.wire import WireCodec, decode_part

logger = logging.getLogger(__name__)


class CanonicalAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose reducers stream the encoded average itself; any lost part fails the whole run."""

    def __init__(self, *, average_codec: WireCodec, fault=None, equivocate: bool = False, **kwargs):
        super().__init__(**kwargs)
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

    async def _encode_average(self, part_index: int, averaged: torch.Tensor):
        """Encode the average of one of our parts once; every recipient (us included) gets these same bytes."""
        if part_index not in self._encoded_averages:
            self._encoded_averages[part_index] = asyncio.get_event_loop().run_in_executor(
                None, self.average_codec.compress, averaged, self._own_infos[part_index])
        return await self._encoded_averages[part_index]

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
            raise

    async def _reduce_own_parts(self, peer_index: int) -> None:
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        for part_index, part in enumerate(self.parts_for_local_averaging):
            # our contribution as the other senders' reach us: through the codec (this records our residual)
            mine = await loop.run_in_executor(None, self._round_trip, part, self._own_infos[part_index])
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, mine, weight=self.weight)
            self._check_senders_intact()
            encoded = await self._encode_average(part_index, averaged)
            self.part_digests.add(peer_index, part_digest(encoded))
            decoded = await loop.run_in_executor(None, decode_part, encoded)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)
            self._parts_received[peer_index] += 1

    def _round_trip(self, part, info):
        return decode_part(self.codec.compress(part, info))

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
        def decode(msg):
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
            self.bytes_received += len(msg.tensor_part.buffer)
            return part_digest(msg.tensor_part), decode_part(msg.tensor_part)

        part_index, expected = 0, self.tensor_part_container.num_parts_by_peer[peer_index]
        async for digest, averaged in amap_in_executor(decode, aiter_with_timeout(stream, self.reducer_timeout),
                                                       max_prefetch=self.tensor_part_container.prefetch):
            self.part_digests.add(peer_index, digest)  # in part order (decoding may run ahead, in threads)
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
            self._parts_received[peer_index] += 1
            part_index += 1
            if part_index == expected:
                all_received.set()  # ends our input; the reducer then closes the stream, ending this loop
        if part_index != expected:
            raise AllreduceException(f"{peer_id} sent {part_index} of {expected} parts")

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(msg.tensor_part.buffer)
            yield msg

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reducer side: average each part over all senders, then stream the encoded average back to this sender."""
        part_index, ended = 0, "input ended"
        try:
            async for part, weight in amap_in_executor(
                    lambda msg: (decode_part(msg.tensor_part), msg.weight), stream,
                    max_prefetch=self.tensor_part_container.prefetch):
                if not (weight >= 0 and weight != float("inf")):
                    raise AllreduceException(f"sender {sender_index} sent invalid weight {weight}")
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                              weight=weight)
                except BannedException:
                    ended = "sender banned"
                    break
                if self.banned_senders:  # this part may now be averaged over fewer senders: serve nothing more
                    yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                    return
                encoded = await self._encode_average(part_index, averaged)
                if self.equivocate and self._deceived(sender_index):
                    encoded = await self._lie(averaged, part_index)
                part_index += 1
                self.bytes_sent += len(encoded.buffer)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
                if self.fault is not None:
                    self.fault.strike()
        except BaseException as e:
            ended = repr(e)  # GeneratorExit: the transport stopped reading; CancelledError: the stream was closed
            raise
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                logger.warning(f"reducer: stream to sender {self.sender_peer_ids[sender_index]} ended after "
                               f"{part_index} of {self.tensor_part_reducer.num_parts} parts ({ended})")
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _deceived(self, sender_index: int) -> bool:
        """fault.attack=equivocate: every other sender (ourselves excepted) gets other bytes than the rest."""
        others = [p for p in self.sender_peer_ids if p != self.peer_id]
        return others.index(self.sender_peer_ids[sender_index]) % 2 == 1

    async def _lie(self, averaged: torch.Tensor, part_index: int):
        """The average's sign flipped and shifted, encoded with the run's codec: a valid part with other bytes."""
        lie = averaged.neg().sub_(1e-2)
        return await asyncio.get_event_loop().run_in_executor(None, self.average_codec.compress, lie,
                                                              self._own_infos[part_index])


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
