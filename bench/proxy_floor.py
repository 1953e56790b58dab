"""Proxies that do nothing but forward: the floor under any Python router's CPU per request.

``python -m kvroute.bench.proxy_floor --server aiohttp|protocol URL [URL ...]`` listens on a free port
(``--port``), prints ``listening on http://127.0.0.1:PORT`` and sends each POST, body untouched,
to the next replica in turn through the router's own upstream client (``kvroute.router.forwarding.upstream``), then
returns the replica's answer whole.  No JSON is parsed, nothing is tokenized, hashed or counted.

* ``aiohttp``: an aiohttp web application with one handler, as the router is built (aiohttp's
  server on uvloop): what aiohttp itself costs per request.
* ``protocol``: a bare ``asyncio.Protocol`` on uvloop that finds the end of the head and
  ``Content-Length`` with ``bytes.find``: what Python and the kernel cost, without a framework.

``kvroute.bench.router_overhead`` runs both beside kvroute and SGLang's router, so that kvroute's CPU
per request splits into the framework's share and the routing's own.  Neither is a server to
deploy: no chunked request bodies, no limits, no error answers beyond a 502.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
import sys
from collections.abc import Iterator

import uvloop
from aiohttp import web

from kvroute.router.forwarding.upstream import UpstreamPool

_HEADERS = {"Content-Type": "application/json"}


async def forward(pool: UpstreamPool, replicas: Iterator[str], path: str, body: bytes) -> tuple[int, bytes]:
    try:
        upstream = await pool.request(next(replicas), path, _HEADERS, body)
        return upstream.status, await upstream.read()
    except OSError as exc:
        return 502, str(exc).encode()


async def serve_aiohttp(pool: UpstreamPool, replicas: Iterator[str], port: int) -> str:
    async def handle(request: web.Request) -> web.Response:
        status, data = await forward(pool, replicas, request.path, await request.read())
        return web.Response(status=status, body=data, content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/{path:.*}", handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


class _Forwarder(asyncio.Protocol):
    """One client connection: requests with Content-Length bodies, answered in order."""

    def __init__(self, pool: UpstreamPool, replicas: Iterator[str]):
        self.pool = pool
        self.replicas = replicas
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.worker = asyncio.ensure_future(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower() + b"\r\n"
            at = head.find(b"\r\ncontent-length:")
            length = int(head[at + 17 : head.find(b"\r\n", at + 2)]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            path = self.buf[: self.buf.find(b"\r\n")].split(b" ")[1].decode()
            self.queue.put_nowait((path, self.buf[end + 4 : end + 4 + length]))
            self.buf = self.buf[end + 4 + length :]

    async def _serve(self) -> None:
        while True:
            path, body = await self.queue.get()
            status, data = await forward(self.pool, self.replicas, path, body)
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 %d -\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (status, len(data), data)
            )


async def serve_protocol(pool: UpstreamPool, replicas: Iterator[str], port: int) -> str:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Forwarder(pool, replicas), "127.0.0.1", port, backlog=1024)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def main(args: argparse.Namespace) -> None:
    pool = UpstreamPool(connect_timeout_s=5.0)
    replicas = itertools.cycle(args.replicas)
    serve = serve_aiohttp if args.server == "aiohttp" else serve_protocol
    url = await serve(pool, replicas, args.port)
    print(f"listening on {url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.proxy_floor", description=__doc__.split("\n")[0])
    p.add_argument("--server", choices=("aiohttp", "protocol"), required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("replicas", nargs="+")
    try:
        uvloop.run(main(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)
