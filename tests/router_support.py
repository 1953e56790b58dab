"""Helpers of the router tests: real emulated replicas (in this process or a killable child
process), a router in front of them, and a Prometheus scrape parser."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from kvroute.router.app import RouterApp
from kvroute.router.index.base import PrefixIndex
from kvroute.router.index.client import IndexClient
from kvroute.router.config import RouterSettings

REPO = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = str(REPO / "tests" / "assets" / "tiny-tokenizer")
MODEL = "tiny"


@contextlib.asynccontextmanager
async def emulated_replicas(
    n: int, *, model: str = MODEL, time_scale: float = 0.0, **config: Any
) -> AsyncIterator[list[EmulatedReplica]]:
    """``n`` emulated replicas on loopback; ``time_scale`` 0 answers at once."""
    async with started(*(EmulatedReplica(ReplicaConfig(model=model, time_scale=time_scale, **config))
                         for _ in range(n))) as reps:
        yield reps


@contextlib.asynccontextmanager
async def started(*replicas: EmulatedReplica) -> AsyncIterator[list[EmulatedReplica]]:
    """``replicas`` started in order, and those that started stopped at the end."""
    up: list[EmulatedReplica] = []
    try:
        for r in replicas:
            await r.start()
            up.append(r)
        yield up
    finally:
        for r in up:
            await r.stop()


def router_settings(replica_urls: list[str], **overrides: Any) -> RouterSettings:
    fleet = {"health_interval_s": 30.0, "metrics_interval_s": 30.0, **overrides.pop("fleet", {})}
    values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "replicas": replica_urls, "tokenizer": TINY_TOKENIZER}
    values.update(overrides)
    return RouterSettings(fleet=fleet, **values)


_clients: dict[int, list[openai.AsyncOpenAI]] = {}


@contextlib.asynccontextmanager
async def running_router(replica_urls: list[str], **overrides: Any) -> AsyncIterator[RouterApp]:
    app = RouterApp(router_settings(replica_urls, **overrides))
    await app.start()
    try:
        yield app
    finally:
        for client in _clients.pop(id(app), []):
            await client.close()
        await app.stop()


def openai_client(app: RouterApp, api_key: str = "unused") -> openai.AsyncOpenAI:
    """The official client against ``app``, closed when the router stops."""
    client = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key=api_key, max_retries=0)
    _clients.setdefault(id(app), []).append(client)
    return client


_CHILD = """
import asyncio, sys
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig

async def main():
    rep = EmulatedReplica(ReplicaConfig(model=sys.argv[1], time_scale=float(sys.argv[2]), port=int(sys.argv[3])))
    await rep.start()
    print(rep.url, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class ReplicaProcess:
    """An emulated replica in a child process, so a test can SIGKILL it like a crashed engine."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str):
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, *, model: str = MODEL, time_scale: float = 0.0, port: int = 0) -> ReplicaProcess:
        """``port`` 0: any free port; a given one restarts a killed replica at its old URL."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, model, str(time_scale), str(port), stdout=asyncio.subprocess.PIPE,
            cwd=str(REPO),
        )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        url = line.decode().strip()
        assert url.startswith("http://"), f"replica process did not start: {line!r}"
        return cls(proc, url)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


class RedisProcess:
    """A private redis-server on a free port, without persistence, that a test may kill, restart
    empty on the same port, or freeze (the shared server must never be touched like that)."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        import redis.asyncio as aioredis

        self.proc = await asyncio.create_subprocess_exec(
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        probe = aioredis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            for attempt in range(200):
                try:
                    await probe.ping()
                    return
                except (aioredis.ConnectionError, OSError):
                    if attempt == 199:
                        raise
                    await asyncio.sleep(0.01)
        finally:
            await probe.aclose()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen process dies only once it runs
            self.proc.kill()
            await self.proc.wait()

    async def restart(self) -> None:
        """Killed and started again: empty, as a Redis without persistence comes back."""
        await self.kill()
        await self.start()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@contextlib.asynccontextmanager
async def own_redis() -> AsyncIterator[RedisProcess]:
    from tests.conftest import free_port

    server = RedisProcess(free_port())
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``url``/metrics, keyed by (name, sorted labels)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def label(url: str) -> str:
    """The ``replica`` label of a replica listed by URL with no name (a --replicas entry, a
    registration without one): its host:port (router/fleet/discovery/labels.py)."""
    return urllib.parse.urlsplit(url).netloc


def sample(samples: dict, name: str, **labels: str) -> float:
    """One sample's value; KeyError if the series does not exist (a missing series is a bug)."""
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum over the series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


class ScriptedReplica:
    """A real HTTP server that answers probes like a replica serving MODEL; a subclass scripts
    its chat endpoint (``chat``) to misbehave in one precise way."""

    def __init__(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_get("/metrics", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        self.url = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    @staticmethod
    async def stream_tokens(request: web.Request, tokens: int, gap_s: float, *, wait_first: bool) -> web.StreamResponse:
        """A chat stream of ``tokens`` one-token chunks ``gap_s`` apart (and before the first with
        ``wait_first``), with no usage, then ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            if i or wait_first:
                await asyncio.sleep(gap_s)
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def __aenter__(self) -> Any:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


class RouterProcess:
    """``kvroute router`` in a child process on a free port: its own event loop, its RSS readable,
    signals deliverable (``proc.send_signal``)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str):
        self.proc = proc
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])

    @classmethod
    async def start(
        cls, replica_urls: list[str], *args: str, tokenizer: str = TINY_TOKENIZER, env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> RouterProcess:
        """``prefix``: a command the router runs under (e.g. ``prlimit --nofile=1024:1024``)."""
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0",
            "--replicas", ",".join(replica_urls), "--tokenizer", tokenizer, "--log-level", "warning", *args,
            stdout=asyncio.subprocess.PIPE, cwd=str(REPO), env=env,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        url = line.rsplit(" ", 1)[-1].strip()
        if not url.startswith(("http://", "https://")):
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"router process did not start: {line!r}")
        return cls(proc, url)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def index_client(index: PrefixIndex | IndexClient) -> IndexClient:
    """``index`` itself if it is a client, else a client of its own over it (tests hand components
    a bare backend; the router hands them its one client)."""
    return index if isinstance(index, IndexClient) else IndexClient(index)
