"""asyncio helpers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

RECANCEL_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel ``tasks`` and return once every one of them has ended.

    One cancellation is not always enough on Python 3.11: ``asyncio.wait_for`` drops a cancellation
    that lands as the call it waits for completes, and returns that call's result (fixed in 3.12).
    redis-py wraps every command it sends in ``wait_for`` whenever a socket timeout is set, which
    is its default since 8.0, so a task cancelled during a Redis call may run on.  It is cancelled
    again until it ends.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a connection's TCP socket: a small write (an SSE event) leaves at once
    instead of waiting on Nagle for the peer's ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
