"""Timeouts against a replica that is up (healthy, lists its model) but whose engine is stuck:
no first byte -> retried elsewhere; silent mid-stream -> error event and [DONE]."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, sample, scrape


class StuckReplica:
    """A real HTTP server that answers probes like a replica but never finishes a generation."""

    def __init__(self, first_event: bool):
        self.first_event = first_event  # send one SSE event before going silent
        self.hits = 0
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_get("/metrics", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._stuck)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        self.url = ""

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _stuck(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.first_event:
            await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        await asyncio.sleep(3600)
        return resp

    async def __aenter__(self) -> StuckReplica:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


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
            assert sample(samples, "kvroute_upstream_failures_total", replica=stuck.url, stage="first_byte") == stuck.hits


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
