"""The replay client: asks a replica's replay endpoint (vLLM's ROUTER socket) for the batches it
still buffers from a given seq.  Request ``[b"", start_seq]``; answers ``[b"", (topic,) seq,
payload]`` per batch, then an end marker with seq -1 (router/fleet/kvevents/wire.py parses both)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from kvroute.router.fleet.kvevents.wire import END_SEQ, WireError, parse_replay, replay_request

# what a replay that could not be had raises: no answer in time, a reply that is no replay, a socket error
ReplayError = (TimeoutError, WireError, zmq.ZMQError)


async def replay_batches(
    context: zmq.asyncio.Context, endpoint: str, start: int, timeout_s: float
) -> AsyncIterator[tuple[int, bytes]]:
    """(seq, payload) of every buffered batch from ``start`` on, until the end marker.  Each reply
    must come within ``timeout_s``; raises one of :data:`ReplayError` otherwise."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart(replay_request(start))
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # lands as the reply arrives, and the stream would outlive its stop()
            async with asyncio.timeout(timeout_s):
                frames = await dealer.recv_multipart()
            seq, payload = parse_replay(frames)
            if seq == END_SEQ:
                return
            yield seq, payload
    finally:
        dealer.close(linger=0)
