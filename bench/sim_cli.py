"""`kvroute sim`: compare routing policies on one workload in the fleet simulator.

Results go to stdout (a table, or exactly one JSON object with --json); progress and logs go to
stderr.  Every policy starts from cold engines and a fresh index on the same requests.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import report
from kvroute.bench.limit import fleet_limit, percentiles
from kvroute.bench.sim import FleetConfig, PreparedWorkload, offered_load_rate, prepare, simulate_policy
from kvroute.bench.workloads import DEFAULT_REQUESTS, DEFAULT_TRACE_NAME, WORKLOADS, Workload, build_workload

RATE_SAMPLE = 5000  # at most this many requests estimate the default rate


def parse_args(argv: list[str], prog: str = "kvroute sim", description: str | None = None) -> argparse.Namespace:
    from .chat_workloads import WORKLOADS as CHAT_WORKLOADS

    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=WORKLOADS,
                        help="the requests: multi-turn chats (sessions, conversation), one shared document (handbook), "
                        "a Mooncake trace (trace), or no shared prefixes (random)")
    source.add_argument("--chat-trace", default=None, metavar="FILE",
                        help="a chat trace (bench/chat_trace.py): its rows' messages rendered and tokenized with "
                        "--tokenizer; arrivals at their timestamps over --speedup, or at --rate / --load")
    source.add_argument("--chat-workload", default=None, choices=CHAT_WORKLOADS,
                        help="a generated chat workload (bench/chat_workloads.py: what `kvroute bench replay --workload` "
                        "sends), tokenized with --tokenizer")
    p.add_argument("--tokenizer", default=None, metavar="DIR|HF_ID",
                   help="--chat-trace/--chat-workload: the tokenizer (default: the tiny tokenizer)")
    p.add_argument("--speedup", type=float, default=None,
                   help="--chat-trace/--chat-workload: divide the timestamps by this (engine seconds; ignored with --rate)")
    p.add_argument("--slow-replicas", type=int, default=0, help="this many replicas (the last ones) run slower (default 0)")
    p.add_argument("--slow-factor", type=float, default=10.0, help="how much slower they run (default 10)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help=f"Mooncake-format JSONL (gzipped or not) for --workload trace (default: {DEFAULT_TRACE_NAME})")
    p.add_argument("--replicas", type=int, default=8, help="emulated engines in the fleet (default 8)")
    p.add_argument("--policy", default="all",
                   help=f"comma-separated policy names ({', '.join(policy_names())}), or 'all' (default all)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: --load of the fleet's capacity under round_robin)")
    p.add_argument("--load", type=float, default=0.75, help="target share of fleet capacity for the default rate (default 0.75)")
    p.add_argument("--time-scale", type=float, default=None, help="trace: multiply timestamps by this (ignored with --rate)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", "--limit", dest="requests", type=int, default=None,
                      help=f"requests to run; sessions, conversation: a window holding about that many (defaults: {', '.join(f'{k} {v}' for k, v in DEFAULT_REQUESTS.items())})")
    size.add_argument("--duration", type=float, default=None, help="seconds of arrivals (virtual time)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the policies' randomness (default 0)")
    p.add_argument("--profile", default=None, help="engine timing profile (default: the calibrated one)")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="engines publish no KV events: the index only has the router's predictions")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write TTFT CDFs and reuse figures")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if not 0 <= args.slow_replicas <= args.replicas or args.slow_factor <= 0:
        p.error("--slow-replicas must be between 0 and --replicas, --slow-factor positive")
    args.chat = args.chat_trace is not None or args.chat_workload is not None
    if args.chat:
        args.workload = f"chat:{args.chat_workload or Path(args.chat_trace).name}"
    if args.plot:
        report.pyplot("kvroute sim --plot")  # missing matplotlib: say so now, not after the run
    return args


def policy_names() -> list[str]:
    from kvroute.router.placement.policy import POLICIES

    return list(POLICIES)


def resolve_policies(spec: str) -> list[str]:
    from kvroute.router.placement.policy import ALL, POLICIES

    if spec.strip() == "all":
        return list(ALL)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"kvroute sim: unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)} or all")
    return names


def resolve_profile(name: str | None, prog: str = "kvroute sim") -> Any:
    from kvroute.replica.emulated.profile import DEFAULT_PROFILE, PROFILES

    if name is None:
        return DEFAULT_PROFILE
    if name not in PROFILES:
        raise SystemExit(f"{prog}: unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    return PROFILES[name]


def describe_size(workload: Workload) -> str:
    if workload.end_s is None:
        return f"{len(workload.requests)} requests"
    expected = workload.rate * workload.end_s
    return f"a {workload.end_s:.0f} s window of conversations (≈{expected:,.0f} requests)"


def fleet_config(args: argparse.Namespace, profile: Any) -> FleetConfig:
    slow = (1.0,) * (args.replicas - args.slow_replicas) + (args.slow_factor,) * args.slow_replicas
    return FleetConfig(replicas=args.replicas, profile=profile, kv_events=args.kv_events, slowdown=slow)


def effective_replicas(cfg: FleetConfig) -> float:
    """The fleet's capacity in replicas of the profile's speed (a 10x slower one counts 0.1)."""
    return sum(1.0 / cfg.slowdown[i] if i < len(cfg.slowdown) else 1.0 for i in range(cfg.replicas))


def offered_rate(prepared: PreparedWorkload, profile: Any, cfg: FleetConfig, load: float, seed: int = 0) -> tuple[float, str]:
    """The rate (req/s) that keeps ``load`` of the fleet's capacity busy under round_robin, and how it was set."""
    offered = offered_load_rate(prepared, profile, cfg.replicas, load, seed)
    capacity = effective_replicas(cfg)
    note = offered.describe(cfg.replicas)
    if capacity != cfg.replicas:
        note += f"; times {capacity:g}/{cfg.replicas} for the slower replicas' share of the capacity"
    return offered.rate * capacity / cfg.replicas, note


def chat_prepared(args: argparse.Namespace, profile: Any) -> tuple[PreparedWorkload, str]:
    """A chat trace's or generated chat workload's rows, tokenized, hashed, timed (open loop)."""
    from . import chat_workloads
    from .chat_trace import chat_prompt_ids, load_chat_trace

    if args.chat_workload is not None:
        rows = chat_workloads.rows(args.chat_workload, args.seed, args.requests or 300)
    else:
        rows = load_chat_trace(args.chat_trace)[: args.requests]
    if not rows:
        raise SystemExit(f"kvroute sim: no rows in {args.chat_trace}")
    ids = chat_prompt_ids(rows, args.tokenizer)
    nominal = chat_workloads.nominal_rate(rows)
    prepared = prepare(chat_workloads.sim_workload(args.workload, rows, ids), profile.block_size)
    if args.rate is not None:
        rate, note = args.rate, f"rate {args.rate:.2f} req/s (given)"
    elif args.speedup is not None:
        rate, note = nominal * args.speedup, f"rate {nominal * args.speedup:.2f} req/s (timestamps over speedup {args.speedup:g})"
    else:
        rate, note = offered_rate(prepared, profile, fleet_config(args, profile), args.load, args.seed)
    return retimed(prepared, nominal / rate), note


def retimed(prepared: PreparedWorkload, scale: float) -> PreparedWorkload:
    """The same requests, arrival times multiplied by ``scale``."""
    from dataclasses import replace

    w = prepared.workload
    reqs = [replace(r, arrival_s=r.arrival_s * scale) if r.arrival_s is not None else r for r in w.requests]
    return PreparedWorkload(Workload(w.name, reqs, w.unit_rate, scale), prepared.block_size, prepared.chains, prepared.prompt_tokens)


def prepared_workload(args: argparse.Namespace, profile: Any) -> tuple[PreparedWorkload, str]:
    """The run's requests, hashed, at ``--rate`` or the default offered load; and how the rate was set."""
    if getattr(args, "chat", False):
        return chat_prepared(args, profile)
    rate_note = ""
    rate = args.rate
    sample = None
    if rate is None and args.time_scale is None:
        sample_n = min(args.requests or DEFAULT_REQUESTS[args.workload], RATE_SAMPLE)
        sample = prepare(build_workload(args.workload, seed=args.seed, requests=sample_n, trace_path=args.trace), profile.block_size)
        rate, rate_note = offered_rate(sample, profile, fleet_config(args, profile), args.load, args.seed)
    workload = build_workload(
        args.workload,
        seed=args.seed,
        requests=args.requests,
        duration_s=args.duration,
        rate=rate,
        time_scale=args.time_scale,
        trace_path=args.trace,
    )
    if not rate_note:
        rate_note = f"rate {workload.rate:.2f} req/s (" + ("given)" if args.rate is not None else f"time scale {workload.time_scale:g})")
    if sample is not None and workload.end_s is None and len(sample.chains) == len(workload.requests):
        # Open loop, same requests: only the arrival times changed; keep the hashed chains.
        return PreparedWorkload(workload, sample.block_size, sample.chains, sample.prompt_tokens), rate_note
    return prepare(workload, profile.block_size), rate_note


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvroute.router.placement.policy import make_policy

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    err = Console(stderr=True)
    policies = resolve_policies(args.policy)
    profile = resolve_profile(args.profile)
    started = time.perf_counter()

    prepared, rate_note = prepared_workload(args, profile)
    workload = prepared.workload
    size = describe_size(workload)
    slow = f" ({args.slow_replicas} of them {args.slow_factor:g}x slower)" if args.slow_replicas else ""
    err.print(f"[bold]{args.workload}[/]: {size}, {args.replicas} replicas{slow}, profile {profile.name}; {rate_note}")

    cfg = fleet_config(args, profile)
    results: dict[str, dict[str, Any]] = {}
    ttfts = {}
    limits = []
    walls = {}
    too_long = 0
    with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err) as bar:
        for name in policies:
            task = bar.add_task(name, total=len(workload.requests))
            t0 = time.perf_counter()
            run = simulate_policy(prepared, make_policy(name, seed=args.seed), cfg, progress=lambda n, _t=task: bar.advance(_t, n))
            walls[name] = time.perf_counter() - t0
            bar.update(task, completed=len(workload.requests))  # closed loop: turns past the window never run
            results[name] = run.metrics()
            too_long = run.too_long
            ttfts[name] = run.ttft
            limits.append(run.limit_ttft)
    wall = time.perf_counter() - started
    per_request = fleet_limit(limits)
    limit = percentiles(per_request[~np.isnan(per_request)])
    if too_long:
        err.print(f"[yellow]{too_long} requests not sent: prompt + output exceed a replica's KV capacity[/]")
    err.print(f"simulated in {wall:.1f} s wall (" + ", ".join(f"{n} {s:.1f} s" for n, s in walls.items()) + ")")

    title = f"kvroute sim: {args.workload}, {args.replicas} replicas, {size}, seed {args.seed}"
    if args.plot:
        report.plot(ttfts, results, args.plot, title=f"{title}\n{rate_note}")
        err.print(f"plot written to {args.plot}")
    if args.json:
        extra = {
            "workload": args.workload,
            "replicas": args.replicas,
            "slow_replicas": args.slow_replicas,
            "slow_factor": args.slow_factor,
            "rate": workload.rate,
            "rate_note": rate_note,
            "profile": profile.name,
            "seed": args.seed,
            "kv_events": args.kv_events,
            "too_long_requests": too_long,
            "wall_s": round(wall, 2),
            "limit": limit,
        }
        sys.stdout.write(report.to_json(results, extra) + "\n")
    else:
        report.print_table(results, title, file=sys.stdout, footer=f"{rate_note}\n{report.LIMIT_NOTE}", limit=limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
