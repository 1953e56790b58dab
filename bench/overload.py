"""A router offered more than it can serve: ``python -m kvroute.bench.overload``.

Emulated replicas (``--time-scale 0``) and a one-worker router run as child processes, the router
pinned with ``taskset`` to ``--router-cores`` (default 0, when taskset exists), the replicas to
``--other-cores``.  First the router's capacity is measured: one-line chats from ``--connections``
keep-alive connections, closed loop.  Then offered load steps through ``--steps`` multiples of it
(0.5x to 3x), open loop (Poisson arrivals at fixed times, whether or not earlier answers came), from
two tenants (two API keys), the heavy one at ``--heavy-ratio`` times the light one's rate.  Each
configuration runs its own router over the same replicas (all pinned alike, one loaded at a time),
each step on each in turn, side by side: by default the router as it is and with
``--max-queue-wait-s 0`` (no queue: the 429 at ``--max-in-flight`` of before).  Per step and tenant:
offered, served and shed req/s, p50/p99 latency of served requests and of 429s (from the scheduled send time, so
a client that falls behind counts), the router's p99 queue wait (its histogram, both tenants, every
admitted request: the smallest bucket bound holding 99%), and how late the load itself sent (p99: where this client is short
of CPU, part of the latency is its own).
A table on stdout, ``--json`` and ``--png`` files.  docs/experiments.md has what it measured.

On a 2-core machine the load and the replicas on the other core run out before a one-worker router
does (one-line chats: the router serves ~4,000 req/s on its core, the client and replicas cannot
offer 2x that): ``--hogs N`` runs N busy loops on the router's cores, so the router gets a share of
its core and 2x-3x its capacity is within the load's reach.  ``--checkout NAME=PATH`` runs config
NAME's router from another checkout (a change's before), side by side with this one's.

  python -m kvroute.bench.overload --json overload.json --png docs/overload.png
  python -m kvroute.bench.overload --config after= --config before=--max-queue-wait-s=0 --steps 0.5,1,2,3
  python -m kvroute.bench.overload --hogs 2 --config after= --config before= --checkout before=../base --steps 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from kvroute.bench.processes import checkout_command, spawn, stop_all

TOKENIZER = Path(__file__).resolve().parents[1] / "replica" / "assets" / "tiny-tokenizer"
MODEL = "mock-model"
TENANTS = ("heavy", "light")


def chat_request(api_key: str) -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (api_key.encode(), len(body))) + body


async def read_answer(reader: asyncio.StreamReader) -> int:
    """One HTTP response off the connection; its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return int(lines[0].split()[1])


class Connections:
    """Keep-alive connections to the router: an idle one reused, else a new one."""

    def __init__(self, port: int):
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self, request: bytes) -> int:
        try:
            reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:  # out of descriptors or refused: counted as failed, as a client would see it
            return 0
        writer.write(request)
        try:
            status = await read_answer(reader)
        except (OSError, asyncio.IncompleteReadError):
            writer.close()
            return 0
        self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


@dataclass
class TenantStep:
    offered: float  # req/s scheduled
    latencies: list[float] = field(default_factory=list)  # served (200), from the scheduled time
    late: list[float] = field(default_factory=list)  # how late this client sent each request (its own lag)
    shed: int = 0  # 429
    shed_latencies: list[float] = field(default_factory=list)  # 429s, from the scheduled time
    failed: int = 0  # anything else

    def summary(self, duration_s: float) -> dict:
        lat = sorted(self.latencies)
        q = (lambda p: round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1) if lat else None)
        late = sorted(self.late)
        shed = sorted(self.shed_latencies)
        return {"offered_rps": round(self.offered, 1), "served_rps": round(len(lat) / duration_s, 1),
                "shed_rps": round(self.shed / duration_s, 1), "failed": self.failed, "p50_ms": q(0.5), "p99_ms": q(0.99),
                "shed_p50_ms": round(shed[len(shed) // 2] * 1000, 1) if shed else None,
                "shed_p99_ms": round(shed[min(len(shed) - 1, int(0.99 * len(shed)))] * 1000, 1) if shed else None,
                "client_late_p99_ms": round(late[int(0.99 * (len(late) - 1))] * 1000, 1) if late else None}


async def closed_loop(port: int, connections: int, duration_s: float) -> float:
    """Requests per second answered 200 by ``connections`` connections sending one after another."""
    stop = time.perf_counter() + duration_s
    request = chat_request("capacity")

    async def one_connection() -> int:
        pool, done = Connections(port), 0
        while time.perf_counter() < stop:
            done += await pool.send(request) == 200
        pool.close()
        return done

    started = time.perf_counter()
    done = sum(await asyncio.gather(*(one_connection() for _ in range(connections))))
    return done / (time.perf_counter() - started)


async def open_loop(port: int, rates: dict[str, float], duration_s: float, seed: int) -> dict[str, TenantStep]:
    """Each tenant's Poisson arrivals at ``rates`` for ``duration_s``, each sent at its time."""
    rng = random.Random(seed)
    steps = {name: TenantStep(rate) for name, rate in rates.items()}
    pools = {name: Connections(port) for name in rates}
    requests = {name: chat_request(name) for name in rates}
    schedule = []
    for name, rate in rates.items():
        t = rng.expovariate(rate)
        while t < duration_s:
            schedule.append((t, name))
            t += rng.expovariate(rate)
    schedule.sort()

    async def one(at: float, name: str) -> None:
        step = steps[name]
        step.late.append(time.perf_counter() - at)
        status = await pools[name].send(requests[name])
        if status == 200:
            step.latencies.append(time.perf_counter() - at)
        elif status == 429:
            step.shed += 1
            step.shed_latencies.append(time.perf_counter() - at)
        else:
            step.failed += 1

    start = time.perf_counter() + 0.1
    tasks = []
    for offset, name in schedule:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(start + offset, name)))
    await asyncio.gather(*tasks)
    for pool in pools.values():
        pool.close()
    return steps


def queue_wait(url: str) -> tuple[dict[float, float], float]:
    """The router's kvroute_queue_wait_seconds buckets (cumulative) and count."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    buckets, count = {}, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "kvroute_queue_wait_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets[float(s.labels["le"])] = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return buckets, count


def p99_between(before: tuple[dict[float, float], float], after: tuple[dict[float, float], float]) -> float | None:
    """The p99 of the waits observed between two scrapes: the smallest bucket bound holding 99% (ms)."""
    count = after[1] - before[1]
    if count <= 0:
        return None
    for le in sorted(after[0]):
        if after[0][le] - before[0].get(le, 0.0) >= 0.99 * count:
            return le * 1000
    return None


async def ready(url: str, timeout_s: float = 60.0) -> None:
    """Until /ready answers 200 (a replica is healthy and its models known)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            if urllib.request.urlopen(url + "/ready", timeout=5).status == 200:
                return
        except OSError:
            if time.perf_counter() > deadline:
                raise
        await asyncio.sleep(0.2)


def pin(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if cores and shutil.which("taskset") else []


async def run(args: argparse.Namespace) -> dict:
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    out: dict = {"steps": args.steps, "heavy_ratio": args.heavy_ratio, "duration_s": args.duration, "configs": {}}
    try:
        urls = []
        for _ in range(args.replicas):
            proc, url = await spawn([*pin(args.other_cores), py, "-m", "kvroute.cli", "replica", "--engine", "emulated",
                                      "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--tokenizer",
                                      str(TOKENIZER), "--time-scale", "0", "--log-level", "warning"])
            procs.append(proc)
            urls.append(url)
        routers = {}  # every configuration's router up at once: each step runs on each in turn, side by side
        links = Path(tempfile.mkdtemp(prefix="overload-checkouts-"))
        for name, extra in args.config:
            command, env = [py, "-m", "kvroute.cli"], None
            if name in args.checkout:
                command, env = checkout_command(args.checkout[name], links / name)
            router, url = await spawn([*pin(args.router_cores), *command, "router", "--host", "127.0.0.1",
                                        "--port", "0", "--replicas", ",".join(urls), "--tokenizer", str(TOKENIZER),
                                        "--log-level", "error", "--no-access-log", *extra], env=env)
            procs.append(router)
            routers[name] = url
            await ready(url)
            await closed_loop(int(url.rsplit(":", 1)[-1]), args.connections, 2.0)  # warm-up: connections, caches
            out["configs"][name] = {"router_args": extra, "rows": []}
        for _ in range(args.hogs):  # after the warm-ups: the routers' share of their cores from now on
            procs.append(await asyncio.create_subprocess_exec(*pin(args.router_cores), py, "-c", "while True: pass"))
        out["hogs"] = args.hogs
        first = next(iter(routers.values()))
        capacity = await closed_loop(int(first.rsplit(":", 1)[-1]), args.connections, args.duration)
        out["capacity_rps"] = round(capacity, 1)
        print(f"capacity: {capacity:.0f} req/s (closed loop, {args.connections} connections, the first router)", flush=True)
        for i, multiple in enumerate(args.steps):
            total = multiple * capacity
            light = total / (1 + args.heavy_ratio)
            for name, url in routers.items():
                before = queue_wait(url)
                steps = await open_loop(int(url.rsplit(":", 1)[-1]), {"heavy": total - light, "light": light},
                                        args.duration, seed=i)
                wait_p99 = p99_between(before, queue_wait(url))
                for tenant in TENANTS:
                    row = {"config": name, "multiple": multiple, "tenant": tenant,
                           **steps[tenant].summary(args.duration), "queue_wait_p99_ms": wait_p99}
                    out["configs"][name]["rows"].append(row)
                    print(table_row(row), flush=True)
                await asyncio.sleep(1.0)  # the router drains before the next run
    finally:
        await stop_all(procs)
    return out


HEADER = (f"{'config':>8} {'load':>5} {'tenant':>6} {'offered':>8} {'served':>8} {'shed':>8} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'shed p50':>9} {'shed p99':>9} {'wait p99':>9} {'late p99':>9}")


def table_row(row: dict) -> str:
    fmt = (lambda v: "-" if v is None else f"{v:.0f}")
    return (f"{row['config']:>8} {row['multiple']:>4}x {row['tenant']:>6} {row['offered_rps']:>8.0f} {row['served_rps']:>8.0f} "
            f"{row['shed_rps']:>8.0f} {fmt(row['p50_ms']):>8} {fmt(row['p99_ms']):>8} {fmt(row['shed_p50_ms']):>9} "
            f"{fmt(row['shed_p99_ms']):>9} {fmt(row['queue_wait_p99_ms']):>9} "
            f"{fmt(row['client_late_p99_ms']):>9}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, latency) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for c, (name, config) in enumerate(result["configs"].items()):
        for tenant, style in zip(TENANTS, ("-", "--")):
            rows = [r for r in config["rows"] if r["tenant"] == tenant]
            x = [r["multiple"] for r in rows]
            rates.plot(x, [r["served_rps"] for r in rows], style, marker="o", color=f"C{c}", label=f"{name} {tenant} served")
            rates.plot(x, [r["shed_rps"] for r in rows], style, marker="x", color=f"C{c}", alpha=0.5,
                       label=f"{name} {tenant} shed")
            latency.plot(x, [r["p99_ms"] for r in rows], style, marker="o", color=f"C{c}", label=f"{name} {tenant} p99")
            latency.plot(x, [r["p50_ms"] for r in rows], style, marker=".", color=f"C{c}", alpha=0.5,
                         label=f"{name} {tenant} p50")
    rates.set(xlabel="offered load (x capacity)", ylabel="req/s", title=f"served and shed (capacity {result['capacity_rps']:.0f} req/s)")
    latency.set(xlabel="offered load (x capacity)", ylabel="ms (served requests)", yscale="log",
                title=f"latency of served requests (heavy tenant {result['heavy_ratio']:g}x the light one)")
    for ax in (rates, latency):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def config_arg(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    return name, [f for f in flags.split() if f]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_arg, action="append",
                        help="NAME=ROUTER-FLAGS (flags space-separated, '--flag=value'); repeat; default: "
                             "'queue=' and 'no-queue=--max-queue-wait-s=0'")
    parser.add_argument("--steps", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1, 1.5, 2, 3])
    parser.add_argument("--heavy-ratio", type=float, default=10.0, help="the heavy tenant's rate over the light one's")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per step (and of the capacity run)")
    parser.add_argument("--connections", type=int, default=64, help="connections of the capacity run")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router-cores", default="0", help="taskset cores of the router")
    parser.add_argument("--other-cores", default="1", help="taskset cores of the replicas (this process: pin it yourself)")
    parser.add_argument("--hogs", type=int, default=0, help="busy loops on the router's cores (its share: 1/(N+1))")
    parser.add_argument("--checkout", type=lambda t: (t.partition("=")[0], Path(t.partition("=")[2]).resolve()),
                        action="append", default=[], help="NAME=PATH: config NAME's router from that checkout")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="plot them here (matplotlib)")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # an open loop at 3x opens a connection per waiting request
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args.checkout = dict(args.checkout)
    args.config = args.config or [("queue", []), ("no-queue", ["--max-queue-wait-s=0"])]
    print(HEADER, flush=True)
    result = uvloop.run(run(args))  # the load itself must cost little
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
