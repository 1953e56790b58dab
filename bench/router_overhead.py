"""What the router adds in front of replicas that answer at once: ``python -m kvroute.bench.router_overhead``.

Emulated replicas with ``time_scale`` 0 (no modelled GPU time) run in one child process, the router
(``kvroute router``, cost_model, the tiny tokenizer, in-memory index) in another, so its CPU time
is its own; this process is the client.  Each figure is measured side by side in one run, the
direct request (to a replica) and the routed ones (through each router) interleaved:

* added p50 latency, unloaded: one request at a time, non-streamed, ``max_tokens`` 1;
* added time to first streamed chunk, unloaded, p50;
* router CPU per request at concurrency 64: the router process's user+system CPU time
  (``/proc/PID/stat``, every thread, and its child processes: ``--workers``) over the requests it
  proxied, and the cores the router, the replicas and this client used meanwhile.

``--workers 2`` (a comma-separated list) adds kvroute run as that many worker processes on one
port, measured in the same interleaved rounds as the single process.

Two prompts: (a) a multi-turn chat of ~16 KB whose earlier turns the router has seen, each
request adding a short new user turn; (b) a ~16 KB chat nobody has seen (each request, and each
target of a round, gets a new one); and, for scale, (c) a one-line chat: the cost of proxying
itself.  Last, the routing pipeline's stages are timed in this process (no HTTP) for (a) and (b).

The reference is SGLang's router (Rust; it matches characters, no tokenizer) with its cache-aware
policy; docs/benchmarks.md quotes the last run's figures.  CPU figures depend on the machine, so when
``sglang-router`` is installed (``make venv-sglang``: ``.venv-sglang``, or ``--sglang-python``) it
runs here too, in front of the same replicas with ``--policy cache_aware``, measured in the same
interleaved rounds: the comparison that counts is the one on one machine in one run.

Beside them, two proxies that only forward (``kvroute.bench.proxy_floor``: no parsing, no routing) are
measured under the same load: one on aiohttp's server, as kvroute is built, and one on a bare
``asyncio.Protocol``.  They split kvroute's CPU per request into what Python and the kernel cost,
what aiohttp's server adds, and what the routing itself adds (``--no-floors`` skips them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from kvroute.bench.processes import checkout_command, stop_all
from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.replica.vllm import free_port

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = TINY_TOKENIZER
MODEL = "bench"
PROMPT_BYTES = 16 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")

_REPLICAS_CHILD = """
import asyncio, logging, sys
import uvloop
# SGLang's router probes its workers for HTTP/2 (gRPC) first: not worth a traceback each
logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig

async def main(n):
    reps = [EmulatedReplica(ReplicaConfig(model=sys.argv[2], time_scale=0.0)) for _ in range(n)]
    for r in reps:
        await r.start()
    print(" ".join(r.url for r in reps), flush=True)
    await asyncio.Event().wait()

uvloop.run(main(int(sys.argv[1])))
"""

_WORDS = np.array(
    "the router keeps every prefix warm while replicas answer questions about caches blocks tokens "
    "latency throughput sessions tenants policies metrics streams budgets engines kernels queues "
    "prefill decode schedule memory layout attention request response client server shard index".split()
)


def text_of(rng: np.random.Generator, n_bytes: int) -> str:
    words = rng.choice(_WORDS, size=n_bytes // 6 + 8)
    return " ".join(words)[:n_bytes]


def conversation(rng: np.random.Generator, n_bytes: int) -> list[dict[str, str]]:
    """A chat of about ``n_bytes``: a system prompt and alternating turns of ~1 KB."""
    msgs = [{"role": "system", "content": text_of(rng, 2048)}]
    size = 2048
    while size < n_bytes - 1024:
        role = "user" if msgs[-1]["role"] != "user" else "assistant"
        msgs.append({"role": role, "content": text_of(rng, 1024)})
        size += 1024
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": text_of(rng, 512)})
    return msgs


def process_cpu_s(pid: int, *, children: bool = True) -> float:
    """CPU seconds of ``pid`` and (``children``) the processes under it (a router's workers)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: every thread of the process
    if not children:
        return own
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return own
    return own + sum(process_cpu_s(kid) for kid in kids)


async def spawn(args: list[str], repo: Path = REPO, env: dict[str, str] | None = None
                ) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, cwd=str(repo), env=env)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
    if not line:
        raise RuntimeError(f"{args[:4]} did not start")
    return proc, line


@dataclass
class Case:
    name: str
    body: Callable[[int], dict]  # request i -> chat body
    # each target gets a body of its own: a text the direct replica tokenized (and cached) must not
    # reach the routers' replicas as a text they have seen (it did: SGLang's "negative" overhead)
    new_each: bool = False


class Client:
    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def latency(self, url: str, body: dict) -> float:
        t0 = time.perf_counter()
        async with self.session.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        return time.perf_counter() - t0

    async def first_chunk(self, url: str, body: dict) -> float:
        t0 = time.perf_counter()
        async with self.session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {await r.text()}")
            await r.content.readline()
            ttfc = time.perf_counter() - t0
            await r.read()
        return ttfc


async def side_by_side(
    n: int, case: Case, direct: str, routers: dict[str, str], measure: Callable[[str, dict], Awaitable[float]]
) -> tuple[list[float], dict[str, list[float]]]:
    """``n`` rounds of: the direct request, then the same body through each router."""
    d: list[float] = []
    r: dict[str, list[float]] = {name: [] for name in routers}
    for i in range(n):
        body = case.body(i)
        d.append(await measure(direct, body))
        for name, url in routers.items():
            r[name].append(await measure(url, case.body(i) if case.new_each else body))
    return d, r


async def under_load(client: Client, url: str, case: Case, n: int, concurrency: int, offset: int) -> float:
    """Requests/s of ``n`` requests, ``concurrency`` at a time."""
    next_i = iter(range(offset, offset + n))

    async def worker() -> None:
        for i in next_i:
            await client.latency(url, case.body(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


async def router_time(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """kvroute's ``kvroute_router_added_latency_seconds`` (sum, count): time from a request's
    arrival to its upstream send, as the router itself clocks it."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("kvroute_router_added_latency_seconds_sum", "kvroute_router_added_latency_seconds_count"):
            found[name.rsplit("_", 1)[-1]] = float(value)
    return found.get("sum", 0.0), found.get("count", 0.0)


def p50_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


SGLANG_VENV = REPO / ".venv-sglang"
FLOOR_SERVERS = ("aiohttp", "protocol")  # kvroute.bench.proxy_floor --server
FLOOR_LABELS = {"floor_aiohttp": "aiohttp server + upstream client, no routing",
                "floor_protocol": "asyncio.Protocol + upstream client, no routing"}


def sglang_python(explicit: str | None) -> Path | None:
    """The interpreter that has ``sglang_router``: --sglang-python, else .venv-sglang's, else none."""
    if explicit:
        return Path(explicit)
    candidate = SGLANG_VENV / "bin" / "python"
    return candidate if candidate.exists() else None


async def start_sglang(python: Path, urls: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """SGLang's router with its cache-aware policy in front of ``urls``; returns once it answers."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "error",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, cwd=str(REPO),
    )
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ready?"}]}
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    if r.status == 200:
                        return proc, url
            except (aiohttp.ClientError, TimeoutError):
                pass
            if proc.returncode is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"SGLang's router ({python}) did not start")
            await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> dict:
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    links = tempfile.TemporaryDirectory(prefix="kvroute-compare-")  # other checkouts' packages
    try:
        rep_proc, urls_line = await spawn([py, "-c", _REPLICAS_CHILD, str(args.replicas), MODEL])
        procs.append(rep_proc)
        urls = urls_line.split()
        routers: dict[str, str] = {}
        pids = {"replicas": rep_proc.pid}
        # kvroute, the same router as several processes on one port (--workers), and the router of
        # each other checkout (--compare: a change's before and after, measured in the same rounds)
        variants = [*(("kvroute" if w == 1 else f"kvroute_{w}_workers", REPO, w) for w in (1, *args.workers)),
                    *((f"kvroute@{Path(c).name}", Path(c).resolve(), 1) for c in args.compare)]
        for name, repo, workers in variants:
            port = "0" if workers == 1 else str(free_port())
            kvroute, env = ([py, "-m", "kvroute.cli"], None) if repo == REPO else \
                checkout_command(repo, Path(links.name) / name)
            proc, line = await spawn(
                [*kvroute, "router", "--host", "127.0.0.1", "--port", port, "--replicas", ",".join(urls),
                 "--tokenizer", str(TOKENIZER), "--policy", "cost_model", "--log-level", "warning",
                 "--max-in-flight", "4096", *(["--workers", str(workers)] if repo == REPO else []),
                 # the replicas' one process is saturated at c=64 on a shared machine: a probe
                 # timing out at 1 s would take them all out of the fleet mid-measure
                 "--fleet.health-timeout-s", "10"],
                repo, env,
            )
            procs.append(proc)
            routers[name], pids[name] = line.rsplit(" ", 1)[-1], proc.pid
        sglang = sglang_python(args.sglang_python)
        if sglang is not None:
            sg_proc, routers["sglang"] = await start_sglang(sglang, urls)
            procs.append(sg_proc)
            pids["sglang"] = sg_proc.pid
        else:
            print("SGLang's router is not installed (make venv-sglang): kvroute alone", file=sys.stderr)
        floors: dict[str, str] = {}
        for server in () if args.no_floors else FLOOR_SERVERS:
            name = f"floor_{server}"
            floor_proc, line = await spawn([py, "-m", "kvroute.bench.proxy_floor", "--server", server, *urls])
            procs.append(floor_proc)
            floors[name], pids[name] = line.rsplit(" ", 1)[-1], floor_proc.pid
        return await measure_all(args, urls, routers, pids, floors)
    finally:
        await stop_all(procs)
        links.cleanup()


async def measure_all(
    args: argparse.Namespace, urls: list[str], routers: dict[str, str], pids: dict[str, int], floors: dict[str, str]
) -> dict:
    results: dict = {"replicas": len(urls), "prompt_bytes": PROMPT_BYTES, "routers": list(routers),
                     "floors": list(floors), "cases": {}}
    rng = np.random.default_rng(args.seed)
    history = conversation(rng, PROMPT_BYTES)
    fresh_rng = np.random.default_rng(args.seed + 1)
    fresh_texts: dict[int, str] = {}

    def multi_turn(i: int) -> dict:
        return {"model": MODEL, "max_tokens": 1,
                "messages": [*history, {"role": "user", "content": f"And question number {i}, briefly?"}]}

    def never_seen(i: int) -> dict:
        text = fresh_texts.pop(i, None) or text_of(fresh_rng, PROMPT_BYTES)
        return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}

    def short(i: int) -> dict:
        return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"Hello number {i}."}]}

    # the short chat is the floor: what proxying costs with (almost) no prompt to tokenize and hash
    cases = [Case("multi_turn_16k_seen", multi_turn), Case("new_16k_unseen", never_seen, new_each=True),
             Case("short_chat_floor", short)]
    cases = [case for case in cases if not args.cases or case.name in args.cases]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        client = Client(session)
        # warm: the routers and the direct replica see the conversation's earlier turns
        for i in range(5):
            for url in (urls[0], *routers.values()):
                await client.latency(url, multi_turn(-1 - i))
                await client.latency(url, never_seen(-1 - i))
        own = [name for name in routers if name.startswith("kvroute")]
        for n_case, case in enumerate(cases):
            out: dict = {name: {} for name in (*routers, *floors)}
            before = {name: await router_time(session, routers[name]) for name in own}
            d, r = await side_by_side(args.requests, case, urls[0], routers, client.latency)
            for name in routers:
                out[name].update(direct_p50_ms=p50_ms(d), routed_p50_ms=p50_ms(r[name]),
                                 added_p50_ms=p50_ms(r[name]) - p50_ms(d))
            for name in own:  # the router's own count: robust to a busy machine, unlike the p50s
                (s0, n0), (s1, n1) = before[name], await router_time(session, routers[name])
                out[name]["in_router_mean_ms"] = (s1 - s0) / max(1, n1 - n0) * 1e3
            d, r = await side_by_side(args.requests, case, urls[0], routers, client.first_chunk)
            for name in routers:
                out[name].update(direct_first_chunk_p50_ms=p50_ms(d), routed_first_chunk_p50_ms=p50_ms(r[name]),
                                 added_first_chunk_p50_ms=p50_ms(r[name]) - p50_ms(d))
            # CPU at concurrency, each router (then each floor) in turn on its own request numbers
            # (new prompts stay new); bodies built beforehand so that the client keeps up.  With
            # --load-rounds K, K rounds, the order reversed every other round (a machine whose load
            # drifts favours neither), the figures over all rounds
            n = args.load_requests
            targets = list({**routers, **floors}.items())
            spent: dict[str, list[float]] = {name: [0.0, 0.0, 0.0, 0.0] for name, _ in targets}
            for n_round in range(args.load_rounds):
                for name, url in targets if n_round % 2 == 0 else targets[::-1]:
                    base = 1_000_000 * (n_case + 1) + 100_000 * [t for t, _ in targets].index(name) + 10_000 * n_round
                    if case.body is never_seen:
                        for i in range(base, base + n):
                            fresh_texts[i] = text_of(fresh_rng, PROMPT_BYTES)
                    cpu0, rep0 = process_cpu_s(pids[name]), process_cpu_s(pids["replicas"])
                    client0 = process_cpu_s(os.getpid(), children=False)
                    rps = await under_load(client, url, case, n, args.concurrency, base)
                    # how the machine's cores were shared meanwhile: router, replicas, this client
                    for k, used in enumerate((n / rps, process_cpu_s(pids[name]) - cpu0, process_cpu_s(pids["replicas"]) - rep0,
                                              process_cpu_s(os.getpid(), children=False) - client0)):
                        spent[name][k] += used
            for name, (elapsed, cpu, rep_cpu, client_cpu) in spent.items():
                total_n = n * args.load_rounds
                out[name].update(concurrency=args.concurrency, load_requests=total_n, routed_rps=total_n / elapsed,
                                 router_cpu_us_per_request=cpu / total_n * 1e6, router_cores=cpu / elapsed,
                                 replicas_cores=rep_cpu / elapsed, client_cores=client_cpu / elapsed)
            results["cases"][case.name] = out
    return results


async def pipeline_breakdown(history: list[dict], fresh: Callable[[], str], n: int) -> dict[str, dict[str, float]]:
    """Microseconds per stage of the routing pipeline, in this process, for both prompts: the
    stages on the request's path, then, apart, the reuse accounting done after the answer."""
    from kvroute.common.blocks import namespace_seed
    from kvroute.router.request.chain_memo import ChainMemo
    from kvroute.router.index.base import ReplicaSpec
    from kvroute.router.index.memory import MemoryIndex
    from kvroute.router.placement.load import LoadTracker
    from kvroute.router.placement.sequence import snapshot
    from kvroute.router.placement.policy import Query, make_policy
    from kvroute.common.requests import parse_request
    from kvroute.router.request.reuse import ReuseTracker
    from kvroute.common.tokens import Tokenizer

    tok = Tokenizer.from_dir(TOKENIZER)
    seed = namespace_seed(MODEL)
    out: dict[str, dict[str, float]] = {}
    on_path = ("parse", "render", "tokenize", "hash", "index_lookup", "policy", "index_record")
    for case in ("multi_turn_16k_seen", "new_16k_unseen"):
        index, memo, reuse, load = MemoryIndex(), ChainMemo(), ReuseTracker(), LoadTracker()
        policy = make_policy("cost_model")
        names = [f"r{i}" for i in range(4)]
        for name in names:
            await index.add_replica(ReplicaSpec(name, 200_000))
        times = dict.fromkeys((*on_path, "reuse"), 0.0)
        for i in range(-3, n):  # three warm-up rounds, as the live router has seen earlier turns
            msgs = ([*history, {"role": "user", "content": f"And question number {i}, briefly?"}]
                    if case.startswith("multi") else [{"role": "user", "content": fresh()}])
            raw = json.dumps({"model": MODEL, "max_tokens": 1, "messages": msgs}).encode()
            t0 = time.perf_counter()
            parse_request("chat", raw)
            t1 = time.perf_counter()
            text = tok.render_chat(msgs)
            t2 = time.perf_counter()
            data = await tok.aencode_bytes(text)
            t3 = time.perf_counter()
            chain = memo.chain(data, 16, seed)
            t4 = time.perf_counter()
            matches = await index.lookup(chain)
            t5 = time.perf_counter()
            req = Query(chain=chain, prompt_tokens=len(data) // 4, block_size=16, matches=matches)
            decision = policy.choose(req, [snapshot(name, load, 0) for name in names])
            t6 = time.perf_counter()
            await index.record_prediction(decision.replica, chain)
            t7 = time.perf_counter()
            reuse.observe(MODEL, chain, np.frombuffer(data, dtype="<u4"), 16, seed)
            t8 = time.perf_counter()
            # spread the conversation over the replicas, as concurrency 64 does
            await index.record_prediction(names[i % 4], chain)
            if i >= 0:
                for key, a, b in (("parse", t0, t1), ("render", t1, t2), ("tokenize", t2, t3), ("hash", t3, t4),
                                  ("index_lookup", t4, t5), ("policy", t5, t6), ("index_record", t6, t7),
                                  ("reuse", t7, t8)):
                    times[key] += b - a
        out[case] = {k: v / n * 1e6 for k, v in times.items()}
        out[case]["total_on_path"] = sum(out[case][k] for k in on_path)
        out[case]["tokens"] = float(len(data) // 4)
    return out


def print_table(results: dict) -> None:
    rows = [
        ("added p50 latency, unloaded (ms)", "added_p50_ms"),
        ("  in the router, mean (ms)", "in_router_mean_ms"),
        ("  direct / routed p50 (ms)", ("direct_p50_ms", "routed_p50_ms")),
        ("added time to first chunk, p50 (ms)", "added_first_chunk_p50_ms"),
        ("  direct / routed first chunk p50 (ms)", ("direct_first_chunk_p50_ms", "routed_first_chunk_p50_ms")),
        ("router CPU per request at c=64 (µs)", "router_cpu_us_per_request"),
        ("routed throughput at c=64 (req/s)", "routed_rps"),
        ("  cores used: router / replicas / client", ("router_cores", "replicas_cores", "client_cores")),
    ]
    names = list(results["cases"])
    print(f"router overhead, {results['replicas']} emulated replicas answering at once, "
          f"{results['prompt_bytes'] // 1024} KB prompts", file=sys.stderr)
    print(f"{'':40}" + "".join(f"{n:>24}" for n in names))
    for router in results["routers"]:
        print(f"{router}")
        for label, key in rows:
            cells = []
            for n in names:
                c = results["cases"][n][router]
                if isinstance(key, tuple):
                    cells.append(" / ".join(f"{c[k]:.2f}" for k in key))
                else:
                    cells.append(f"{c[key]:.2f}" if key in c else "")
            if any(cells):
                print(f"  {label:38}" + "".join(f"{x:>24}" for x in cells))
    if "sglang" in results["routers"]:
        for router in (r for r in results["routers"] if r.startswith("kvroute")):
            print(f"{router} / sglang CPU per request")
            ratios = (results["cases"][n][router]["router_cpu_us_per_request"]
                      / results["cases"][n]["sglang"]["router_cpu_us_per_request"] for n in names)
            print(f"  {'':38}" + "".join(f"{x:>23.2f}x" for x in ratios))
    for floor in results.get("floors", ()):
        print(FLOOR_LABELS.get(floor, floor))
        cells = (f"{results['cases'][n][floor]['router_cpu_us_per_request']:.2f}" for n in names)
        print(f"  {'CPU per request at c=64 (µs)':38}" + "".join(f"{x:>24}" for x in cells))
    breakdown = results.get("pipeline_us")
    if breakdown:
        print("\nrouting pipeline in-process, µs per request (no HTTP)")
        for stage in next(iter(breakdown.values())):
            cells = (f"{breakdown[n][stage]:>24.1f}" if n in breakdown else f"{'':>24}" for n in names)
            print(f"  {stage:38}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.router_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=200, help="sequential requests per unloaded measure")
    p.add_argument("--load-requests", type=int, default=1500, help="requests of the concurrency-64 CPU measure")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--load-rounds", type=int, default=1, help="rounds of the concurrency measure, in alternating order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-floors", action="store_true", help="skip the forward-only proxies (kvroute.bench.proxy_floor)")
    p.add_argument("--cases", type=lambda v: v.split(","), default=[],
                   help="only these prompts (comma-separated: multi_turn_16k_seen, new_16k_unseen, short_chat_floor)")
    p.add_argument("--workers", type=lambda v: [int(w) for w in v.split(",") if w], default=[],
                   help="also run kvroute with these --workers counts (comma-separated), measured beside it")
    p.add_argument("--sglang-python", default=None,
                   help="a Python with sglang-router installed (default: .venv-sglang's, if present)")
    p.add_argument("--compare", action="append", default=[], metavar="CHECKOUT",
                   help="also run the router of another checkout of kvroute (e.g. a worktree of main), "
                        "measured in the same interleaved rounds: a change's before and after in one run")
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    rng = np.random.default_rng(args.seed)
    history = conversation(rng, PROMPT_BYTES)
    results["pipeline_us"] = asyncio.run(pipeline_breakdown(history, lambda: text_of(rng, PROMPT_BYTES), args.requests))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
