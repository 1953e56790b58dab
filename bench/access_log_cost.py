"""What the access log costs the router: ``python -m kvroute.bench.access_log_cost``.

Emulated replicas answering at once (one child process) behind three ``kvroute router`` processes
that differ only in logging: ``--no-access-log``, the access log as text, and as JSON (each
writing its stderr to a file).  This process sends the same short chat requests (streamed and
not, concurrency 32) to each in interleaved rounds and reports each router's CPU time per request
(``/proc/PID/stat``, every thread: the writer thread counts), side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import aiohttp

from kvroute.bench.processes import spawn, stop_all
from kvroute.bench.router_overhead import _REPLICAS_CHILD, MODEL, REPO, TOKENIZER, process_cpu_s

VARIANTS = {"off": ["--no-access-log"], "text": [], "json": ["--log-format", "json"]}


async def _router(
    urls: list[str], extra: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    args = [sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0", "--replicas",
            ",".join(urls), "--tokenizer", str(TOKENIZER), "--log-level", "info", *extra]
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=err, cwd=str(REPO),
                                                    env=None if env is None else {**os.environ, **env})
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    return proc, line.rsplit(" ", 1)[-1].strip()


async def _burst(session: aiohttp.ClientSession, url: str, n: int, concurrency: int, stream: bool) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4,
                "stream": stream}
        async with sem, session.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            assert r.status == 200, r.status

    await asyncio.gather(*(one(i) for i in range(n)))


async def compare_cpu(routers: dict[str, tuple[int, str]], args: argparse.Namespace) -> None:
    """Prints each router's (name -> pid, URL) CPU time per request, whole and streamed, over
    ``args.rounds`` interleaved rounds, against the first router's."""
    cpu = {(name, stream): 0.0 for name in routers for stream in (False, True)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for name, (_, url) in routers.items():  # warm-up
            await _burst(session, url, 200, args.concurrency, False)
        for _ in range(args.rounds):
            for stream in (False, True):
                for name, (pid, url) in routers.items():
                    before = process_cpu_s(pid)
                    await _burst(session, url, args.requests, args.concurrency, stream)
                    cpu[(name, stream)] += process_cpu_s(pid) - before
    total = args.rounds * args.requests
    first = next(iter(routers))
    for stream in (False, True):
        base = cpu[(first, stream)] / total * 1e6
        row = "  ".join(f"{name} {cpu[(name, stream)] / total * 1e6:6.0f} us ({cpu[(name, stream)] / total * 1e6 / base:.2f}x)"
                        for name in routers)
        print(f"{'streamed' if stream else 'whole   '}  router CPU per request: {row}")


async def compare_routers(
    args: argparse.Namespace, variants: dict[str, tuple[list[str], dict[str, str]]], logs: Path
) -> None:
    """Emulated replicas, a router per variant (name -> extra flags, environment; its stderr in
    ``logs/<name>.log``), and their CPU per request compared (``compare_cpu``)."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        rep, line = await spawn([sys.executable, "-c", _REPLICAS_CHILD, "2", MODEL])
        procs.append(rep)
        urls = line.split()
        routers = {}
        for name, (extra, env) in variants.items():
            proc, url = await _router(urls, extra, logs / f"{name}.log", env)
            procs.append(proc)
            routers[name] = (proc.pid, url)
        await compare_cpu(routers, args)
    finally:
        await stop_all(procs)


def parse_args(prog: str, doc: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=(doc or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1000, help="requests per router, round and kind")
    p.add_argument("--concurrency", type=int, default=32)
    return p.parse_args()


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await compare_routers(args, {name: (extra, {}) for name, extra in VARIANTS.items()}, Path(tmp))
        lines = sum(1 for _ in (Path(tmp) / "json.log").open())
        print(f"json log lines written: {lines}")


def main() -> None:
    asyncio.run(run(parse_args("kvroute.bench.access_log_cost", __doc__)))


if __name__ == "__main__":
    main()
