"""`make bench-routing` (`python -m kvroute.bench.routing_gate`, `kvroute bench gate`): the live routing gate.

Every routing configuration runs as users run it: `kvroute router` in its own process (a fresh one
per run, on a free port, the flags `--config/--policy/--tokenizer/--port/--host` only), real HTTP,
in front of emulated vLLM replicas (one fleet process per workload, `replica/emulated/fleet.py`:
real per-replica prefix caches, continuous batching in virtual time, KV events over ZMQ that the
router follows), emptied between runs.  Each workload is replayed by `kvroute bench replay` in its
own process, open loop, streamed, with session ids in `X-Session-ID`.  Per workload the configs
run interleaved (their order rotates from one workload to the next), so the machine's noise falls
on all of them; the fleet simulator (bench/sim.py) runs the same requests, same policies, beside
them.  docs/routing-gate.md says what it runs, how to read it, and the rule it enforces.

Sizing (2 shared cores, about 10 minutes): 8 replicas of the H100 profile; every workload is
replayed at the same wall rate (`--wall-rate`, 12 requests/s by default, what client, router and
replicas carry on two cores), and its replicas' `time_scale` is chosen so that this rate is the
workload's target share of the fleet's capacity (the simulator's offered-load estimate: the rate
that keeps `load` of the fleet busy under round_robin).  A workload whose requests cost the
engines more therefore runs its replicas faster than real time, one that costs little (handbook:
decode only) slower; TTFT multiples of the physical limit (bench/limit.py) compare across them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .gate.processes import Config, FleetProcess, router_command, run_config
from .gate.report import print_workload
from .gate.settings import (
    COMPARE_PREFIX,
    DEFAULT_POLICY,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    POLICIES,
    REPLICAS,
    REPO,
    REQUEST_TIMEOUT_S,
    SPREAD_FILE,
    TTFT_KEYS,
    WALL_RATE,
)
from .gate.verdict import load_spread, measure_spread, verdict
from .gate.workloads import WORKLOADS, prepare_workload, simulate

# --- the run ----------------------------------------------------------------------------------


def configs_of(args: argparse.Namespace) -> list[Config]:
    out = [Config(p, p, args.checkout) for p in args.policies]
    if args.compare is not None:
        out.append(Config(COMPARE_PREFIX + DEFAULT_POLICY, DEFAULT_POLICY, args.compare))
    return out


async def run_gate(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    err = Console(stderr=True)
    out_dir = Path(args.out).resolve()  # absolute: a --compare router runs in its own checkout
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    configs = configs_of(args)
    for c in configs:
        router_command(c.checkout)  # a checkout without its virtualenv gets one now, not mid-run
    started = time.perf_counter()
    doc: dict[str, Any] = {"settings": {
        "replicas": args.replicas, "wall_rate": args.wall_rate_given or "per workload", "profile": args.profile.name,
        "max_tokens": args.max_tokens, "max_model_len": MAX_MODEL_LEN, "policies": args.policies, "checkout": str(args.checkout or REPO), "compare": str(args.compare) if args.compare else None,
        "requests_scale": args.requests_scale, "repeat": args.repeat, "spread_file": str(args.spread),
        "commit": git_commit(args.checkout or REPO), "compare_commit": git_commit(args.compare) if args.compare else None,
    }, "workloads": {}}
    spread = load_spread(args.spread)
    for k, name in enumerate(args.workloads):
        spec = WORKLOADS[name]
        t0 = time.perf_counter()
        prep = prepare_workload(spec, args, out_dir, args.profile)
        err.print(f"[bold]{name}[/]: {len(prep.rows)} requests, replicas at time scale {prep.time_scale:.2f} "
                  f"({prep.engine_rate:.1f} req per engine s = {spec.load:.0%} load), replay speedup {prep.speedup:.2f}; "
                  f"prepared in {time.perf_counter() - t0:.1f} s")
        w: dict[str, Any] = {"workload": prep.describe(), "configs": {}, "runs": {}}
        if not args.no_sim:
            t0 = time.perf_counter()
            w["sim"] = simulate(prep, args.policies)
            err.print(f"  simulated in {time.perf_counter() - t0:.1f} s")
        fleet = FleetProcess(args.replicas, prep.time_scale, spec.slow, spec.slow_factor, logs / f"{name}.fleet.log")
        await fleet.start()
        try:
            for rep in range(args.repeat):
                shift = (k + rep) % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    fig = await run_config(prep, config, fleet, args, logs)
                    w["runs"].setdefault(config.name, []).append(fig)
                    m = fig.get("ttft_vs_limit") or {}
                    e = fig["engine"].get("ttft_vs_limit") or {}
                    err.print(f"  {config.name:<24} {fig['answered']}/{fig['requests']} answered, reuse "
                              f"{fig['delivered_share_of_available']:.1%} of available, TTFT p50/p90/p99 "
                              + "/".join(f"{m.get(k_, math.nan):.2f}x" for k_ in TTFT_KEYS) + " (engine "
                              + "/".join(f"{e.get(k_, math.nan):.2f}x" for k_ in TTFT_KEYS)
                              + f"), {fig['run_wall_s']:.0f} s, router CPU {fig['cpu_s']['router']} s, others "
                              + f"{fig['cpu_s'].get('others_cores')} cores")
        finally:
            await fleet.stop()
        for cfg, runs in w["runs"].items():
            w["configs"][cfg] = median_run(runs)
        limits = [r["limit"] for runs in w["runs"].values() for r in runs if r.get("limit")]
        w["limit"] = limits[0] if limits else None
        if not args.records:
            for runs in w["runs"].values():
                for r in runs:
                    r.pop("records", None)
        w["verdict"] = verdict(name, w["configs"], spread)
        doc["workloads"][name] = w
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    return doc


async def cancellable(coro: Any) -> Any:
    """``coro``, cancelled by SIGTERM as by Ctrl-C, so that its child processes are stopped."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures, or, repeated, each metric's median over the runs (the others: the first's)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in (*TTFT_KEYS, "reuse_delivered", "delivered_share_of_available", "errors"):
        out[key] = float(np.median([r[key] for r in runs]))
    if out.get("limit"):
        out["ttft_vs_limit"] = {k: out[k] / out["limit"][k] for k in TTFT_KEYS}
    if all(r.get("engine") for r in runs):
        out["engine"] = {k: float(np.median([r["engine"][k] for r in runs])) for k in TTFT_KEYS}
        if out.get("limit"):
            out["engine"]["ttft_vs_limit"] = {k: out["engine"][k] / out["limit"][k] for k in TTFT_KEYS}
    return out


def git_commit(path: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    from .sim_cli import resolve_profile

    p = argparse.ArgumentParser(prog="python -m kvroute.bench.routing_gate", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)} (default all)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"this checkout's policies (default {','.join(POLICIES)})")
    p.add_argument("--compare", default=None, metavar="CHECKOUT",
                   help="another checkout of kvroute (e.g. a `git worktree add ../base main`): its router's default policy "
                   "runs beside these, from its own .venv (made with `make install` if missing)")
    p.add_argument("--checkout", default=None, metavar="CHECKOUT",
                   help="the checkout whose router is under test (default: this one), e.g. an older commit's worktree")
    p.add_argument("--requests-scale", type=float, default=1.0, help="multiply every workload's requests (default 1)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each config per workload; figures are medians (default 1)")
    p.add_argument("--seed", type=int, default=None, help="every workload's seed (default: each its own, 0)")
    p.add_argument("--replicas", type=int, default=REPLICAS, help=f"emulated replicas (default {REPLICAS})")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                   help=f"wall seconds a request may take before it fails (the user gave up; default {REQUEST_TIMEOUT_S:g})")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"cap of every request's output (default {MAX_TOKENS})")
    p.add_argument("--wall-rate", type=float, default=None,
                   help=f"requests per wall second of every workload (default {WALL_RATE:g}; the trace's 8)")
    p.add_argument("--profile", default=None, help="the replicas' timing profile (default: the H100 one)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's rows")
    p.add_argument("--json", default=None, metavar="FILE", help="write everything there")
    p.add_argument("--records", action="store_true", help="with --json: every request's figures too")
    p.add_argument("--out", default=str(REPO / "build" / "routing-gate"), help="traces, router configs and logs (default build/routing-gate)")
    p.add_argument("--spread", type=Path, default=SPREAD_FILE, help="the measured run-to-run spread (default bench/gate_spread.json)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a workload shows a regression")
    p.add_argument("--show", default=None, metavar="GATE_JSON",
                   help="print a saved run's tables, with verdicts against --spread as it is now; runs nothing")
    p.add_argument("--write-spread", nargs="+", default=None, metavar="GATE_JSON",
                   help="measure the spread from gate JSONs of main against itself (--compare of the same commit) "
                   "and write it to --spread; runs nothing")
    args = p.parse_args(argv)
    if args.write_spread or args.show:
        return args
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    from kvroute.router.placement.policy import POLICIES as ALL_POLICIES

    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in args.policies if x not in ALL_POLICIES]
    if bad:
        p.error(f"unknown policy {', '.join(bad)}")
    args.wall_rate_given, args.wall_rate = args.wall_rate, args.wall_rate or WALL_RATE
    if args.requests_scale <= 0 or args.repeat < 1 or args.replicas < 2 or args.wall_rate <= 0:
        p.error("--requests-scale and --wall-rate must be positive, --repeat at least 1, --replicas at least 2")
    for name in ("compare", "checkout"):
        value = getattr(args, name)
        if value is not None:
            path = Path(value).resolve()
            if not (path / "router").is_dir():
                p.error(f"--{name} {value}: not a kvroute checkout")
            setattr(args, name, path)
    args.profile = resolve_profile(args.profile, "routing gate")
    from kvroute.replica.assets import TINY_TOKENIZER

    args.tokenizer = TINY_TOKENIZER
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from .report import json_safe

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.write_spread:
        spread = measure_spread([Path(x) for x in args.write_spread])
        spread["measured_from"] = [str(x) for x in args.write_spread]
        args.spread.write_text(json.dumps(spread, indent=2) + "\n")
        print(json.dumps(spread, indent=2))
        return 0
    if args.show:
        doc = json.loads(Path(args.show).read_text())
        spread = load_spread(args.spread)
        for name, w in doc["workloads"].items():
            w["verdict"] = verdict(name, w["configs"], spread)
        args.compare = doc["settings"].get("compare")
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            doc = asyncio.run(cancellable(run_gate(args)))
        except (KeyboardInterrupt, asyncio.CancelledError):  # the fleet, routers and replays were stopped
            print("routing gate: interrupted", file=sys.stderr)
            return 130
    console = Console(width=180)
    for name, w in doc["workloads"].items():
        print_workload(name, w, console)
    regressions = [n for n, w in doc["workloads"].items() if (w.get("verdict") or {}).get("regression")]
    console.print(f"routing gate: {len(doc['workloads'])} workloads in {doc['wall_s']:.0f} s; "
                  + (f"[bold red]regression[/] on {', '.join(regressions)}" if regressions else
                     ("no regression beyond the spread" if args.compare else "no --compare: no verdict")))
    if args.json and not args.show:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(json_safe_deep(doc, json_safe)) + "\n")
    errors = sum(int(f.get("errors") or 0) for w in doc["workloads"].values() for f in w["configs"].values())
    if errors:
        console.print(f"[yellow]{errors} requests failed; see {args.out}/logs[/]")
    return 1 if (args.strict and regressions) else 0


def json_safe_deep(v: Any, safe: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): json_safe_deep(x, safe) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [json_safe_deep(x, safe) for x in v]
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, np.generic):
        v = v.item()
    return safe(v)


if __name__ == "__main__":
    sys.exit(main())
