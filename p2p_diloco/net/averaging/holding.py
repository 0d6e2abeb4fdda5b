"""A reducer that holds every sender's copy of the current part and combines them with a robust aggregator
(aggregators.py), for the canonical all-reduce (allreduce.py) when the run's aggregator is not the mean."""

from __future__ import annotations

import asyncio

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from p2p_diloco.net.averaging.aggregators import Aggregator

class HoldingPartReducer(TensorPartReducer):
    """hivemind's reducer, holding every sender's copy of the current part (weight > 0) instead of summing them,
    then combining them with ``aggregator`` in sender order. Memory: (participants) × (part size), measured as
    ``peak_bytes``. The waiting and banning logic is TensorPartReducer's, with the accumulation replaced."""

    def __init__(self, part_shapes, num_senders: int, aggregator: Aggregator):
        self.aggregator = aggregator
        self.held: dict[int, tuple[torch.Tensor, float]] = {}
        self.peak_bytes = 0
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        self.held = {}
        super().reset_accumulators()
        self.accumulator = None  # nothing is summed

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for the previous parts to be combined
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.finished.is_set():  # the all-reduce failed while this part was on its way (hivemind's reducer
            # would set the result of the cancelled future: InvalidStateError, which no survivor retries)
            raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        current = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if weight > 0:
                self.held[sender_index] = (tensor_part, weight)
                self.peak_bytes = max(self.peak_bytes, sum(4 * t.numel() for t, _ in self.held.values()))
            self.current_part_accumulated_from += 1
            self.denominator += weight
            self.check_current_part_finished()
        return await current

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            senders = sorted(self.held)
            if senders:
                combined = self.aggregator([self.held[i][0] for i in senders], [self.held[i][1] for i in senders])
            else:
                combined = torch.full(self.part_shapes[self.current_part_index], float("nan"))  # as 0/0 would
            self.current_part_future.set_result(combined)
            self.reset_accumulators()

