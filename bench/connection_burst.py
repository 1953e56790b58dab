"""A connection burst on a saturated router: ``python -m kvroute.bench.connection_burst``.

Emulated replicas (``--time-scale 0``) and a router run as child processes, each pinned with
``taskset`` when cores are given; a closed-loop load (``--load-connections`` keep-alive
connections, one chat each at a time) saturates the router; then ``--burst`` connections are
opened at once, each sending one chat.  Per burst connection: the ``connect()`` time (a SYN the
kernel dropped shows as 1 s, 3 s, 7 s: TCP's retransmits) and the time to the answer; with the
kernel's counters of the run (``/proc/net/netstat``: ListenOverflows, ListenDrops, TCPSynRetrans,
TCPReqQFullDrop, SyncookiesSent).  docs/experiments.md has what it measured.

  python -m kvroute.bench.connection_burst --burst 2000 --router-cores 0 --other-cores 1
  python -m kvroute.bench.connection_burst --burst 240 --router-cores 0-3 --other-cores 4-15 --replicas 8 \\
      -- --listen-backlog 1024      (the 16-core check of the overload issue; after '--': router flags)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from kvroute.bench.processes import stop_all
from kvroute.bench.router_overhead import spawn

TOKENIZER = Path(__file__).resolve().parents[1] / "replica" / "assets" / "tiny-tokenizer"
COUNTERS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPReqQFullDrop", "TCPReqQFullDoCookies", "SyncookiesSent")


def netstat() -> dict[str, int]:
    """TcpExt counters of this network namespace."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    out: dict[str, int] = {}
    for names, values in zip(lines[0::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            out.update(zip(names.split()[1:], map(int, values.split()[1:])))
    return out


def _chat(model: str) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def _answer(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)


async def _load(port: int, request: bytes, stop: asyncio.Event) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    done = 0
    while not stop.is_set():
        writer.write(request)
        await _answer(reader)
        done += 1
    writer.close()
    return done


async def _one(port: int, request: bytes) -> tuple[float, float | None]:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    connected = time.perf_counter()
    writer.write(request)
    try:
        await asyncio.wait_for(_answer(reader), 120)
        return connected - started, time.perf_counter() - started
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        return connected - started, None
    finally:
        writer.close()


def _q(xs: list[float], p: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(p * len(xs)))], 3) if xs else float("nan")


async def run(args: argparse.Namespace) -> dict:
    py = sys.executable
    pin = (lambda cores: ["taskset", "-c", cores] if cores else [])
    procs = []
    try:
        urls = []
        for _ in range(args.replicas):
            proc, line = await spawn([*pin(args.other_cores), py, "-m", "kvroute.cli", "replica", "--engine", "emulated",
                                      "--host", "127.0.0.1", "--port", "0", "--model", "mock-model", "--tokenizer",
                                      str(TOKENIZER), "--time-scale", "0", "--log-level", "warning"])
            procs.append(proc)
            urls.append(line.rsplit(" ", 1)[-1])
        router, line = await spawn([*pin(args.router_cores), py, "-m", "kvroute.cli", "router", "--host", "127.0.0.1",
                                    "--port", "0", "--replicas", ",".join(urls), "--tokenizer", str(TOKENIZER),
                                    "--log-level", "warning", "--no-access-log", "--max-in-flight", "8192",
                                    *args.router_args])
        procs.append(router)
        port = int(line.rsplit(":", 1)[-1])
        await asyncio.sleep(2)
        request = _chat("mock-model")
        stop = asyncio.Event()
        load = [asyncio.create_task(_load(port, request, stop)) for _ in range(args.load_connections)]
        await asyncio.sleep(args.warmup)
        before = netstat()
        results = await asyncio.gather(*(_one(port, request) for _ in range(args.burst)))
        after = netstat()
        stop.set()
        await asyncio.gather(*load)
        connects = [c for c, _ in results]
        totals = [t for _, t in results if t is not None]
        return {
            "burst": args.burst,
            "answered": len(totals),
            "connect_s": {"p50": _q(connects, 0.5), "p99": _q(connects, 0.99), "max": round(max(connects), 3)},
            "connect_over_1s": sum(c >= 1.0 for c in connects),
            "answer_s": {"p50": _q(totals, 0.5), "p99": _q(totals, 0.99), "max": round(max(totals), 3) if totals else None},
            "kernel": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
        }
    finally:
        await stop_all(procs)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    router_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, router_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=2000, help="connections opened at once")
    parser.add_argument("--load-connections", type=int, default=40, help="keep-alive connections saturating the router")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the burst")
    parser.add_argument("--router-cores", default="", help="taskset cores of the router (e.g. 0)")
    parser.add_argument("--other-cores", default="", help="taskset cores of the replicas (this process: pin it yourself)")
    args = parser.parse_args(argv)
    args.router_args = router_args
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
