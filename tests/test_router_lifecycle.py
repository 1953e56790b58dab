"""Draining: SIGTERM (or ``RouterApp.drain``) turns /ready to 503 while requests in flight finish;
``kvroute router`` runs as a process and exits cleanly."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import pytest

from kvroute.router.app import RouterApp
from tests.conftest import free_port
from tests.router_support import MODEL, REPO, TINY_TOKENIZER, emulated_replicas, router_settings, running_router

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 40, "stream": True}


async def test_drain_waits_for_in_flight_and_turns_ready_503():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        async with running_router([rep.url]) as app:
            async with aiohttp.ClientSession() as s:
                async with s.post(app.url + "/v1/chat/completions", json=BODY) as streaming:
                    await streaming.content.readline()
                    drained = asyncio.create_task(app.drain(timeout_s=30))
                    await asyncio.sleep(0)
                    async with s.get(app.url + "/ready") as r:
                        assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
                    assert not drained.done()
                    rest = await streaming.read()
                assert rest.rstrip().endswith(b"data: [DONE]")
                assert await asyncio.wait_for(drained, 5) is True
                assert app.in_flight == 0


async def test_router_process_drains_on_sigterm():
    async with emulated_replicas(1, time_scale=1.0) as (rep,):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0",
            "--replicas", rep.url, "--tokenizer", TINY_TOKENIZER, "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, cwd=str(REPO),
        )
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            url = line.rsplit(" ", 1)[-1].strip()
            assert url.startswith("http://127.0.0.1:"), line
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/ready") as r:
                    assert r.status == 200
                async with s.post(url + "/v1/chat/completions", json=BODY) as streaming:
                    await streaming.content.readline()
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.2)
                    async with s.get(url + "/ready") as r:
                        assert r.status == 503
                    rest = await streaming.read()
                assert rest.rstrip().endswith(b"data: [DONE]")
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_port_in_use_fails_start_and_leaves_nothing_open():
    async with emulated_replicas(1) as (rep,):
        async with running_router([rep.url]) as first:
            second = RouterApp(router_settings([rep.url], port=first.port))
            with pytest.raises(OSError):
                await second.start()
            assert second.session.closed


async def test_health_can_require_a_healthy_replica():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with aiohttp.ClientSession() as http:
        async with running_router([dead]) as app:  # default: liveness only
            async with http.get(app.url + "/health") as resp:
                assert resp.status == 200
        async with running_router([dead], health_requires_replica=True) as app:
            async with http.get(app.url + "/health") as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_replica_available"
        async with emulated_replicas(1) as (rep,):
            async with running_router([rep.url], health_requires_replica=True) as app:
                async with http.get(app.url + "/health") as resp:
                    assert resp.status == 200
