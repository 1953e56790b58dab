"""The KV-event publisher against real ZMQ sockets, its bytes decoded generically.

Nothing here decodes with the publisher's own structs: frames are read as raw bytes and payloads
with msgspec's schemaless msgpack decoder, so the tests pin the wire format itself (vLLM's), not
whatever the module happens to round-trip.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.replica.emulated.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    binds,
)
from tests.conftest import free_port

SETTLE_S = 0.3  # ZMQ's slow joiner: a new SUB's subscription needs a moment to reach the PUB


def stored(hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None) -> BlockStored:
    extra = [(salt,) if salt and i == 0 and parent is None else None for i in range(len(hashes))]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=extra, group_idx=0,
                       kv_cache_spec_kind="full_attention")


@pytest.fixture
async def publisher():
    pub = KVEventPublisher(f"tcp://*:{free_port()}", f"tcp://*:{free_port()}", topic="kv")
    await pub.start()
    yield pub
    await pub.close()


async def subscribe(endpoint: str, topic: bytes = b"") -> zmq.asyncio.Socket:
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    await asyncio.sleep(SETTLE_S)
    return sub


async def recv(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), timeout)


async def test_wire_format_of_each_event_kind(publisher):
    sub = await subscribe(publisher.endpoint)
    try:
        publisher.publish([stored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], salt="tenant-a")], ts=123.5)
        publisher.publish([BlockRemoved(block_hashes=[12], medium="GPU", group_idx=0), AllBlocksCleared()])
        first, second = await recv(sub), await recv(sub)
    finally:
        sub.close()

    topic, seq, payload = first
    assert topic == b"kv"
    assert len(seq) == 8 and int.from_bytes(seq, "big") == 0
    assert int.from_bytes(second[1], "big") == 1
    batch = msgspec.msgpack.decode(payload)
    # EventBatch is positional: [ts, events, data_parallel_rank]
    assert batch == [
        123.5,
        [{
            "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [["tenant-a"], None], "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }],
        0,
    ]
    # vLLM's field order, which positional (older) consumers and humans reading dumps rely on
    assert list(batch[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                 "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                 "kv_cache_spec_kind"]
    ts, events, rank = msgspec.msgpack.decode(second[2])
    assert isinstance(ts, float) and rank == 0
    assert events == [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0},
                      {"type": "AllBlocksCleared"}]


async def test_full_64_bit_hashes_survive(publisher):
    sub = await subscribe(publisher.endpoint)
    big = 2**64 - 1
    try:
        publisher.publish([stored([big], 2**63, [0, 1, 2, 3])])
        _, _, payload = await recv(sub)
    finally:
        sub.close()
    event = msgspec.msgpack.decode(payload)[1][0]
    assert event["block_hashes"] == [big] and event["parent_block_hash"] == 2**63


async def test_topic_filter(publisher):
    wrong = await subscribe(publisher.endpoint, b"other")
    right = await subscribe(publisher.endpoint, b"kv")
    try:
        publisher.publish([AllBlocksCleared()])
        frames = await recv(right)
        assert frames[0] == b"kv"
        assert await wrong.poll(200) == 0
    finally:
        wrong.close()
        right.close()


async def replay(endpoint: str, start: int, timeout: float = 5.0) -> list[list[bytes]]:
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), timeout)
            replies.append(frames)
            if int.from_bytes(frames[2], "big", signed=True) == -1:
                return replies
    finally:
        dealer.close()


async def test_replay_returns_buffered_batches_then_end_marker(publisher):
    payloads = [publisher.publish([stored([100 + i], None, [i] * 4)]) for i in range(5)]
    assert payloads == [0, 1, 2, 3, 4]
    replies = await replay(publisher.replay_endpoint, 2)
    *batches, end = replies
    # [b"", topic, seq, payload] per batch (the DEALER sees the ROUTER's reply minus the identity)
    assert [(f[0], f[1], int.from_bytes(f[2], "big")) for f in batches] == [(b"", b"kv", s) for s in (2, 3, 4)]
    assert [msgspec.msgpack.decode(f[3])[1][0]["block_hashes"] for f in batches] == [[102], [103], [104]]
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    # a start past the newest batch: only the end marker
    assert len(await replay(publisher.replay_endpoint, 99)) == 1


async def test_replay_buffer_is_bounded():
    pub = KVEventPublisher(f"tcp://*:{free_port()}", f"tcp://*:{free_port()}", buffer_steps=3)
    await pub.start()
    try:
        for i in range(7):
            pub.publish([stored([i], None, [0, 0, 0, 0])])
        *batches, _ = await replay(pub.replay_endpoint, 0)
        assert [int.from_bytes(f[2], "big") for f in batches] == [4, 5, 6]
        assert all(f[1] == b"" for f in batches)  # the default topic is vLLM's: empty
    finally:
        await pub.close()


async def test_connect_mode_reaches_a_bound_subscriber():
    # A specific host makes the publisher connect: the subscriber binds one socket for many replicas.
    port = free_port()
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    pubs = [KVEventPublisher(f"tcp://127.0.0.1:{port}", topic=f"r{i}") for i in range(2)]
    # A bound SUB only passes its subscription to a connecting PUB while it processes socket
    # commands (libzmq#2267): keep a receive pending, as a subscriber's loop does.
    first = asyncio.ensure_future(recv(sub))
    try:
        for p in pubs:
            await p.start()
        await asyncio.sleep(SETTLE_S)
        for p in pubs:
            p.publish([AllBlocksCleared()])
        got = {(await first)[0], (await recv(sub))[0]}
        assert got == {b"r0", b"r1"}
    finally:
        first.cancel()
        for p in pubs:
            await p.close()
        sub.close()


async def test_wildcard_port_resolves_to_a_connectable_endpoint():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    await pub.start()
    try:
        assert not pub.endpoint.endswith("*") and not pub.replay_endpoint.endswith("*")
        sub = await subscribe(pub.endpoint)
        pub.publish([AllBlocksCleared()])
        assert int.from_bytes((await recv(sub))[1], "big") == 0
        sub.close()
        assert len(await replay(pub.replay_endpoint, 0)) == 2
    finally:
        await pub.close()


def test_bind_or_connect_rule():
    assert binds("tcp://*:5557") and binds("tcp://127.0.0.1:*") and binds("ipc:///tmp/x")
    assert binds("inproc://kv") and binds("tcp://[::]:5557")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://router.internal:5557")
