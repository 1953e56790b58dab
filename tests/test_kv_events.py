"""The KV-event subscriber on real parts: ZMQ on loopback, emulated replicas, MemoryIndex and a
real Redis index.

Expected hashes are always computed independently, with ``kvroute.common.blocks`` on the prompt's token
ids (tokenized by the tiny tokenizer the replica uses); events published by hand carry arbitrary
engine hashes, so a subscriber that passed engine hashes through would fail.  Waits are bounded
waits for a state (``wait_applied`` and friends), never timed assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvroute.replica.emulated.publisher import BlockRemoved, BlockStored, KVEventPublisher
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from kvroute.common.blocks import block_hashes, namespace_seed
from kvroute.router.fleet.membership import Fleet
from kvroute.router.fleet.settings import FleetSettings
from kvroute.router.index import IndexClient, MemoryIndex, RedisIndex, ReplicaSpec
from kvroute.router.index.base import PrefixIndex
from kvroute.router.fleet.kvevents import BatchDecoder, ChainTranslator, KVEventSubscriber, WireError
from kvroute.router.fleet.kvevents import wire
from kvroute.common.registration import ReplicaRecord, deregister, register
from kvroute.common.tokens import Tokenizer
from tests.conftest import free_port
from tests.router_support import index_client, own_redis

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-emulated"
BS = 16  # the cpu-tiny profile's block size
NAME = "replica-a"
WAIT_S = 10.0  # bound on waits for a state: a bug fails the test instead of hanging it


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ROOT / "tests" / "assets" / "tiny-tokenizer")


def conversation(topic: str, repeat: int = 3) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about {topic} and the history of prefix caching. " * repeat}]


def chain_of(tokenizer: Tokenizer, messages: list[dict[str, str]], salt: str | None = None) -> list[int]:
    """The router's chain for a chat: what the index must hold once the replica cached it."""
    return block_hashes(tokenizer.encode_chat(messages), BS, namespace_seed(MODEL, None, salt))


def tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


def router_chain(ids: Sequence[int], salt: str | None = None) -> list[int]:
    return block_hashes(ids, BS, namespace_seed(MODEL, None, salt))


def stored(engine_hashes: list[int], parent: int | None, ids: list[int], *, salt: str | None = None,
           block_size: int = BS, **fields: Any) -> BlockStored:
    """A BlockStored as vLLM 0.33 sends it; engine hashes are arbitrary, like vLLM's own."""
    extra = [None] * len(engine_hashes)
    if salt is not None:
        extra[0] = (salt,)
    values: dict[str, Any] = dict(block_hashes=engine_hashes, parent_block_hash=parent, token_ids=ids,
                                  block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
                                  extra_keys=extra, group_idx=0, kv_cache_spec_kind="full_attention")
    values.update(fields)
    return BlockStored(**values)


def removed(engine_hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=engine_hashes, medium="GPU", group_idx=0)


class _Blackhole:
    def send_multipart(self, frames: Any) -> None:  # noqa: D401 - a socket that loses everything
        pass


class FaultyPublisher(KVEventPublisher):
    """The emulated replica's publisher plus the faults a network or an old vLLM produces."""

    def publish_lost(self, events: list[Any]) -> int:
        """Buffered for replay but never sent: a batch the subscriber's socket dropped."""
        pub, self._pub = self._pub, _Blackhole()
        try:
            return self.publish(events)
        finally:
            self._pub = pub

    def publish_payload(self, payload: bytes) -> int:
        """A batch encoded by the caller (another vLLM version's format)."""
        assert self._pub is not None
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        return seq


async def start_publisher(*, replay: bool = True, port: int | None = None,
                          replay_port: int | None = None) -> FaultyPublisher:
    """A publisher on fresh ports, or on given ones (a restart: ZMQ releases a closed socket's port
    in its I/O thread, a moment after ``close``, so binding it again is retried)."""
    for attempt in range(100):
        pub = FaultyPublisher(f"tcp://*:{port or free_port()}",
                              f"tcp://*:{replay_port or free_port()}" if replay else None, topic="kv")
        try:
            await pub.start()
            return pub
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == 99:
                raise
            await asyncio.sleep(0.02)
    raise AssertionError("unreachable")


def make_subscriber(index: PrefixIndex, **kwargs: Any) -> KVEventSubscriber:
    return KVEventSubscriber(index_client(index), block_size_for=lambda model: BS, registry=CollectorRegistry(),
                             replay_timeout_s=1.0, **kwargs)


@contextlib.asynccontextmanager
async def following(index: PrefixIndex, endpoint: str, replay_endpoint: str | None, *,
                    name: str = NAME, live: Any = None, options: dict[str, Any] | None = None,
                    **watch: Any) -> AsyncIterator[KVEventSubscriber]:
    """A subscriber (``options``: its settings) following one replica, synced; with ``live`` (its
    publisher), also past ZMQ's slow joiner (see ``until_live``), so that the test's own last batch
    cannot be lost unseen."""
    sub = make_subscriber(index, **(options or {}))
    await sub.start()
    sub.watch(name, endpoint, replay_endpoint, MODEL, **watch)
    try:
        await sub.wait_synced(name, WAIT_S)
        if live is not None:
            await until_live(sub, live, name)
        yield sub
    finally:
        await sub.stop()


async def until_live(sub: KVEventSubscriber, pub: Any, name: str = NAME) -> None:
    """Publish empty batches until one arrives live.

    A SUB's subscription reaches the PUB a moment after it connects (ZMQ's slow joiner), so a
    batch published right after the first-contact replay may be dropped; if it was the last one
    a test publishes, nothing would reveal the gap and the test would wait in vain.  Probes lost
    this way are gaps the replay fills: tests compare gap and replay counts against the state
    after this call.
    """
    for _ in range(200):
        seq = pub.publish([])
        with contextlib.suppress(TimeoutError):
            await sub.wait_applied(name, seq, 0.05)
            return
    raise AssertionError("no probe batch reached the subscriber")


async def new_index(capacity: int = 1000, name: str = NAME) -> MemoryIndex:
    index = MemoryIndex()
    await index.add_replica(ReplicaSpec(name, capacity, publishes_events=True))
    return index


def sample(sub: KVEventSubscriber, metric: str, **labels: str) -> float:
    value = sub.registry.get_sample_value(metric, labels)
    return 0.0 if value is None else value


async def chat(session: aiohttp.ClientSession, replica: EmulatedReplica, messages: list[dict[str, str]],
               **extra: Any) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, **extra}
    async with session.post(replica.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def make_replica(tokenizer: Tokenizer, **overrides: Any) -> EmulatedReplica:
    config: dict[str, Any] = dict(model=MODEL, profile="cpu-tiny", time_scale=0.0,
                                  events_endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{free_port()}")
    config.update(overrides)
    return EmulatedReplica(ReplicaConfig(**config), tokenizer=tokenizer)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def engine_depth(replica: EmulatedReplica, chain: list[int]) -> int:
    """Leading blocks of ``chain`` the emulated engine holds (its hashes are the router's)."""
    depth = 0
    for h in chain:
        if not replica.engine.pool.is_cached(h):
            break
        depth += 1
    return depth


# -- against an emulated replica ------------------------------------------------------------


async def test_cached_prompts_become_confirmed_under_router_hashes(tokenizer, session):
    replica = make_replica(tokenizer)
    await replica.start()
    index = await new_index(replica.num_gpu_blocks)
    try:
        async with following(index, replica.events_endpoint, replica.replay_endpoint, live=replica.publisher) as sub:
            lag_before = sample(sub, "kvroute_kv_event_lag_seconds_count", replica=NAME)
            applied_before = sub.status(NAME).batches_applied
            plain, salted = conversation("tokenizers"), conversation("schedulers")
            await chat(session, replica, plain)
            await chat(session, replica, salted, cache_salt="tenant-a")
            await sub.wait_applied(NAME, replica.publisher.next_seq - 1, WAIT_S)

            chain = chain_of(tokenizer, plain)
            salted_chain = chain_of(tokenizer, salted, salt="tenant-a")
            assert len(chain) >= 3 and len(salted_chain) >= 3
            assert await index.lookup(chain) == {NAME: len(chain)}
            # the salt travelled in extra_keys: only the tenant's namespace matches
            assert await index.lookup(salted_chain) == {NAME: len(salted_chain)}
            assert await index.lookup(chain_of(tokenizer, salted)) == {}
            # nothing else: the index holds what the engine holds
            assert await index.entry_count(NAME) == replica.engine.pool.num_cached
            assert sample(sub, "kvroute_kv_events_applied_total", replica=NAME, type="BlockStored") >= 2
            # lag is measured for every live batch
            lag = sample(sub, "kvroute_kv_event_lag_seconds_count", replica=NAME) - lag_before
            assert lag == sub.status(NAME).batches_applied - applied_before > 0
    finally:
        await replica.stop()


async def test_evicted_blocks_are_removed(tokenizer, session):
    # 8 blocks: each prompt takes 5 full blocks + 1, so every new prompt evicts the last one's
    replica = make_replica(tokenizer, num_gpu_blocks=8)
    await replica.start()
    index = await new_index(replica.num_gpu_blocks)
    try:
        async with following(index, replica.events_endpoint, replica.replay_endpoint, live=replica.publisher) as sub:
            chains = []
            for topic in ("caching", "routing", "batching", "paging"):
                messages = conversation(topic)
                await chat(session, replica, messages)
                await sub.wait_applied(NAME, replica.publisher.next_seq - 1, WAIT_S)
                chains.append(chain_of(tokenizer, messages))
                # the index claims exactly what the engine holds, for every prompt so far
                for chain in chains:
                    depth = await engine_depth(replica, chain)
                    assert (await index.lookup(chain)).get(NAME, 0) == depth
            assert await engine_depth(replica, chains[0]) < len(chains[0])  # eviction did happen
            assert sample(sub, "kvroute_kv_events_applied_total", replica=NAME, type="BlockRemoved") > 0
            assert sample(sub, "kvroute_kv_events_skipped_total", reason="unknown_removed") == 0
    finally:
        await replica.stop()


async def test_reset_prefix_cache_clears_the_replica(tokenizer, session):
    replica = make_replica(tokenizer)
    await replica.start()
    index = await new_index(replica.num_gpu_blocks)
    try:
        async with following(index, replica.events_endpoint, replica.replay_endpoint, live=replica.publisher) as sub:
            messages = conversation("eviction")
            await chat(session, replica, messages)
            await index.record_prediction(NAME, [7, 8, 9])  # predictions go too: the cache is empty
            await sub.wait_applied(NAME, replica.publisher.next_seq - 1, WAIT_S)
            assert await index.entry_count(NAME) > 0
            async with session.post(replica.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            await sub.wait_applied(NAME, replica.publisher.next_seq - 1, WAIT_S)
            assert await index.entry_count(NAME) == 0
            assert sample(sub, "kvroute_kv_events_applied_total", replica=NAME, type="AllBlocksCleared") == 1
            # and the chain is learned again from scratch (the hash map was cleared with it)
            await chat(session, replica, messages)
            await sub.wait_applied(NAME, replica.publisher.next_seq - 1, WAIT_S)
            chain = chain_of(tokenizer, messages)
            assert await index.lookup(chain) == {NAME: len(chain)}
    finally:
        await replica.stop()


async def test_first_contact_replays_the_history_and_drops_stale_entries(tokenizer, session):
    replica = make_replica(tokenizer)
    await replica.start()
    index = await new_index(replica.num_gpu_blocks)
    try:
        messages = [conversation(t) for t in ("first", "second", "third")]
        for m in messages:
            await chat(session, replica, m)  # before any router listens
        await index.confirm(NAME, [111, 222])  # left by an earlier router: not in this history
        async with following(index, replica.events_endpoint, replica.replay_endpoint) as sub:
            for m in messages:
                chain = chain_of(tokenizer, m)
                assert await index.lookup(chain) == {NAME: len(chain)}
            assert await index.lookup([111, 222]) == {}
            status = sub.status(NAME)
            assert status.replays == 1 and status.last_seq == replica.publisher.next_seq - 1
            assert status.checks == 1  # once the connection settled: nothing new
            # the replayed batches are history: no lag is recorded for them
            assert sample(sub, "kvroute_kv_event_lag_seconds_count", replica=NAME) == 0
    finally:
        await replica.stop()


async def test_fleet_events_drive_the_subscriber(tokenizer, session, redis_url, redis_prefix):
    """Registered with event endpoints (as vLLM binds them, ``tcp://*:P``), the replica is watched
    once the fleet has it up; deregistered, it is no longer watched."""
    import redis.asyncio as aioredis

    events_port, replay_port = free_port(), free_port()
    replica = make_replica(tokenizer, events_endpoint=f"tcp://*:{events_port}",
                           replay_endpoint=f"tcp://*:{replay_port}")
    await replica.start()
    client = aioredis.Redis.from_url(redis_url)
    index = MemoryIndex()
    sub = make_subscriber(index)
    record = ReplicaRecord(url=replica.url, model=MODEL, events_endpoint=f"tcp://*:{events_port}",
                           replay_endpoint=f"tcp://*:{replay_port}")
    fleet = Fleet(FleetSettings(discovery_redis=True, redis_url=redis_url, redis_key_prefix=redis_prefix,
                                health_interval_s=0.1, metrics_interval_s=0.1),
                  session, index=index_client(index), redis=client)
    try:
        await register(client, redis_prefix, record, ttl=30)
        fleet.subscribe(sub.on_fleet_event)
        await sub.start()
        await fleet.start()
        assert sub.watched() == [replica.url]
        assert sub.status(replica.url).endpoint == f"tcp://127.0.0.1:{events_port}"
        await sub.wait_synced(replica.url, WAIT_S)
        messages = conversation("fleets")
        await chat(session, replica, messages)
        await sub.wait_applied(replica.url, replica.publisher.next_seq - 1, WAIT_S)
        chain = chain_of(tokenizer, messages)
        assert await index.lookup(chain) == {replica.url: len(chain)}

        await deregister(client, redis_prefix, replica.url)
        await sub.wait_until(lambda: not sub.watched(), WAIT_S)
    finally:
        await fleet.stop()
        await sub.stop()
        await client.aclose()
        await replica.stop()


# -- sequence handling, with a publisher driven by hand --------------------------------------


async def test_a_batch_the_slow_joiner_dropped_is_caught_up_with_nothing_after_it():
    """The PUB drops what it publishes while a new subscription is on its way (ZMQ's slow joiner).
    If that was the replica's last batch, no later seq reveals the gap: the replay the stream asks
    for once its connection has settled brings it."""
    pub = await start_publisher()
    index = await new_index()
    sub = make_subscriber(index, settle_s=2.0)  # the batch below goes out well within it
    try:
        await sub.start()
        sub.watch(NAME, pub.endpoint, pub.replay_endpoint, MODEL)
        await sub.wait_until(lambda: sub.status(NAME).connected, WAIT_S)
        ids = tokens(1000, 1)
        seq = pub.publish_lost([stored([601], None, ids)])  # dropped on its way, then silence
        await sub.wait_synced(NAME, WAIT_S)
        status = sub.status(NAME)
        assert status.last_seq == seq and status.gaps == 0 and status.restarts == 0
        assert status.replays == 2 and status.checks == 1  # first contact, then the check that found it
        assert await index.lookup(router_chain(ids)) == {NAME: 1}
    finally:
        await sub.stop()
        await pub.close()


async def test_a_quiet_stream_asks_whether_it_missed_its_last_batch():
    """A batch the PUB dropped (a full queue) shows as a gap only when a later one arrives; a
    replica that falls silent right after is asked once, ``idle_check_s`` after its last batch."""
    pub = await start_publisher()
    index = await new_index()
    try:
        async with following(index, pub.endpoint, pub.replay_endpoint, live=pub, options={"idle_check_s": 0.5}) as sub:
            ids = tokens(1000, 2)
            seq = pub.publish([stored([701], None, ids[:BS])])
            await sub.wait_applied(NAME, seq, WAIT_S)
            checks0, replays0 = sub.status(NAME).checks, sub.status(NAME).replays
            seq = pub.publish_lost([stored([702], 701, ids[BS:])])  # dropped, then silence
            await sub.wait_applied(NAME, seq, WAIT_S)
            status = sub.status(NAME)
            assert status.checks == checks0 + 1 and status.replays == replays0 + 1 and status.gaps == 0
            assert await index.lookup(router_chain(ids)) == {NAME: 2}
            await asyncio.sleep(1.0)  # quiet, and nothing new: no further check until a live batch
            assert sub.status(NAME).checks == checks0 + 1
    finally:
        await pub.close()


async def test_a_gap_is_filled_by_replay():
    pub = await start_publisher()
    index = await new_index()
    try:
        async with following(index, pub.endpoint, pub.replay_endpoint) as sub:
            await until_live(sub, pub)
            before = sub.status(NAME)
            gaps0, replays0 = before.gaps, before.replays
            ids = tokens(1000, 3)
            chain = router_chain(ids)
            seq = pub.publish([stored([501], None, ids[:BS])])
            await sub.wait_applied(NAME, seq, WAIT_S)
            pub.publish_lost([stored([502], 501, ids[BS:2 * BS])])  # never reaches the socket
            seq = pub.publish([stored([503], 502, ids[2 * BS:])])  # its parent is in the lost batch
            await sub.wait_applied(NAME, seq, WAIT_S)

            assert await index.lookup(chain) == {NAME: 3}
            status = sub.status(NAME)
            assert status.gaps == gaps0 + 1 and status.replays == replays0 + 1 and status.restarts == 0
            assert sample(sub, "kvroute_kv_event_gaps_total", replica=NAME) == gaps0 + 1
            assert sample(sub, "kvroute_kv_event_replays_total", replica=NAME) == replays0 + 1
            assert sample(sub, "kvroute_kv_events_skipped_total", reason="unknown_parent") == 0
    finally:
        await pub.close()


async def test_a_gap_without_replay_drops_confirmed_entries_and_relearns():
    pub = await start_publisher(replay=False)
    index = await new_index()
    try:
        async with following(index, pub.endpoint, None) as sub:
            first, second, third = tokens(1, 2), tokens(2000, 2), tokens(3000, 2)
            # without replay, a batch sent before the subscription reaches the PUB is lost:
            # publish until the first one lands (ZMQ's slow joiner)
            for _ in range(100):
                pub.publish([stored([11, 12], None, first)])
                with contextlib.suppress(TimeoutError):
                    await sub.wait_until(lambda: sub.status(NAME).last_seq is not None, 0.05)
                    break
            await index.record_prediction(NAME, router_chain(third))  # the router's own, not an event
            seq = pub.publish_lost([removed([11, 12])])
            seq = pub.publish([stored([21, 22], None, second)])
            await sub.wait_applied(NAME, seq, WAIT_S)

            assert await index.lookup(router_chain(first)) == {}  # dropped: its removal may be lost
            assert await index.lookup(router_chain(second)) == {NAME: 2}  # relearned
            assert await index.lookup(router_chain(third)) == {NAME: 2}  # predictions stay
            assert sub.status(NAME).gaps == 1
    finally:
        await pub.close()


@pytest.mark.parametrize("replay", [True, False], ids=["with-replay", "without-replay"])
async def test_a_restarted_replica_is_cleared(replay):
    events_port, replay_port = free_port(), free_port()
    pub = await start_publisher(replay=replay, port=events_port, replay_port=replay_port)
    index = await new_index()
    old, new = tokens(1, 2), tokens(5000, 2)
    try:
        async with following(index, pub.endpoint, pub.replay_endpoint) as sub:
            for _ in range(100):  # until one gets through the slow joiner
                pub.publish([stored([31, 32], None, old)])
                with contextlib.suppress(TimeoutError):
                    await sub.wait_until(lambda: sub.status(NAME).last_seq is not None, 0.05)
                    break
            for _ in range(30):  # far ahead of what the new process publishes before we reconnect
                seq = pub.publish([stored([31, 32], None, old)])
            await sub.wait_applied(NAME, seq, WAIT_S)
            assert await index.lookup(router_chain(old)) == {NAME: 2}
            await pub.close()

            # a new process on the same endpoints, counting from 0 again
            pub = await start_publisher(replay=replay, port=events_port, replay_port=replay_port)
            for _ in range(100):
                pub.publish([stored([41, 42], None, new)])
                with contextlib.suppress(TimeoutError):
                    await sub.wait_until(lambda: sub.status(NAME).restarts == 1
                                         and sub.status(NAME).last_seq is not None, 0.05)
                    break
            assert await index.lookup(router_chain(old)) == {}
            assert await index.lookup(router_chain(new)) == {NAME: 2}
            assert sample(sub, "kvroute_kv_event_restarts_total", replica=NAME) == 1
    finally:
        await pub.close()


async def test_a_replica_that_connects_to_a_bound_subscriber():
    """vLLM with a specific-host endpoint connects out; the router's socket binds."""
    port = free_port()
    index = await new_index()
    pub = FaultyPublisher(f"tcp://127.0.0.1:{port}", f"tcp://*:{free_port()}", topic="kv")
    sub = make_subscriber(index)
    await sub.start()
    try:
        await pub.start()  # connects, and retries until the subscriber has bound
        sub.watch(NAME, f"tcp://127.0.0.1:{port}", pub.replay_endpoint, MODEL, bind=True)
        await sub.wait_synced(NAME, WAIT_S)
        ids = tokens(7000, 2)
        for _ in range(100):  # until the connection is up and one batch gets through
            pub.publish([stored([71], None, ids[:BS])])
            with contextlib.suppress(TimeoutError):
                await sub.wait_until(lambda: sub.status(NAME).last_seq is not None, 0.05)
                break
        seq = pub.publish([stored([72], 71, ids[BS:])])
        await sub.wait_applied(NAME, seq, WAIT_S)
        assert await index.lookup(router_chain(ids)) == {NAME: 2}
        assert sub.status(NAME).connected
    finally:
        await sub.stop()
        await pub.close()


# -- formats ---------------------------------------------------------------------------------


class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """vLLM ≤ 0.23: events as positional arrays, the tag first, no LoRA name, no extra keys."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


def test_legacy_positional_events_decode():
    ids = tokens(1, 2)
    payload = msgspec.msgpack.encode([
        12.5,
        [OldBlockStored([1, 2], None, ids, BS, None, "GPU"), OldBlockRemoved([2], "GPU"), OldAllBlocksCleared()],
        0,
    ])
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really positional
    batch = BatchDecoder().decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0 and batch.undecodable == 0
    first, second, third = batch.events
    assert isinstance(first, wire.BlockStored) and first.block_hashes == [1, 2] and first.token_ids == ids
    assert first.parent_block_hash is None and first.lora_name is None and first.extra_keys is None
    assert isinstance(second, wire.BlockRemoved) and second.block_hashes == [2]
    assert isinstance(third, wire.AllBlocksCleared)


def test_map_batch_and_unknown_events_decode():
    """vLLM main sends the batch as a map; an event type from the future is dropped alone."""
    payload = msgspec.msgpack.encode({
        "ts": 3.0,
        "events": [
            {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
             "token_ids": tokens(1, 1), "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [["salt-1"]], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
             "a_field_from_later": 1},
            {"type": "BlockPinned", "block_hashes": [5]},
            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
        ],
        "data_parallel_rank": 1,
    })
    batch = BatchDecoder().decode(payload)
    assert batch.ts == 3.0 and batch.data_parallel_rank == 1 and batch.undecodable == 1
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].extra_keys == [["salt-1"]]
    with pytest.raises(WireError):
        BatchDecoder().decode(b"\xc0")  # msgpack nil: no batch at all


def test_replay_frames_of_both_vllm_versions():
    seq = (7).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    assert wire.parse_replay([b"", seq, b"payload"]) == (7, b"payload")  # vLLM: no topic
    assert wire.parse_replay([b"", b"kv", seq, b"payload"]) == (7, b"payload")  # since #45177
    assert wire.parse_replay([b"", end, b""]) == (wire.END_SEQ, b"")
    assert wire.parse_replay([b"", b"", end, b""]) == (wire.END_SEQ, b"")
    with pytest.raises(WireError):
        wire.parse_live([b"kv", b"\x00\x01", b"payload"])


async def test_legacy_and_map_batches_end_to_end():
    pub = await start_publisher()
    index = await new_index()
    try:
        async with following(index, pub.endpoint, pub.replay_endpoint) as sub:
            await until_live(sub, pub)
            legacy_ids, map_ids = tokens(100, 2), tokens(200, 2)
            pub.publish([OldBlockStored([61, 62], None, legacy_ids, BS, None, "GPU")])  # positional events
            seq = pub.publish_payload(msgspec.msgpack.encode({
                "ts": time.time(),
                "events": [{"type": "BlockStored", "block_hashes": [63, 64], "parent_block_hash": None,
                            "token_ids": map_ids, "block_size": BS, "lora_id": None, "medium": "GPU",
                            "lora_name": None, "extra_keys": [["t1"], None]}],
            }))
            await sub.wait_applied(NAME, seq, WAIT_S)
            assert await index.lookup(router_chain(legacy_ids)) == {NAME: 2}
            assert await index.lookup(router_chain(map_ids, salt="t1")) == {NAME: 2}
    finally:
        await pub.close()


# -- translation rules -------------------------------------------------------------------------


def test_blocks_the_router_cannot_match_are_skipped_and_counted():
    skipped: dict[str, int] = {}

    def skip(reason: str, n: int) -> None:
        skipped[reason] = skipped.get(reason, 0) + n

    t = ChainTranslator(MODEL, capacity_blocks=100)
    ids = tokens(1, 3)
    # another block size than the router hashes this model with
    assert t.stored(stored([1], None, ids[:8], block_size=8), BS, skip) == []
    # tokens that do not fill the blocks
    assert t.stored(stored([1, 2], None, ids[:BS]), BS, skip) == []
    # a parent never seen
    assert t.stored(stored([3], 999, ids[:BS]), BS, skip) == []
    # an offloaded copy, a sliding-window group, a legacy LoRA slot without its name
    assert t.stored(stored([4], None, ids[:BS], medium="CPU"), BS, skip) == []
    assert t.stored(stored([5], None, ids[:BS], group_idx=1, kv_cache_spec_kind="sliding_window"), BS, skip) == []
    assert t.stored(stored([6], None, ids[:BS], lora_id=3), BS, skip) == []
    assert skipped == {"block_size": 1, "token_count": 2, "unknown_parent": 1, "medium": 1, "group": 1,
                       "lora_unknown": 1}
    # a multimodal key on the 2nd block: the 1st is confirmed, the 2nd and its children are not
    mm = stored([7, 8, 9], None, ids, extra_keys=[None, ("image-hash",), None])
    assert t.stored(mm, BS, skip) == router_chain(ids)[:1]
    assert skipped["extra_keys"] == 2
    assert t.stored(stored([10], 8, tokens(500, 1)), BS, skip) == []
    assert skipped["unknown_parent"] == 2
    # removals from the sliding-window group leave the full-attention blocks alone
    assert t.removed(BlockRemoved(block_hashes=[7], medium="GPU", group_idx=1), skip) == []
    assert t.removed(removed([7]), skip) == router_chain(ids)[:1]


def test_lora_blocks_chain_from_the_adapter_namespace():
    def skip(reason: str, n: int) -> None:
        raise AssertionError(f"skipped {n} ({reason})")

    t = ChainTranslator(MODEL, capacity_blocks=100)
    ids = tokens(1, 2)
    # vLLM puts the LoRA name in every block's extra keys, the salt after it on the first
    ev = stored([1, 2], None, ids, lora_name="sql-adapter", extra_keys=[("sql-adapter", "t9"), ("sql-adapter",)])
    assert t.stored(ev, BS, skip) == block_hashes(ids, BS, namespace_seed(MODEL, "sql-adapter", "t9"))


def test_the_hash_map_stays_bounded():
    def skip(reason: str, n: int) -> None:
        pass

    t = ChainTranslator(MODEL, capacity_blocks=16)
    for i in range(400):
        t.stored(stored([10_000 + i], None, tokens(i * BS, 1)), BS, skip)
    assert len(t) == t.capacity < 400
    assert t.router_hash(10_000 + 399) is not None and t.router_hash(10_000) is None  # LRU


# -- several routers, one Redis index ------------------------------------------------------------


async def test_two_subscribers_on_one_redis_index_agree(tokenizer, session, redis_url, redis_prefix):
    """Both apply every event; the shared index ends as one subscriber alone leaves a MemoryIndex."""
    replica = make_replica(tokenizer, num_gpu_blocks=8)  # small: the conversation below evicts
    await replica.start()
    shared = [RedisIndex(redis_url, key_prefix=redis_prefix) for _ in range(2)]
    reference = await new_index(replica.num_gpu_blocks)
    for index in shared:
        await index.add_replica(ReplicaSpec(NAME, replica.num_gpu_blocks, publishes_events=True))
    subs = [make_subscriber(index) for index in (*shared, reference)]
    try:
        for sub in subs[:1] + subs[2:]:  # the second router joins later: it catches up by replay
            await sub.start()
            sub.watch(NAME, replica.events_endpoint, replica.replay_endpoint, MODEL)
            await sub.wait_synced(NAME, WAIT_S)
        chains = []
        for i, topic in enumerate(("one", "two", "three", "four")):
            if i == 2:
                await subs[1].start()
                subs[1].watch(NAME, replica.events_endpoint, replica.replay_endpoint, MODEL)
                await subs[1].wait_synced(NAME, WAIT_S)
            messages = conversation(topic)
            await chat(session, replica, messages)
            chains.append(chain_of(tokenizer, messages))
        last = replica.publisher.next_seq - 1
        for sub in subs:
            await sub.wait_applied(NAME, last, WAIT_S)

        assert await shared[0].entry_count(NAME) == await reference.entry_count(NAME) > 0
        for chain in chains:
            expected = await engine_depth(replica, chain)
            assert (await shared[0].lookup(chain)).get(NAME, 0) == expected
            assert (await shared[1].lookup(chain)).get(NAME, 0) == expected
            assert (await reference.lookup(chain)).get(NAME, 0) == expected
        assert await engine_depth(replica, chains[0]) < len(chains[0])  # removals were part of it
    finally:
        for sub in subs:
            await sub.stop()
        for index in shared:
            await index.close()
        await replica.stop()


# -- index outage ---------------------------------------------------------------------------------


async def test_an_index_outage_is_resynced_from_the_replay_buffer():
    import redis.asyncio as aioredis

    async with own_redis() as server:
        client = aioredis.Redis.from_url(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        index = RedisIndex(client, key_prefix="kv-outage")
        await index.add_replica(ReplicaSpec(NAME, 1000, publishes_events=True))
        pub = await start_publisher()
        kept, evicted, added = tokens(1, 2), tokens(3000, 2), tokens(6000, 2)
        try:
            async with following(index, pub.endpoint, pub.replay_endpoint) as sub:
                await until_live(sub, pub)
                replays0 = sub.status(NAME).replays
                pub.publish([stored([1, 2], None, kept)])
                seq = pub.publish([stored([3, 4], None, evicted)])
                await sub.wait_applied(NAME, seq, WAIT_S)

                server.freeze()  # Redis hangs: writes time out
                pub.publish([removed([3, 4])])
                seq = pub.publish([stored([5, 6], None, added)])
                await sub.wait_until(lambda: not sub.status(NAME).index_ok, WAIT_S)
                server.thaw()
                await sub.wait_until(lambda: sub.status(NAME).index_ok and sub.status(NAME).last_seq == seq, WAIT_S)

                assert await index.lookup(router_chain(kept)) == {NAME: 2}
                assert await index.lookup(router_chain(evicted)) == {}
                assert await index.lookup(router_chain(added)) == {NAME: 2}
                assert sample(sub, "kvroute_kv_events_skipped_total", reason="index_unavailable") >= 1
                assert sub.status(NAME).replays == replays0 + 1  # the resync
        finally:
            await pub.close()
            await client.aclose()


async def test_a_redis_restarted_empty_is_refilled_from_the_replay_buffer():
    async with own_redis() as server:
        index = RedisIndex(server.url, key_prefix="kv-rebuild")
        client = IndexClient(index, refresh_s=0.2)
        await client.start()
        await client.add_replica(ReplicaSpec(NAME, 1000, publishes_events=True))
        pub = await start_publisher()
        held = tokens(1, 2)
        try:
            async with following(client, pub.endpoint, pub.replay_endpoint, live=pub) as sub:
                seq = pub.publish([stored([1, 2], None, held)])
                await sub.wait_applied(NAME, seq, WAIT_S)
                replays0 = sub.status(NAME).replays

                await server.restart()  # empty: the confirmed blocks are gone from the index
                async with asyncio.timeout(WAIT_S):
                    while await client.lookup(router_chain(held)) != {NAME: 2}:
                        await asyncio.sleep(0.05)
                assert client.metrics.rebuilds._value.get() == 1
                assert sub.status(NAME).replays == replays0 + 1  # the resync the rebuild asked for
        finally:
            await pub.close()
            await client.stop()
            await index.close()
