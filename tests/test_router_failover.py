"""Failures: a replica killed mid-test (retried elsewhere before the first byte), a replica dying
mid-stream (error event, then [DONE]), the in-flight limit (429), a client that disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from tests.router_support import (
    label,
    MODEL,
    ReplicaProcess,
    ScriptedReplica,
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
            assert sample(before, "kvroute_requests_total", model=MODEL, replica=label(doomed.url), status="200") == 1

            await doomed.kill()
            for i in range(4):  # round robin sends every other one to the dead replica
                stream = i % 2 == 1
                resp = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=stream)
                if stream:
                    assert [c async for c in resp]
                else:
                    assert resp.choices[0].message.content

            after = await scrape(app.url)
            assert sample(after, "kvroute_requests_total", model=MODEL, replica=label(survivor.url), status="200") == 5
            assert sample(after, "kvroute_routing_decisions_total", policy="round_robin", reason="failover") >= 1
            assert sample(after, "kvroute_upstream_failures_total", replica=label(doomed.url), stage="connect") >= 1
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
            assert sample(samples, "kvroute_upstream_failures_total", replica=label(slow.url), stage="mid_stream") == 1
    finally:
        await slow.kill()


async def test_in_flight_limit_answers_429_with_retry_after():
    """Without a queue (max_queue_wait_s 0) the limit answers at once (tests/test_router_overload.py: with one)."""
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url], max_in_flight=1, retry_after_s=3, max_queue_wait_s=0) as app:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 60, "stream": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(app.url + "/v1/chat/completions", json=body) as streaming:
                    await streaming.content.readline()  # in flight now
                    async with s.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                        assert r.status == 429 and r.headers["Retry-After"] == "3"
                        error = (await r.json())["error"]
                        assert error["type"] == "rate_limit_error" and error["code"] == "router_overloaded"
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
            assert sample(samples, "kvroute_replica_in_flight", replica=label(rep.url)) == 0


async def _running(url: str) -> float:
    samples = await scrape(url)
    return total(samples, "vllm:num_requests_running")


class LingeringReplica(ScriptedReplica):
    """Its stream sends [DONE] and then waits before ending the HTTP response."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.5)  # the client has everything and leaves in the meantime
        await resp.write_eof()
        return resp


async def test_client_that_leaves_after_done_is_counted_as_answered(caplog):
    async with LingeringReplica() as rep, running_router([rep.url]) as app:
        host, port = app.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": MODEL, "messages": MSGS, "stream": True}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 5)
        writer.close()  # gone before the response's last chunk
        assert b'"content": "a"' in received
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            samples = await scrape(app.url)
            if total(samples, "kvroute_requests_total", status="200"):
                break
            await asyncio.sleep(0.05)
        assert total(samples, "kvroute_requests_total", status="200") == 1
        assert total(samples, "kvroute_requests_total") == 1
        assert sample(samples, "kvroute_reuse_delivered_tokens_total", model=MODEL) == 0
        assert sample(samples, "kvroute_in_flight") == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_half_open_trial_is_the_request_routed_there():
    # Round robin alternates over [a, b]: the first request after a's cooldown goes to b.  Being
    # offered a (and passing it over) must not use up a's trial: the next request is a's trial.
    async with emulated_replicas(2) as (a, b):
        fleet = {"breaker_failures": 1, "breaker_cooldown_s": 1.0}
        async with running_router([a.url, b.url], policy="round_robin", fleet=fleet) as app:
            client = openai_client(app, "x")
            app.fleet.report_failure(a.url)  # as a failed request would: a's circuit opens
            await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)  # to b
            deadline = time.monotonic() + 5
            while app.fleet.get(a.url).breaker.state != "half_open":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            for _ in range(4):
                await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
            samples = await scrape(app.url)
            assert sample(samples, "kvroute_requests_total", model=MODEL, replica=label(a.url), status="200") == 2
            assert app.fleet.get(a.url).breaker.state == "closed"
