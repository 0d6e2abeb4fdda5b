"""Batches drawn ahead of the training loop on a background thread, so reading and tokenizing streamed text overlaps
the inner steps instead of adding to them.

Why a thread and not a process: the expensive part, the Rust tokenizer, releases the GIL while it encodes, and a
thread shares the reader's resumable position without any copying. benchmarks/gpu.md (5.3, "Real text") gives the
tokenizer's throughput against what a GPU consumes. The order of batches is exactly the wrapped reader's, and
:meth:`Prefetcher.state_dict` is the position after the last batch *handed out*, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

import torch

from p2p_diloco.train.data import TokenBatches

_POLL_S = 0.1  # how often a blocked producer checks whether it was told to stop


class Prefetcher(TokenBatches):
    """Wraps ``reader``; keeps up to ``depth`` batches ready. The thread starts at the first :meth:`next_batch`
    (never before: hivemind forks its helper processes during the peer's start, and a fork must not copy a thread
    that is busy in the tokenizer). An error of the reader is raised by the :meth:`next_batch` that would have
    returned the failed batch."""

    def __init__(self, reader: TokenBatches, depth: int):
        super().__init__(reader.seq_len, reader.batch_size)
        self.reader, self.depth = reader, depth
        self._state = reader.state_dict()
        self.batches = reader.batches
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def next_batch(self) -> torch.Tensor:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._thread = None  # the producer has ended; a later call retries from the last good position
            self.reader.load_state_dict(self._state)
            raise item
        batch, self._state = item
        self.batches += 1
        return batch

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._halt()
        self.reader.load_state_dict(state)
        self._state = self.reader.state_dict()
        self.batches = self.reader.batches

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is drawing) and close the reader; the next
        :meth:`next_batch` restarts from the position of the last batch handed out."""
        self._halt()
        self.reader.close()

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.reader.load_state_dict(self._state)  # drop what was drawn ahead and not handed out

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), name="prefetch",
                                        daemon=True)
        self._thread.start()

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                _put(out, (self.reader.next_batch(), self.reader.state_dict()), stop)
        except BaseException as e:  # handed to the consumer, which raises it in the training loop
            _put(out, e, stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> None:
    """Put ``item`` once there is room, unless told to stop first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue
