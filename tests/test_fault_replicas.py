"""Replica faults under load: a replica SIGKILLed while ~20 streaming requests a second go through
the router, then restarted at the same URL.  Real replica processes, the openai client, the router
with the default health settings.  Bounds (issue 12): no request fails before its first
byte, the dead replica is out of rotation within 2 s, and it takes traffic within 5 s of answering
its health checks again.  And a replica that leaves the fleet for good leaves no metric series or
per-replica state behind.  (Client disconnects aborting at the replica: test_router_failover.py.)"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import openai

from tests.router_support import MODEL, ReplicaProcess, emulated_replicas, openai_client, running_router, scrape, total, label

MSGS = [{"role": "user", "content": "hello"}]
RATE = 20.0  # requests per second
# the fleet's defaults, spelt out (tests/router_support.py slows health checks down otherwise)
FLEET = {"health_interval_s": 2.0, "health_timeout_s": 1.0, "unhealthy_after": 3, "metrics_interval_s": 1.0}


@dataclass
class Tally:
    answered: int = 0
    failed_before_first_byte: list[str] = field(default_factory=list)
    cut_mid_stream: int = 0  # streams that were on the killed replica: they end with an error event


async def _one(client: openai.AsyncOpenAI, n: int, tally: Tally) -> None:
    # distinct prompts: no cache affinity pulls traffic away from an empty restarted replica
    messages = [{"role": "user", "content": f"request {n}: tell me about routers and caches"}]
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    except openai.APIError as exc:
        tally.failed_before_first_byte.append(repr(exc))
        return
    try:
        async for _ in stream:
            pass
        tally.answered += 1
    except openai.APIError:
        tally.cut_mid_stream += 1


async def _load(client: openai.AsyncOpenAI, tally: Tally, stop: asyncio.Event) -> None:
    """Open-loop: a new request every 1/RATE s whatever the earlier ones are doing."""
    tasks = []
    started = time.monotonic()
    for n in itertools.count():
        delay = started + n / RATE - time.monotonic()
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, delay))
            break
        except TimeoutError:
            pass
        tasks.append(asyncio.create_task(_one(client, n, tally)))
    await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def _within(seconds: float, predicate: Callable[[], object], step: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds (awaited if it returns an awaitable); fails after ``seconds``."""
    started = time.monotonic()
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - started
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        await asyncio.sleep(step)


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            return r.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def _served(url: str) -> bool:
    """The replica process has taken a request (running now, or finished one)."""
    try:
        samples = await scrape(url)
    except (aiohttp.ClientError, OSError, AssertionError):
        return False
    return total(samples, "vllm:num_requests_running") + total(samples, "vllm:request_success_total") > 0


async def test_sigkill_and_restart_under_load():
    # time_scale 0.05: each stream lasts tens of ms, so some are in flight on the killed replica
    reps = [await ReplicaProcess.start(time_scale=0.05) for _ in range(3)]
    victim = reps[0]
    port = int(victim.url.rsplit(":", 1)[1])
    try:
        async with running_router([r.url for r in reps], fleet=FLEET) as app, aiohttp.ClientSession() as http:
            tally, stop = Tally(), asyncio.Event()
            load = asyncio.create_task(_load(openai_client(app), tally, stop))
            await asyncio.sleep(1.5)
            assert await _served(victim.url)  # it was taking its share before the kill

            await victim.kill()
            out_after = await _within(2.0, lambda: victim.url not in {r.name for r in app.fleet.eligible(MODEL)})
            await asyncio.sleep(1.0)

            victim = reps[0] = await ReplicaProcess.start(time_scale=0.05, port=port)
            await _within(10.0, lambda: _healthy(http, victim.url))
            back_after = await _within(5.0, lambda: _served(victim.url), step=0.05)
            await asyncio.sleep(0.5)
            stop.set()
            await load

            assert tally.failed_before_first_byte == []
            assert tally.answered >= 3 * RATE  # the load did run throughout
            samples = await scrape(app.url)
            assert total(samples, "kvroute_requests_total", status="502") == 0
            print(f"\nout of rotation {out_after:.2f} s after SIGKILL; traffic {back_after:.2f} s after healthy; "
                  f"{tally.answered} answered, {tally.cut_mid_stream} cut mid-stream, 0 failed before the first byte")
    finally:
        for r in reps:
            await r.kill()


async def test_a_replica_that_leaves_leaves_no_series_or_state_behind(redis_url, redis_prefix):
    # Pods come and go with new addresses: a departed replica's metrics series and per-replica
    # state must go with it, or a long-lived router grows with every restart of the fleet.
    import redis.asyncio as aioredis

    from kvroute.common.registration import ReplicaRecord, keep_registered

    async with emulated_replicas(2) as (kept, lapsing):
        client = aioredis.Redis.from_url(redis_url)
        hearts = [
            asyncio.create_task(keep_registered(client, redis_prefix, ReplicaRecord(url=r.url, model=MODEL), ttl=1.0,
                                                interval=0.2))
            for r in (kept, lapsing)
        ]
        try:
            fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix,
                     "health_interval_s": 0.2}
            async with running_router([], policy="round_robin", fleet=fleet) as app:
                await _within(10.0, lambda: len(app.fleet.eligible(MODEL)) == 2)  # both discovered, both up
                openai = openai_client(app)
                for _ in range(4):
                    await openai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
                before = await scrape(app.url)
                assert total(before, "kvroute_requests_total", replica=label(lapsing.url)) == 2

                hearts[1].cancel()  # `lapsing` stops heartbeating: its registration expires, it leaves
                await _within(5.0, lambda: app.fleet.get(lapsing.url) is None)
                after = await scrape(app.url)
                assert not [key for key in after if ("replica", label(lapsing.url)) in key[1]]
                assert total(after, "kvroute_requests_total", replica=label(kept.url)) == 2
                assert lapsing.url not in app.load.states
        finally:
            for heart in hearts:
                heart.cancel()
            await client.aclose()
