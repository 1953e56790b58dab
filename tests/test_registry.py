"""Replica registration in a real Redis (keys under the test's own prefix)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvroute.common.registration import (
    ReplicaRecord,
    deregister,
    heartbeat,
    keep_registered,
    list_replicas,
    names_key,
    record_key,
    register,
)


@pytest.fixture
async def redis(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def wait_until(predicate, timeout: float = 5.0) -> None:
    async def poll():
        while not await predicate():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout)


def test_record_defaults_and_hash_shape():
    rec = ReplicaRecord(url="http://10.0.0.5:8000/", model="m", block_size=16)
    assert rec.url == "http://10.0.0.5:8000"
    assert rec.name == rec.url
    h = rec.to_hash()
    assert h["block_size"] == "16" and h["engine"] == "vllm"
    assert "events_endpoint" not in h  # unset fields are not written


async def test_register_list_roundtrip(redis, redis_prefix):
    a = ReplicaRecord(
        url="http://127.0.0.1:9001",
        model="m",
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        block_size=32,
        capacity_blocks=1234,
        engine="emulated",
    )
    b = ReplicaRecord(url="http://127.0.0.1:9002", model="m")
    await register(redis, redis_prefix, a, ttl=10)
    await register(redis, redis_prefix, b, ttl=10)
    assert await list_replicas(redis, redis_prefix) == [a, b]
    ttl_ms = await redis.pttl(record_key(redis_prefix, a.name))
    assert 0 < ttl_ms <= 10_000


async def test_reregistration_drops_fields_no_longer_set(redis, redis_prefix):
    rec = ReplicaRecord(url="http://127.0.0.1:9001", events_endpoint="tcp://127.0.0.1:5557")
    await register(redis, redis_prefix, rec, ttl=10)
    rec2 = ReplicaRecord(url="http://127.0.0.1:9001")
    await register(redis, redis_prefix, rec2, ttl=10)
    [listed] = await list_replicas(redis, redis_prefix)
    assert listed.events_endpoint is None


async def test_lapsed_registration_disappears_and_is_pruned(redis, redis_prefix):
    rec = ReplicaRecord(url="http://127.0.0.1:9003")
    await register(redis, redis_prefix, rec, ttl=0.3)
    assert [r.url for r in await list_replicas(redis, redis_prefix)] == [rec.url]

    async def gone():
        return await list_replicas(redis, redis_prefix) == []

    await wait_until(gone)
    assert not await redis.sismember(names_key(redis_prefix), rec.name)


async def test_heartbeat_refreshes_and_rewrites_a_lapsed_record(redis, redis_prefix):
    rec = ReplicaRecord(url="http://127.0.0.1:9004", model="m")
    await register(redis, redis_prefix, rec, ttl=0.5)
    assert await heartbeat(redis, prefix=redis_prefix, record=rec, ttl=30) is True
    assert await redis.pttl(record_key(redis_prefix, rec.name)) > 1000
    await redis.delete(record_key(redis_prefix, rec.name))  # as if the TTL had lapsed
    assert await heartbeat(redis, redis_prefix, rec, ttl=30) is False
    assert await list_replicas(redis, redis_prefix) == [rec]


async def test_deregister(redis, redis_prefix):
    rec = ReplicaRecord(url="http://127.0.0.1:9005")
    await register(redis, redis_prefix, rec, ttl=10)
    await deregister(redis, redis_prefix, rec.name)
    assert await list_replicas(redis, redis_prefix) == []
    assert await redis.exists(record_key(redis_prefix, rec.name)) == 0


async def test_malformed_registration_is_skipped(redis, redis_prefix):
    good = ReplicaRecord(url="http://127.0.0.1:9006")
    await register(redis, redis_prefix, good, ttl=10)
    await redis.hset(record_key(redis_prefix, "junk"), mapping={"block_size": "many"})
    await redis.sadd(names_key(redis_prefix), "junk")
    assert await list_replicas(redis, redis_prefix) == [good]


async def test_keep_registered_outlives_its_ttl_then_lapses_when_stopped(redis, redis_prefix):
    rec = ReplicaRecord(url="http://127.0.0.1:9007")
    task = asyncio.create_task(keep_registered(redis, redis_prefix, rec, ttl=0.6, interval=0.1))
    try:
        await asyncio.sleep(1.2)  # twice the TTL: only heartbeats can keep it listed
        assert await list_replicas(redis, redis_prefix) == [rec]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def gone():
        return await list_replicas(redis, redis_prefix) == []

    await wait_until(gone)
