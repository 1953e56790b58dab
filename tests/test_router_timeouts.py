"""Timeouts against a replica that is up (healthy, lists its model) but whose engine is stuck:
no first byte -> retried elsewhere; silent mid-stream -> error event and [DONE]."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from tests.router_support import (
    label,
    MODEL,
    ScriptedReplica,
    emulated_replicas,
    openai_client,
    running_router,
    sample,
    scrape,
)


class StuckReplica(ScriptedReplica):
    """Answers probes like a replica but never finishes a generation."""

    def __init__(self, first_event: bool):
        super().__init__()
        self.first_event = first_event  # send one SSE event before going silent
        self.hits = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.first_event:
            await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        await asyncio.sleep(3600)
        return resp


async def test_no_first_byte_times_out_and_fails_over():
    async with StuckReplica(first_event=False) as stuck, emulated_replicas(1) as (good,):
        async with running_router([stuck.url, good.url], policy="round_robin", first_byte_timeout_s=0.3) as app:
            client = openai_client(app, "x")
            for stream in (False, True, False, True):
                resp = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream
                )
                assert [c async for c in resp] if stream else resp.choices
            assert stuck.hits >= 1
            samples = await scrape(app.url)
            assert sample(samples, "kvroute_upstream_failures_total", replica=label(stuck.url), stage="first_byte") == stuck.hits


async def test_silent_stream_ends_with_error_event_after_idle_timeout():
    async with StuckReplica(first_event=True) as stuck:
        async with running_router([stuck.url], idle_timeout_s=0.3) as app:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with aiohttp.ClientSession() as s, s.post(app.url + "/v1/chat/completions", json=body) as r:
                text = (await asyncio.wait_for(r.read(), 5)).decode()
            events = [e for e in text.split("\n\n") if e.strip()]
            assert events[0].startswith('data: {"choices"')
            assert events[-1] == "data: [DONE]"
            assert "sent nothing for 0.3 s" in json.loads(events[-2][len("data: "):])["error"]["message"]
