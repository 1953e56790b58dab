"""Failures: a replica killed mid-test (retried elsewhere before the first byte), a replica dying
mid-stream (error event, then [DONE]), the in-flight limit (429), a client that disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.router_support import (
    MODEL,
    ReplicaProcess,
    emulated_replicas,
    openai_client,
    running_router,
    sample,
    scrape,
    total,
)

MSGS = [{"role": "user", "content": "Tell me a long story about routers."}]


@pytest.fixture
async def doomed():
    rep = await ReplicaProcess.start()
    yield rep
    await rep.kill()


async def test_killed_replica_fails_over_before_first_byte(doomed):
    async with emulated_replicas(1) as (survivor,):
        async with running_router([doomed.url, survivor.url], policy="round_robin") as app:
            client = openai_client(app, "x")
            for _ in range(2):  # both replicas serve while alive
                await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
            before = await scrape(app.url)
            assert sample(before, "kvroute_requests_total", model=MODEL, replica=doomed.url, status="200") == 1

            await doomed.kill()
            for i in range(4):  # round robin sends every other one to the dead replica
                stream = i % 2 == 1
                resp = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=stream)
                if stream:
                    assert [c async for c in resp]
                else:
                    assert resp.choices[0].message.content

            after = await scrape(app.url)
            assert sample(after, "kvroute_requests_total", model=MODEL, replica=survivor.url, status="200") == 5
            assert sample(after, "kvroute_routing_decisions_total", policy="round_robin", reason="failover") >= 1
            assert sample(after, "kvroute_upstream_failures_total", replica=doomed.url, stage="connect") >= 1
            assert total(after, "kvroute_requests_total", status="502") == 0


async def test_all_replicas_down_is_502_in_error_shape(doomed):
    async with running_router([doomed.url], retry_attempts=1) as app:
        await doomed.kill()
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
            async with s.post(app.url + "/v1/chat/completions", json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 502 and err["code"] == "upstream_unavailable"


async def test_replica_dying_mid_stream_ends_with_error_event_and_done():
    slow = await ReplicaProcess.start(time_scale=1.0)  # real-time decode: the stream lasts seconds
    try:
        async with running_router([slow.url]) as app:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 2000, "stream": True}
            async with aiohttp.ClientSession() as s, s.post(app.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: {")
                await slow.kill()
                rest = (await asyncio.wait_for(r.read(), 10)).decode()
            events = [e for e in (first.decode() + rest).split("\n\n") if e.strip()]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: "):])["error"]
            assert err["code"] == "upstream_error" and "mid-stream" in err["message"]
            samples = await scrape(app.url)
            assert sample(samples, "kvroute_upstream_failures_total", replica=slow.url, stage="mid_stream") == 1
    finally:
        await slow.kill()


async def test_in_flight_limit_answers_429_with_retry_after():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url], max_in_flight=1, retry_after_s=3) as app:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 60, "stream": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(app.url + "/v1/chat/completions", json=body) as streaming:
                    await streaming.content.readline()  # in flight now
                    async with s.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                        assert r.status == 429 and r.headers["Retry-After"] == "3"
                        assert (await r.json())["error"]["type"] == "rate_limit_error"
                    await streaming.read()
                async with s.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 200


async def test_client_disconnect_aborts_upstream_request():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url]) as app:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5000, "stream": True}
            async with aiohttp.ClientSession() as s:
                r = await s.post(app.url + "/v1/chat/completions", json=body)
                await r.content.readline()
                assert await _running(rep.url) == 1
                r.close()  # the client goes away mid-stream
            deadline = time.monotonic() + 5
            while await _running(rep.url) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await _running(rep.url) == 0  # the engine stopped generating for nobody
            samples = await scrape(app.url)
            assert sample(samples, "kvroute_in_flight") == 0
            assert sample(samples, "kvroute_replica_in_flight", replica=rep.url) == 0


async def _running(url: str) -> float:
    samples = await scrape(url)
    return total(samples, "vllm:num_requests_running")
