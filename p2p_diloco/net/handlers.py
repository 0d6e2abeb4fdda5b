"""Incoming streams keep their handler alive until it ends.

hivemind's daemon client serves each incoming stream in a task that asyncio creates for the unix-socket server's
connection (``ControlClient._handler``). Nothing but that connection's protocol references the task, and the event
loop keeps tasks only weakly (the Python docs: "save a reference to the result ... a task that isn't referenced
elsewhere may get garbage collected at any time"). While the handler waits, say on a future that hivemind itself
holds only weakly (an answer from the DHT's process, a group's future), and reading from the daemon is paused, the
whole cycle is unreachable: the garbage collector destroyed such handlers mid-stream ("Task was destroyed but it is
pending!" in a private run's log, a part lost, in CI). Holding every running handler here ends that class of loss:
the handler lives until its stream ends, and whatever it waits on stays reachable to be answered.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

RUNNING: set = set()  # the tasks serving incoming streams, in this process
UNHELD = ControlClient._handler  # hivemind's own, for the test that shows the loss


def hold_stream_handlers() -> None:
    """Make every incoming stream's task strongly referenced until it ends (idempotent; fork inherits it)."""
    if getattr(ControlClient._handler, "_held", False):
        return
    serve = ControlClient._handler

    async def held(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        RUNNING.add(task)
        try:
            return await serve(self, reader, writer)
        finally:
            RUNNING.discard(task)

    held._held = True
    ControlClient._handler = held


hold_stream_handlers()
