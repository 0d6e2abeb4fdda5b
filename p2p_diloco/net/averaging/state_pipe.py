"""How a donor's averager process gets the state it serves from the peer's main process: through a pipe of its own,
as plain bytes, leaving nothing behind.

hivemind 1.1.12 asks the host process for the state through an ``MPFuture``: the main process's state thread pickles
the snapshot's tensors into the future's pipe, and under torch's "file_descriptor" sharing strategy (net/dht.py)
each tensor's storage is moved into a new /dev/shm file passed by descriptor. Those files stay: hivemind's state
thread keeps the last snapshot (its loop's locals and the future's result) until the next request, the averager
process's future thread keeps what it received until its next update, and every helper process the peer forks
meanwhile (a network-stack restart, net/supervise.py) inherits the descriptors and holds them for its whole life.
Measured in the soak (benchmarks/soak.md): two model copies of /dev/shm per donor after a transfer, more after each
restart. Here the main process writes each tensor's bytes straight into a pipe (no copy, no shared memory) and
forgets the snapshot as soon as the last byte is written; the averager process reads them into private tensors
that live as long as the download they serve.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import weakref
from typing import Callable

import torch

logger = logging.getLogger(__name__)

WAIT_S = 60.0  # the most the averager process waits for each message of a snapshot (the host clones, then writes)


class StatePipe:
    """A request/answer pipe between a CanonicalAverager's main-process object and its forked process. Create it
    before the fork; call :meth:`in_host` in the main process after the fork, :meth:`in_child` in the child."""

    def __init__(self):
        self._host, self._child = mp.Pipe(duplex=True)
        self._next = 0
        self._broken = False  # a wait timed out mid-answer: what follows in the pipe can no longer be framed

    # ------------------------------------------------------------------------------------------ the main process
    def in_host(self, get_state: Callable[[], tuple]) -> None:
        """Close the child's end here (so that the child's death reads as EOF) and answer its requests with
        ``get_state() -> (metadata bytes, tensors)`` on a daemon thread, which ends with the child."""
        self._child.close()
        ref = weakref.WeakMethod(get_state)
        self._thread = threading.Thread(target=_answer_requests, args=(self._host, ref), name="state-pipe",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """In the main process, once the child has ended (its end reads EOF): the thread ends, the pipe is closed
        (else every helper forked later would inherit it)."""
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._host.close()

    # ----------------------------------------------------------------------------------------- the child process
    def in_child(self) -> None:
        self._host.close()

    def fetch(self) -> tuple[bytes, list[torch.Tensor]]:
        """Blocking (run it in an executor, one at a time): ask the main process for its state and read it."""
        if self._broken:
            raise RuntimeError("the state pipe is out of step since a wait timed out: not serving until restarted")
        self._next += 1
        request = self._next
        self._child.send(request)
        try:
            self._receive_ready()
            answer, metadata, specs = self._child.recv()
            tensors = receive_tensors(self._child, specs, WAIT_S)
        except TimeoutError:
            self._broken = True
            raise
        if answer != request:
            raise RuntimeError(f"the state pipe answered request {answer}, not {request}")
        if isinstance(metadata, str):
            raise RuntimeError(metadata)
        return metadata, tensors

    def _receive_ready(self) -> None:
        if not self._child.poll(WAIT_S):
            raise TimeoutError(f"the main process sent no state within {WAIT_S:.0f} s")


def _answer_requests(conn, get_state_ref: weakref.WeakMethod) -> None:
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the averager process ended
            return
        get_state = get_state_ref()
        if get_state is None:
            return
        try:
            _answer(conn, request, get_state)
        except (BrokenPipeError, EOFError, OSError):
            return
        finally:
            del get_state


def _answer(conn, request: int, get_state: Callable[[], tuple]) -> None:
    try:
        metadata, tensors = get_state()
        tensors = list(tensors)
    except Exception as e:  # noqa: BLE001 - e.g. no state to serve yet: the child's request fails with this text
        logger.warning(f"state for a joiner: {e!r}")
        conn.send((request, f"{type(e).__name__}: {e}", []))
        return
    conn.send((request, metadata, tensor_specs(tensors)))
    send_tensors(conn, tensors)


# ---------------------------------------------------------------------------------------- tensors through a pipe
def tensor_specs(tensors) -> list[tuple[str, tuple]]:
    """What :func:`receive_tensors` needs to read ``tensors`` back: (dtype name, shape) of each."""
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]


def send_tensors(conn, tensors: list) -> None:
    """Write each tensor's bytes (blocking, no copy); ``tensors`` is emptied as it goes, so each can be freed once
    written."""
    while tensors:
        conn.send_bytes(_bytes_of(tensors.pop(0).detach().cpu().contiguous()))


def receive_tensors(conn, specs, wait_s: float) -> list[torch.Tensor]:
    """Read the tensors :func:`send_tensors` wrote (``specs``: :func:`tensor_specs`), waiting ``wait_s`` at most
    for each."""
    def wait():
        if not conn.poll(wait_s):
            raise TimeoutError(f"no state arrived through the pipe within {wait_s:.0f} s")

    return [_receive_tensor(conn, spec, wait) for spec in specs]


def _bytes_of(tensor: torch.Tensor):
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _receive_tensor(conn, spec, wait: Callable[[], None]) -> torch.Tensor:
    dtype, shape = spec
    dtype = getattr(torch, str(dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a tensor type: {spec[0]!r}")
    tensor = torch.empty(tuple(shape), dtype=dtype)
    wait()
    size = conn.recv_bytes_into(_bytes_of(tensor))
    if size != tensor.numel() * tensor.element_size():
        raise ValueError(f"the main process sent {size} bytes for a tensor of {tuple(shape)} {dtype}")
    return tensor


class StateBudget:
    """A state download's bound, from the model's shapes: θ_global and at most 3 outer-optimizer tensors per
    parameter (fp32), with room for framing, and one metadata message of at most 1 MiB. A donor that streams more
    is cut off as soon as it passes the bound, instead of filling the joiner's memory until the timeout (issue 24,
    finding 8)."""

    STATE_COPIES, SLACK_BYTES, METADATA_BYTES = 4, 1 << 20, 1 << 20

    def __init__(self, averaged_tensors):
        self.left = self.STATE_COPIES * sum(t.numel() * 4 for t in averaged_tensors) + self.SLACK_BYTES
        self.tensors_left = self.STATE_COPIES * len(averaged_tensors) + 8
        self.metadata_seen = False

    def take(self, message) -> None:
        if message.metadata:
            if self.metadata_seen or len(message.metadata) > self.METADATA_BYTES:
                raise ValueError("the donor's state metadata is repeated or too large")
            self.metadata_seen = True
        self.left -= len(message.tensor_part.buffer)
        self.tensors_left -= 1 if message.tensor_part.dtype else 0
        if self.left < 0 or self.tensors_left < 0:
            raise ValueError("the donor's state is larger than this model's state can be: cut off")
