"""What hostile inputs cost the router: ``python -m kvroute.bench.hostile_inputs``.

The router (``kvroute router``, the tiny tokenizer, client chat templates allowed, 1 s budget) and
one emulated replica run as child processes; this process is the client.  For each input, sent
once, it prints the answer, how long it took, the latency of ``/health`` sampled every 20 ms
meanwhile (a stalled event loop shows there first) and the router's RSS: before, peak during
(VmHWM, reset first) and after (the connection closed).

* a template bomb: ``{% for i in range(100000) %}{% for j in range(1000) %}…`` as chat_template;
* a 60 KB chat (under the replica's 32,768 tokens): rendered and tokenized off the loop;
* a 15 MB chat (millions of tokens, over it): refused from a prefix, its buffers given back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import aiohttp
import numpy as np

from kvroute.bench.processes import stop_all
from kvroute.bench.router_overhead import _REPLICAS_CHILD, MODEL, TOKENIZER, spawn, text_of

T = TypeVar("T")

BOMB = "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


async def health_while(url: str, work: Awaitable[T], interval_s: float = 0.01) -> tuple[T, list[float]]:
    """Await ``work`` while ``url``/health is sampled every ``interval_s``: (its result, the samples'
    latencies): how long the router keeps everyone else waiting while it handles ``work``."""
    latencies: list[float] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession() as probe:

        async def sample() -> None:
            while not done.is_set():
                started = time.perf_counter()
                async with probe.get(url + "/health") as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(interval_s)

        sampler = asyncio.create_task(sample())
        try:
            return await work, latencies
        finally:
            done.set()
            await sampler


async def one(url: str, pid: int, body: bytes) -> dict:
    """Send ``body`` once, sampling /health meanwhile; the router's RSS around it."""
    before = rss_mb(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from here

    async def post() -> tuple[dict, int, float]:
        started = time.perf_counter()
        async with aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"},
                                   timeout=aiohttp.ClientTimeout(total=600)) as r:
                return await r.json(), r.status, time.perf_counter() - started

    (answer, status, elapsed), latencies = await health_while(url, post(), 0.02)
    await asyncio.sleep(0.5)
    error = answer.get("error") or {}
    return {
        "status": status,
        "code": error.get("code"),
        "seconds": round(elapsed, 2),
        "health_samples": len(latencies),
        "health_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "health_max_ms": round(max(latencies) * 1000, 1),
        "rss_before_mb": round(before),
        "rss_peak_added_mb": round(rss_mb(pid, "VmHWM") - before),
        "rss_after_added_mb": round(rss_mb(pid) - before),
    }


def chat_body(content: str, **extra: object) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}], **extra}).encode()


async def run(args: argparse.Namespace) -> dict:
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    try:
        rep_proc, urls = await spawn([py, "-c", _REPLICAS_CHILD, "1", MODEL])
        procs.append(rep_proc)
        router_proc, line = await spawn(
            [py, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0", "--replicas", urls,
             "--tokenizer", str(TOKENIZER), "--log-level", "warning", "--allow-client-chat-template"]
        )
        procs.append(router_proc)
        url = line.rsplit(" ", 1)[-1]
        rng = np.random.default_rng(1)
        await asyncio.sleep(2)  # the template worker starts in the background
        cases = {
            "template bomb": chat_body("hi", chat_template=BOMB),
            "60 KB chat": chat_body(text_of(rng, 60_000)),
            f"{args.mb} MB chat": chat_body(text_of(rng, args.mb * 1_000_000)),
        }
        return {name: await one(url, router_proc.pid, body) for name, body in cases.items()}
    finally:
        await stop_all(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=15, help="size of the huge chat, in MB (under the 16 MiB body limit)")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    for name, r in results.items():
        print(f"{name:>14}: {r['status']} {r['code'] or ''} in {r['seconds']} s; /health p50 {r['health_p50_ms']} ms, "
              f"max {r['health_max_ms']} ms ({r['health_samples']} samples); router RSS {r['rss_before_mb']} MB, "
              f"+{r['rss_peak_added_mb']} MB peak, +{r['rss_after_added_mb']} MB after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
