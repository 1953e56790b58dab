"""aiohttp's client vs ``kvroute.router.forwarding.upstream.UpstreamPool``, side by side: ``python -m kvroute.bench.upstream_bench``.

An aiohttp server (uvloop, a child process, so this process's CPU time is the client's alone)
answers a POST with (a) a small JSON body (Content-Length) and (b) a short SSE stream (6 events,
chunked).  Each client sends the same requests (a ``--body-bytes`` JSON body, the router's
headers), ``--concurrency`` at a time on keep-alive connections, reading the answer the way the
proxy does (``read`` for JSON, ``readany`` until the end for SSE).  Rounds alternate the two
clients; the figures are the median round: requests/s and client CPU µs per request
(``time.process_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop

from kvroute.router.forwarding.upstream import UpstreamPool

REPO = Path(__file__).resolve().parents[1]

_SERVER_CHILD = """
import asyncio, json
import uvloop
from aiohttp import web

ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).encode()
EVENTS = [b'data: {"choices": [{"index": 0, "delta": {"content": "t%d"}}], "usage": null}\\n\\n' % i
          for i in range(5)] + [b"data: [DONE]\\n\\n"]

async def small_json(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")

async def sse(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in EVENTS:
        await resp.write(event)
    await resp.write_eof()
    return resp

async def main():
    app = web.Application()
    app.router.add_post("/json", small_json)
    app.router.add_post("/sse", sse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    print(f"http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()

uvloop.run(main())
"""

HEADERS = {"Content-Type": "application/json", "X-Request-Id": "bench-0123456789abcdef"}

Send = Callable[[str], Awaitable[int]]  # path -> body bytes received


def aiohttp_client(url: str, body: bytes) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """Configured as the router's proxy was: no auto headers, no decompression, connect timeout."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        auto_decompress=False,
    )
    per_request = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None)

    async def send(path: str) -> int:
        resp = await session.post(url + path, data=body, headers=dict(HEADERS), timeout=per_request)
        if path == "/json":
            n = len(await resp.read())
        else:
            n = 0
            while chunk := await resp.content.readany():
                n += len(chunk)
        resp.release()
        return n

    return send, session.close


def pool_client(url: str, body: bytes) -> tuple[Send, Callable[[], Awaitable[None]]]:
    pool = UpstreamPool(connect_timeout_s=5.0)

    async def send(path: str) -> int:
        resp = await pool.request(url, path, dict(HEADERS), body)
        if path == "/json":
            return len(await resp.read())
        n = 0
        while chunk := await resp.readany():
            n += len(chunk)
        return n

    return send, pool.close


async def measure(send: Send, path: str, n: int, concurrency: int) -> tuple[float, float]:
    """(requests/s, client CPU µs per request) for ``n`` requests, ``concurrency`` at a time."""
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            if not await send(path):
                raise RuntimeError(f"{path}: empty answer")

    await asyncio.gather(*(worker() for _ in range(concurrency)))  # warm: connections opened
    todo = iter(range(n))
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return n / wall, cpu / n * 1e6


async def run(args: argparse.Namespace) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVER_CHILD, stdout=asyncio.subprocess.PIPE, cwd=str(REPO)
    )
    assert proc.stdout is not None
    url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
    body = json.dumps({"model": "bench", "max_tokens": 1, "prompt": "x" * max(0, args.body_bytes - 50)}).encode()
    clients = {"aiohttp": aiohttp_client, "upstream_pool": pool_client}
    rounds: dict[str, dict[str, list[tuple[float, float]]]] = {
        case: {name: [] for name in clients} for case in ("json", "sse")
    }
    try:
        made = {name: make(url, body) for name, make in clients.items()}
        for _ in range(args.rounds):
            for case in rounds:
                for name, (send, _close) in made.items():
                    rounds[case][name].append(await measure(send, "/" + case, args.requests, args.concurrency))
        for _send, close in made.values():
            await close()
    finally:
        proc.terminate()
        await proc.wait()
    out: dict = {"requests": args.requests, "concurrency": args.concurrency, "body_bytes": len(body), "cases": {}}
    for case, by_client in rounds.items():
        out["cases"][case] = {
            name: {
                "rps": statistics.median(r for r, _ in runs),
                "cpu_us_per_request": statistics.median(c for _, c in runs),
            }
            for name, runs in by_client.items()
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.upstream_bench", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per client, case and round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--body-bytes", type=int, default=16 * 1024)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    out = uvloop.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['body_bytes']} B POSTs, concurrency {out['concurrency']}, median of {args.rounds} rounds "
          f"of {out['requests']} requests, client CPU in this process (server: a child process)")
    print(f"{'':28}{'aiohttp':>22}{'upstream_pool':>22}{'ratio':>8}")
    for case, by in out["cases"].items():
        a, b = by["aiohttp"], by["upstream_pool"]
        print(f"{case + ' CPU µs/request':28}{a['cpu_us_per_request']:>22.1f}{b['cpu_us_per_request']:>22.1f}"
              f"{a['cpu_us_per_request'] / b['cpu_us_per_request']:>8.2f}")
        print(f"{case + ' requests/s':28}{a['rps']:>22.0f}{b['rps']:>22.0f}{b['rps'] / a['rps']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
