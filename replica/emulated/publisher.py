"""KV cache events over ZMQ, in vLLM's wire format (``vllm/distributed/kv_events.py``).

Live stream: a PUB socket sends one multipart message per engine step,
``(topic, seq as 8-byte big-endian, msgpack EventBatch)``, ``seq`` counting from 0 in each
publisher, so a subscriber sees a restart as a seq going backwards and a loss as a gap.

Encoding, as vLLM ≥ 0.26 puts it on the wire (and as a running vLLM was captured sending it):
the batch is a positional array ``[ts, events, data_parallel_rank]``; each event is a map tagged
by ``"type"`` whose fields keep vLLM's names and order.  Optional trailing fields equal to their
default (None) are left out, as msgspec's ``omit_defaults`` does in vLLM.

Replay: a ROUTER socket answers ``[identity, b"", start_seq (8B BE)]`` (what a DEALER sending
``[b"", start_seq]`` produces) with ``[identity, b"", topic, seq, payload]`` for every buffered
batch with ``seq >= start_seq``, then the end marker ``[identity, b"", b"", seq=-1, b""]``
(vLLM since #45177 puts the topic in replay replies, and an empty one in the end marker).

Endpoints follow vLLM's rule: an address with a wildcard (``tcp://*:5557``, ``tcp://127.0.0.1:*``),
``ipc://`` or ``inproc://`` is bound; a specific host is connected to (the subscriber binds one
socket that many replicas connect to).  The replay endpoint is always bound.  ``bind_host``
narrows a ``tcp://*:P`` bind to one address, as a pod's own IP is: replicas on 127.0.0.2 and
127.0.0.3 then both publish on port 5557, which routers find by convention (router/fleet/discovery/
event_endpoints.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's default replay buffer, in batches
DEFAULT_HWM = 100_000


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: msgspec writes the class name under the key ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: the extra keys that entered its hash (cache_salt on a chain's first
    # block, the LoRA name), None for a block with none.  A consumer needs them to rebuild a
    # salted chain's namespace.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


def binds(endpoint: str) -> bool:
    """vLLM's heuristic: wildcard, ipc and inproc addresses are bound, specific hosts connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """PUB stream plus bounded replay buffer.  Use from one event loop: ``publish`` is synchronous
    (a PUB socket never blocks: past its high-water mark it drops, which subscribers see as a seq
    gap and repair through replay); the replay ROUTER is served by a task on that loop."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        data_parallel_rank: int = 0,
        bind_host: str | None = None,
    ) -> None:
        self._binds = binds(endpoint)  # by the endpoint asked for, before bind_host narrows it
        self._requested_endpoint = on_host(endpoint, bind_host) or endpoint
        self._requested_replay = on_host(replay_endpoint, bind_host)
        self.topic = topic
        self._topic_bytes = topic.encode()
        self._hwm = hwm
        self._dp_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        self.endpoint: str = endpoint  # resolved after start(): a wildcard port becomes the real one
        self.replay_endpoint: str | None = replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> None:
        # The PUB socket is plain (sends are synchronous and never block); the ROUTER is an asyncio
        # socket so replay requests are served on the event loop without a thread.
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if self._binds:
                pub.bind(self._requested_endpoint)
                self.endpoint = _public(pub.getsockopt_string(zmq.LAST_ENDPOINT), self._requested_endpoint)
            else:
                pub.connect(self._requested_endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        if self._requested_replay:
            router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(self._requested_replay)
            except zmq.ZMQError:
                router.close(linger=0)
                self.close_sync()
                raise
            self.replay_endpoint = _public(router.getsockopt_string(zmq.LAST_ENDPOINT), self._requested_replay)
            self._replay = router
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[WireEvent], ts: float | None = None) -> int:
        """Send one batch (one engine step's events); returns its seq."""
        if self._pub is None:
            raise RuntimeError("publisher not started")
        batch = EventBatch(ts=time.time() if ts is None else ts, events=list(events),
                           data_parallel_rank=self._dp_rank)
        payload = self._encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        return seq

    def buffered(self, start_seq: int = 0) -> Iterable[tuple[int, bytes]]:
        return ((seq, payload) for seq, payload in self._buffer if seq >= start_seq)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client_id, _, start_bytes = frames
            start_seq = int.from_bytes(start_bytes, "big")
            try:
                # Snapshot first: publish() may append while a send awaits.
                for seq, payload in list(self.buffered(start_seq)):
                    await self._replay.send_multipart(
                        (client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
                await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # the client went away mid-replay: nothing to repair
                log.warning("replay to a client failed: %s", exc)

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self.close_sync()

    def close_sync(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None


def on_host(endpoint: str | None, host: str | None) -> str | None:
    """``tcp://*:P`` bound on ``host`` only (``tcp://HOST:P``); anything else, or no specific host, as it is."""
    if not endpoint or not host or host in ("0.0.0.0", "::", "*", "") or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://[{host}]:{endpoint[8:]}" if ":" in host else f"tcp://{host}:{endpoint[8:]}"


def _public(bound: str, requested: str) -> str:
    """An address a local subscriber can connect to: the bound one (a wildcard port resolved),
    with ZMQ's ``tcp://0.0.0.0:P`` for a ``tcp://*:P`` bind reported as loopback."""
    if not bound:
        return requested
    if bound.startswith("tcp://0.0.0.0:"):
        return "tcp://127.0.0.1:" + bound.rsplit(":", 1)[1]
    return bound
