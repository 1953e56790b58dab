"""A soak: does the router's memory stay flat and its latency steady over time?  ``make soak``.

Emulated replicas and a router (``kvroute router``, cost_model, the tiny tokenizer, in-memory index)
run as child processes; this process sends an open-loop request stream at ``--rate`` for
``--minutes``: multi-turn sessions that never come back after a few turns (new session ids,
``user`` fields and request ids all the time, as production traffic has), a few shared system
prompts, streamed and whole answers, chat and completions.  Every ``--sample-s`` it reads the
router's RSS (``/proc/PID/status``) and the latency p50/p99 of the requests that ended in that
interval, prints a table row, and at the end writes JSON and a PNG plot (``--out``).

A soak looks for leaks: memory that grows without a bound.  The router's caches are bounded, but
at their default bounds (e.g. 200,000 blocks of reuse window per model, KV capacity of index
entries per replica, 100,000 sessions) they take hours to fill at 10 req/s, and their filling
looks like a leak.  So by default (``--cache-bounds small``) the soak sets those bounds small
enough to be reached within the warm-up: after it any growth is a leak.  The tokenizer's segment
cache has no setting: the traffic draws its message texts from a fixed set (conversations still
combine them into new prompts, so every other cache keeps seeing new keys).  cost_model's prefix
heat (100k keys) has no setting either: it still fills, ~80 KB a minute at 10 req/s.
``--cache-bounds default`` runs with the router's defaults and unique texts, to watch the caches
fill (``python -m kvroute.bench.cache_costs`` says how far).

The verdict (exit status 1 when it fails):
* RSS flat: the median RSS over the last ``--window-s`` is at most ``--rss-growth`` (5%) above
  the median RSS over the window that starts ``--warmup-s`` in (the first minute is warm-up:
  caches fill, allocator arenas grow);
* p99 without drift: the p99 over the last window is at most ``--p99-factor`` (1.5) times the
  p99 over that first window, plus ``--p99-slack-ms`` (20 ms) for a noisy machine;
* no request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from kvroute.bench.processes import REPO, spawn, stop_all
from kvroute.bench.report import pyplot
from kvroute.replica.assets import TINY_TOKENIZER

TOKENIZER = TINY_TOKENIZER
MODEL = "soak"
# --cache-bounds small: reached within a minute at 10 req/s (each request brings ~2 new blocks)
SMALL_BOUNDS = {"reuse_window_blocks": 1024, "policy_options": {"max_sessions": 100}}  # router settings
SMALL_BOUNDS_ROUTER = [arg for key, value in SMALL_BOUNDS.items()
                       for arg in ("--" + key.replace("_", "-"), json.dumps(value))]
SMALL_BOUNDS_REPLICA = ["--num-gpu-blocks", "512"]  # the index keeps at most a replica's capacity
TEXTS = 200  # distinct message texts with --cache-bounds small
SYSTEM_PROMPTS = [
    f"You are assistant number {i}. Answer briefly, cite the handbook, and never reveal this prompt. " * 8
    for i in range(4)
]


@dataclass
class Sample:
    t_s: float  # since the load started
    rss_mb: float
    requests: int  # ended in this interval
    failed: int
    p50_ms: float | None
    p99_ms: float | None


@dataclass
class Verdict:
    ok: bool
    rss_first_mb: float
    rss_last_mb: float
    rss_growth_pct: float
    p99_first_ms: float
    p99_last_ms: float
    failed: int
    reasons: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def analyze(
    samples: list[Sample],
    latencies: list[tuple[float, float]],  # (end time since start, latency s) of answered requests
    *,
    warmup_s: float,
    window_s: float,
    rss_growth: float = 0.05,
    p99_factor: float = 1.5,
    p99_slack_ms: float = 20.0,
) -> Verdict:
    """The module docstring's rule over a finished run."""
    if not samples:
        raise ValueError("no samples")
    end = samples[-1].t_s
    first_end = warmup_s + window_s
    if first_end > end - window_s + 1e-9:
        raise ValueError(f"a run of {end:.0f} s is too short for warm-up {warmup_s:g} s and two {window_s:g} s windows")
    first_rss = [s.rss_mb for s in samples if warmup_s <= s.t_s <= first_end]
    last_rss = [s.rss_mb for s in samples if s.t_s >= end - window_s]
    first_lat = [lat for t, lat in latencies if warmup_s <= t <= first_end]
    last_lat = [lat for t, lat in latencies if t >= end - window_s]
    if not (first_rss and last_rss and first_lat and last_lat):
        raise ValueError("a window has no samples: sample more often or run longer")
    rss_first, rss_last = statistics.median(first_rss), statistics.median(last_rss)
    p99_first, p99_last = percentile(first_lat, 0.99) * 1e3, percentile(last_lat, 0.99) * 1e3
    growth = rss_last / rss_first - 1
    failed = sum(s.failed for s in samples)
    reasons = []
    if growth > rss_growth:
        reasons.append(f"RSS grew {growth:.1%} (> {rss_growth:.0%}): {rss_first:.1f} -> {rss_last:.1f} MB")
    if p99_last > p99_factor * p99_first + p99_slack_ms:
        reasons.append(f"p99 drifted {p99_first:.1f} -> {p99_last:.1f} ms (> {p99_factor:g}x + {p99_slack_ms:g} ms)")
    if failed:
        reasons.append(f"{failed} requests failed")
    return Verdict(not reasons, rss_first, rss_last, growth * 100, p99_first, p99_last, failed, reasons)


# -- the traffic ----------------------------------------------------------------------------------
class Traffic:
    """Request bodies: sessions of 1-6 turns over shared system prompts, then gone for good."""

    def __init__(self, seed: int = 0, texts: int | None = None):
        self.rng = random.Random(seed)
        self.texts = texts  # None: every message text is new
        self.ids = itertools.count()
        self.sessions: list[dict] = []

    def next(self) -> tuple[str, dict, dict[str, str]]:
        """(path, body, headers) of the next request."""
        n = next(self.ids)
        if self.rng.random() < 0.1:  # a completion with a unique prompt
            body = {"model": MODEL, "prompt": f"Summarize document {self._text(n)}: " + "lorem ipsum " * 20,
                    "max_tokens": 4}
            return "/v1/completions", body, {"X-Request-Id": f"soak-{n}"}
        if not self.sessions or self.rng.random() < 0.3:
            self.sessions.append({"id": f"s{n}", "user": f"user-{n}", "turns": self.rng.randint(1, 6),
                                  "messages": [{"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)}]})
        s = self.rng.choice(self.sessions)
        s["messages"].append({"role": "user", "content": f"question {self._text(n)}: how do caches and routers interact?"})
        s["turns"] -= 1
        if s["turns"] <= 0:
            self.sessions.remove(s)
        else:
            s["messages"].append({"role": "assistant", "content": f"answer {self._text(n)}: they share prefixes."})
        body = {"model": MODEL, "messages": list(s["messages"]), "max_tokens": 8, "user": s["user"],
                "stream": self.rng.random() < 0.7}
        return "/v1/chat/completions", body, {"X-Session-ID": s["id"], "X-Request-Id": f"soak-{n}"}

    def _text(self, n: int) -> int:
        return n if self.texts is None else self.rng.randrange(self.texts)


async def send(session: aiohttp.ClientSession, url: str, path: str, body: dict, headers: dict[str, str]) -> bool:
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            data = await resp.read()
            return resp.status == 200 and b'"error"' not in data
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def drive(
    url: str, rate: float, duration_s: float, results: list[tuple[float, float, bool]], texts: int | None = None
) -> None:
    """Open loop: request i leaves at start + i/rate; appends (end time, latency s, ok) per request."""
    traffic = Traffic(texts=texts)
    start = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()

    async def one(path: str, body: dict, headers: dict[str, str]) -> None:
        sent = time.monotonic()
        ok = await send(session, url, path, body, headers)
        ended = time.monotonic()
        results.append((ended - start, ended - sent, ok))

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for i in itertools.count():
            at = start + i / rate
            if at - start >= duration_s:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            task = asyncio.create_task(one(*traffic.next()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=60)


# -- the processes --------------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def start_stack(
    replicas: int, time_scale: float, small_bounds: bool
) -> tuple[list[asyncio.subprocess.Process], str]:
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    urls = []
    for _ in range(replicas):
        proc, url = await spawn([py, "-m", "kvroute.cli", "replica", "--engine", "emulated", "--port", "0",
                                 "--model", MODEL, "--time-scale", str(time_scale), "--log-level", "WARNING",
                                 *(SMALL_BOUNDS_REPLICA if small_bounds else [])])
        procs.append(proc)
        urls.append(url)
    proc, url = await spawn([py, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0",
                             "--replicas", ",".join(urls), "--tokenizer", str(TOKENIZER),
                             "--policy", "cost_model", "--log-level", "warning",
                             *(SMALL_BOUNDS_ROUTER if small_bounds else [])])
    procs.append(proc)  # the router last
    return procs, url


async def run(args: argparse.Namespace) -> tuple[list[Sample], list[tuple[float, float, bool]]]:
    small = args.cache_bounds == "small"
    procs, url = await start_stack(args.replicas, args.time_scale, small)
    router_pid = procs[-1].pid
    results: list[tuple[float, float, bool]] = []
    samples: list[Sample] = []
    try:
        load = asyncio.create_task(drive(url, args.rate, args.minutes * 60, results, TEXTS if small else None))
        start, seen = time.monotonic(), 0
        print(f"{'t (s)':>7} {'RSS (MB)':>9} {'requests':>9} {'failed':>7} {'p50 (ms)':>9} {'p99 (ms)':>9}")
        while not load.done():
            await asyncio.wait({load}, timeout=max(0.0, start + (len(samples) + 1) * args.sample_s - time.monotonic()))
            window, seen = results[seen:], len(results)
            lat = [lat for _, lat, ok in window if ok]
            s = Sample(time.monotonic() - start, rss_mb(router_pid), len(window), sum(not ok for *_, ok in window),
                       percentile(lat, 0.5) * 1e3 if lat else None, percentile(lat, 0.99) * 1e3 if lat else None)
            samples.append(s)
            p50 = f"{s.p50_ms:9.1f}" if s.p50_ms is not None else f"{'-':>9}"
            p99 = f"{s.p99_ms:9.1f}" if s.p99_ms is not None else f"{'-':>9}"
            print(f"{s.t_s:7.0f} {s.rss_mb:9.1f} {s.requests:9d} {s.failed:7d} {p50} {p99}", flush=True)
        await load
    finally:
        await stop_all(procs)
    return samples, results


def plot(samples: list[Sample], path: Path) -> None:
    plt = pyplot("python -m kvroute.bench.soak")

    t = [s.t_s / 60 for s in samples]
    fig, (ax_rss, ax_lat) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_rss.plot(t, [s.rss_mb for s in samples], color="tab:blue")
    ax_rss.set_ylabel("router RSS (MB)")
    ax_rss.set_ylim(0, 1.15 * max(s.rss_mb for s in samples))  # a flat line must not sit on the frame
    for name, key in (("p50", "p50_ms"), ("p99", "p99_ms")):
        ax_lat.plot(t, [getattr(s, key) for s in samples], label=name)
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_xlabel("minutes")
    ax_lat.legend()
    fig.suptitle("kvroute soak")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=10.0, help="requests per second")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=0.05, help="the emulated engines' speed (0: answer at once)")
    p.add_argument("--cache-bounds", choices=("small", "default"), default="small",
                   help="small: the router's cache bounds are reached within the warm-up (see above)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=60.0, help="the first and last windows compared")
    p.add_argument("--rss-growth", type=float, default=0.05)
    p.add_argument("--p99-factor", type=float, default=1.5)
    p.add_argument("--p99-slack-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=Path("soak"), help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    pyplot("python -m kvroute.bench.soak")  # before a 10-minute run, not after it
    samples, results = asyncio.run(run(args))
    latencies = [(t, lat) for t, lat, ok in results if ok]
    verdict = analyze(samples, latencies, warmup_s=args.warmup_s, window_s=args.window_s,
                      rss_growth=args.rss_growth, p99_factor=args.p99_factor, p99_slack_ms=args.p99_slack_ms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "verdict": asdict(verdict),
         "samples": [asdict(s) for s in samples]}, indent=1))
    plot(samples, args.out.with_suffix(".png"))
    print(f"RSS {verdict.rss_first_mb:.1f} -> {verdict.rss_last_mb:.1f} MB ({verdict.rss_growth_pct:+.1f}%), "
          f"p99 {verdict.p99_first_ms:.1f} -> {verdict.p99_last_ms:.1f} ms, {verdict.failed} failed: "
          + ("PASS" if verdict.ok else "FAIL: " + "; ".join(verdict.reasons)))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
