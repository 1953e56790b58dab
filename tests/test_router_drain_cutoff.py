"""The drain timeout is enforced: SIGTERM with a long stream and a long non-streamed request in
flight, ``--drain-timeout-s 1``: the stream ends with an OpenAI error event and ``[DONE]``, the
other request gets a 503 in OpenAI's shape, and the process exits about a second later, not when
the generations would have ended (minutes)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp

from tests.router_support import MODEL, RouterProcess, emulated_replicas, running_router, scrape, total

DRAIN_S = 1.0


def chat(stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 20_000, "stream": stream}


async def test_drain_timeout_ends_streams_and_requests_then_exits():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        router = await RouterProcess.start([rep.url], "--drain-timeout-s", str(DRAIN_S))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(router.url + "/v1/chat/completions", json=chat(True)) as streaming:
                    assert streaming.status == 200
                    await streaming.content.readline()
                    whole = asyncio.create_task(s.post(router.url + "/v1/chat/completions", json=chat(False)))
                    await asyncio.sleep(0.5)
                    signalled = time.monotonic()
                    router.proc.send_signal(signal.SIGTERM)
                    rest = await asyncio.wait_for(streaming.read(), 30)
                    ended = time.monotonic() - signalled
                resp = await asyncio.wait_for(whole, 30)
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "router_shutting_down"
            events = [line[6:] for line in rest.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "router_shutting_down"
            assert DRAIN_S * 0.8 < ended < DRAIN_S + 5
            assert await asyncio.wait_for(router.proc.wait(), DRAIN_S + 10) == 0
            assert time.monotonic() - signalled < DRAIN_S + 5
        finally:
            await router.stop()


async def test_requests_cut_at_the_drain_timeout_are_counted_as_503_not_as_client_disconnects():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url]) as app:
            async with aiohttp.ClientSession() as s:
                async with s.post(app.url + "/v1/chat/completions", json=chat(True)) as streaming:
                    await streaming.content.readline()
                    assert await app.drain(timeout_s=0.3) is False
                    assert await app.cutoff.cut() == 1
                    rest = await asyncio.wait_for(streaming.read(), 10)
            assert rest.rstrip().endswith(b"data: [DONE]") and b"router_shutting_down" in rest
            samples = await scrape(app.url)
            assert total(samples, "kvroute_requests_total", status="503") == 1
            assert total(samples, "kvroute_requests_total", status="499") == 0


async def test_the_access_line_of_a_request_cut_at_the_drain_timeout_names_its_route(caplog):
    # what the handler learned comes back with the cancellation (no side channel): the cutoff's answer
    # carries it to the access log
    caplog.set_level("INFO", logger="kvroute.access")
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url]) as app:
            async with aiohttp.ClientSession() as s:
                whole = asyncio.create_task(s.post(app.url + "/v1/chat/completions", json=chat(False)))
                await asyncio.sleep(0.5)
                assert await app.cutoff.cut() == 1
                resp = await asyncio.wait_for(whole, 10)
                assert resp.status == 503
                resp.release()
            await asyncio.sleep(0.05)  # the line is written a loop turn after the answer
    lines = [r for r in caplog.records if r.name == "kvroute.access"]
    assert len(lines) == 1
    assert lines[0].status == 503 and lines[0].replica == rep.url and lines[0].model == MODEL
    assert lines[0].reason and lines[0].attempts == 1
