"""An incoming stream's handler is never collected while it waits (p2p_diloco/net/handlers.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.p2p.p2p_daemon_bindings.utils import write_pbmsg
from hivemind.proto import p2pd_pb2

from p2p_diloco.net import handlers


async def _serve_one_stream(tmp_path, held: bool) -> tuple[bool, bytes]:
    """A daemon-side stream to a handler that waits on a future held only weakly (as hivemind holds the answers
    its handlers wait for), with reading paused by a full buffer; then a garbage collection; then the answer."""
    answers = weakref.WeakValueDictionary()  # hivemind's registry of pending answers is weak in the same way
    waiting = asyncio.Event()

    async def handler(stream_info, reader, writer):
        answer = asyncio.get_running_loop().create_future()
        answers["x"] = answer
        waiting.set()
        answered = await answer
        await reader.readexactly(1 << 20)  # the stream's body, then the answer
        writer.write(answered)
        await writer.drain()
        writer.close()

    client = ControlClient.__new__(ControlClient)
    client.handlers = {"/test": handler}
    client._read_task = client._write_task = None
    serve = client._handler if held else handlers.UNHELD.__get__(client)
    path = str(tmp_path / "daemon.sock")
    server = await asyncio.start_unix_server(serve, path=path)
    reader, writer = await asyncio.open_unix_connection(path)
    info = p2pd_pb2.StreamInfo(peer=b"\x00\x24" + bytes(36), addr=b"", proto="/test")
    await write_pbmsg(writer, info)
    writer.write(bytes(1 << 20))  # more than the reader's buffer: the server's transport stops reading
    await asyncio.wait_for(waiting.wait(), 10)
    await asyncio.sleep(0)  # let the transport pause (the buffered bytes arrive with the stream's header)
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.05)
    alive = "x" in answers
    if alive:
        answers["x"].set_result(b"answered")
    got = await asyncio.wait_for(reader.read(), 10) if alive else b""
    writer.close()
    server.close()
    return alive, got


@pytest.mark.timeout(60)
def test_a_waiting_handler_survives_garbage_collection_and_answers(tmp_path):
    alive, got = asyncio.run(_serve_one_stream(tmp_path, held=True))
    assert alive and got == b"answered"
    assert not handlers.RUNNING  # released once its stream ended


@pytest.mark.timeout(60)
def test_without_holding_the_same_handler_is_collected(tmp_path):
    """The reproduction: the test above is not vacuous (asyncio alone loses this handler)."""
    alive, _ = asyncio.run(_serve_one_stream(tmp_path, held=False))
    assert not alive


@pytest.mark.timeout(30)
def test_a_group_that_fails_before_any_part_waits_leaves_no_unretrieved_future():
    """A group that fails before its all-reduce (no quorum, a bad proof) answers the parts waiting for it through
    its future; when none waited, nothing may log "Future exception was never retrieved" (seen after NoQuorum)."""
    from hivemind.averaging.partition import AllreduceException

    from p2p_diloco.net.security.gate import MemberGate

    async def fail_one_group() -> list:
        loop, reported = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
        gate = MemberGate()
        gate._running_groups = {b"g": loop.create_future()}
        gate._fail_waiting_parts(b"g", AllreduceException("no quorum"))
        gate._running_groups.clear()  # hivemind drops the group's future when the step ends
        gc.collect()
        await asyncio.sleep(0)
        return reported

    assert asyncio.run(fail_one_group()) == []
