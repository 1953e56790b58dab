"""The shared index under Redis faults: a router in front of emulated replicas, with a Redis of its
own that the tests kill, restart empty and freeze.  Requests must keep succeeding, every index
failure must be counted, a frozen Redis may cost a request at most the lookup budget, and an
emptied Redis must be rebuilt within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from kvroute.router.app import RouterApp
from kvroute.router.index import IndexClient, RedisIndex, ReplicaSpec
from tests.router_support import (
    MODEL,
    RedisProcess,
    emulated_replicas,
    openai_client,
    own_redis,
    running_router,
    sample,
    scrape,
    total,
)

PREFIX = "faults"
INDEX_TIMEOUT_S = 0.2
PROMPT = "A prompt long enough to fill several blocks of the tiny model, repeated. " * 6


async def complete(client, prompt: str):
    return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)


@contextlib.asynccontextmanager
async def routed_with_own_redis() -> AsyncIterator[tuple[RedisProcess, RouterApp, list[str]]]:
    """(Redis, router, replica URLs): a router over 2 emulated replicas, its index in that Redis."""
    async with own_redis() as server, emulated_replicas(2) as reps:
        urls = [r.url for r in reps]
        async with running_router(urls, redis_url=server.url, redis_key_prefix=PREFIX,
                                  index_timeout_s=INDEX_TIMEOUT_S) as app:
            await complete(openai_client(app), PROMPT)
            yield server, app, urls


async def until(predicate, timeout_s: float = 10.0, step_s: float = 0.1) -> float:
    """Seconds until ``await predicate()`` held; TimeoutError after ``timeout_s``."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while not await predicate():
            await asyncio.sleep(step_s)
    return time.monotonic() - started


async def test_killed_redis_requests_succeed_and_every_failure_is_counted():
    async with routed_with_own_redis() as (server, app, _):
        client = openai_client(app)
        await server.kill()
        n = 8
        for i in range(n):
            resp = await complete(client, f"{i} {PROMPT}")
            assert resp.choices
        samples = await scrape(app.url)
        assert total(samples, "kvroute_requests_total", status="200") == n + 1
        # one lookup per request, each failed (no connection) or skipped (known down): all counted
        assert total(samples, "kvroute_index_errors_total", op="lookup") == n
        assert total(samples, "kvroute_index_errors_total", op="lookup", kind="connection") >= 1
        assert total(samples, "kvroute_index_errors_total", op="record_prediction") >= 1
        assert sample(samples, "kvroute_index_available") == 0


async def test_redis_restarted_empty_is_rebuilt_and_routing_learns_again():
    async with routed_with_own_redis() as (server, app, urls):
        client = openai_client(app)
        await server.restart()  # empty: no persistence
        probe = aioredis.Redis.from_url(server.url)
        try:
            async def rebuilt() -> bool:
                return total(await scrape(app.url), "kvroute_index_rebuilds_total") >= 1

            await until(rebuilt)
            registry = await probe.hkeys(f"{app.index.base}:cap")  # re-registered
            assert sorted(k.decode() for k in registry) == sorted(urls)
            before = total(await scrape(app.url), "kvroute_reuse_predicted_tokens_total")
            fresh = "Another conversation, seen after the restart only. " * 6
            await complete(client, fresh)
            again = await complete(client, fresh)  # finds the first one's prediction
            samples = await scrape(app.url)
            assert total(samples, "kvroute_reuse_predicted_tokens_total") > before
            assert again.usage.prompt_tokens_details.cached_tokens > 0  # and the engine held it
            # every key lives a bounded time: a router that leaves leaves nothing for good
            keys = [k async for k in probe.scan_iter(match=f"{PREFIX}:*")]
            assert keys
            assert all([await probe.pttl(k) > 0 for k in keys])
        finally:
            await probe.aclose()


async def test_frozen_redis_costs_a_request_at_most_the_lookup_budget():
    async with routed_with_own_redis() as (server, app, _):
        client = openai_client(app)
        server.freeze()
        try:
            elapsed = []
            for i in range(8):
                started = time.perf_counter()
                resp = await complete(client, f"{i} {PROMPT}")
                elapsed.append(time.perf_counter() - started)
                assert resp.choices
            # the replicas answer at once: all but the lookup budget is the machine's noise
            assert max(elapsed) < INDEX_TIMEOUT_S + 0.8, elapsed
            samples = await scrape(app.url)
            assert total(samples, "kvroute_index_errors_total", op="lookup", kind="timeout") >= 1
            assert total(samples, "kvroute_index_errors_total", op="lookup") == len(elapsed)
        finally:
            server.thaw()

        async def answers() -> bool:
            return sample(await scrape(app.url), "kvroute_index_available") == 1

        await until(answers)
        await complete(client, PROMPT)
        samples = await scrape(app.url)
        assert total(samples, "kvroute_requests_total", status="200") == 10


async def test_writes_beyond_the_queue_are_dropped_and_counted(redis_url, redis_prefix):
    index = RedisIndex(redis_url, key_prefix=redis_prefix)
    client = IndexClient(index, queue_size=2, writers=1)
    try:
        for i in range(5):  # no await in between: the writer has taken none yet
            client.record_prediction("r", [i + 1])
        assert client.metrics.errors.labels("record_prediction", "dropped")._value.get() == 3
    finally:
        await client.stop()
        await index.close()


async def test_a_failing_index_is_skipped_then_probed_until_it_answers():
    async with own_redis() as server:
        index = RedisIndex(server.url, key_prefix=PREFIX)
        client = IndexClient(index, timeout_s=INDEX_TIMEOUT_S, refresh_s=0.5)  # not started: calls probe
        errors = client.metrics.errors
        try:
            assert await client.lookup([1, 2]) == {}  # answered: nothing held
            server.freeze()
            for _ in range(3):
                assert await client.lookup([1, 2]) == {}
            assert errors.labels("lookup", "timeout")._value.get() == 3
            started = time.perf_counter()
            assert await client.lookup([1, 2]) == {}
            assert time.perf_counter() - started < INDEX_TIMEOUT_S  # skipped, not waited for
            assert errors.labels("lookup", "unavailable")._value.get() == 1
            assert client.metrics.available._value.get() == 0
            server.thaw()
            await asyncio.sleep(0.6)  # past refresh_s: the next call probes
            assert await client.lookup([1, 2]) == {}
            assert client.metrics.available._value.get() == 1
            assert errors.labels("lookup", "unavailable")._value.get() == 1
        finally:
            server.thaw()
            await client.stop()
            await index.close()


async def test_a_replica_another_router_took_out_is_registered_again_by_a_router_routing_there(
    redis_url, redis_prefix
):
    ours, theirs = (IndexClient(RedisIndex(redis_url, key_prefix=redis_prefix)) for _ in range(2))
    spec = ReplicaSpec("r", 1000)
    try:
        for client in (ours, theirs):
            assert await client.add_replica(spec)
        assert await theirs.remove_replica("r")  # it saw the replica down; we still route there
        ours.record_prediction("r", [7, 8, 9])  # unregistered: registered again, then written
        async with asyncio.timeout(10):
            while await ours.lookup([7, 8, 9]) != {"r": 3}:
                await asyncio.sleep(0.05)
    finally:
        for client in (ours, theirs):
            await client.stop()
            await client.backend.close()
