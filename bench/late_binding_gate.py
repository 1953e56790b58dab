"""`python -m kvroute.bench.late_binding_gate`: the routing gate's workloads (bench/gate/workloads.py,
at their loads, the slow-replica fleet included) through the simulator with and without late
binding (bench/late_binding.py), several seeds, side by side: reuse as % of available and TTFT
p50/p90/p99 as multiples of the physical limit, per seed and as medians.  docs/experiments.md
holds what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .gate.settings import MAX_TOKENS, REPLICAS, REPO, TTFT_KEYS, WALL_RATE
from .gate.workloads import WORKLOADS, prepare_workload
from .late_binding import Room, simulate_held, wait_summary
from .limit import fleet_limit, percentiles

# The rules tried: vLLM's own queue empty (the engine admitted everything sent), the router's
# estimated prefill queue under a fraction of a second, both; released among all replicas or only
# those with room.
RULES: dict[str, Room | None] = {
    "off": None,
    "waiting0": Room(max_waiting=0),
    "waiting0-room": Room(max_waiting=0, room_only=True),
    "queue0.25": Room(max_waiting=None, max_queue_s=0.25),
    "queue0.25-room": Room(max_waiting=None, max_queue_s=0.25, room_only=True),
    "waiting0-choice": Room(max_waiting=0, release="choice"),
    "queue0.25-choice": Room(max_waiting=None, max_queue_s=0.25, release="choice"),
    "queue0.5-choice": Room(max_waiting=None, max_queue_s=0.5, release="choice"),
    "queue0.5": Room(max_waiting=None, max_queue_s=0.5),
    # what a live router knows: the engines' waiting count scraped every 0.64 engine seconds (1 s
    # wall at the gate's time scale ~1.56), or its own queued prefill tokens against one step's budget
    "waiting0-scraped-choice": Room(max_waiting=0, scrape_s=0.64, release="choice"),
    "tokens8k-choice": Room(max_waiting=None, max_queued_tokens=8192, release="choice"),
    "tokens16k-choice": Room(max_waiting=None, max_queued_tokens=16384, release="choice"),
    "tokens8k": Room(max_waiting=None, max_queued_tokens=8192),
    "queue1": Room(max_waiting=None, max_queue_s=1.0),
    "waiting2": Room(max_waiting=2),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    from .sim_cli import resolve_profile

    p = argparse.ArgumentParser(prog="python -m kvroute.bench.late_binding_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated gate workloads (default all)")
    p.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of {', '.join(RULES)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated workload seeds (default 0,1,2)")
    p.add_argument("--policy", default="cost_model")
    p.add_argument("--hold-max-s", type=float, default=None, help="every rule's hold budget, engine seconds (default the rule's: 1)")
    p.add_argument("--requests-scale", type=float, default=1.0)
    p.add_argument("--load", type=float, default=None, help="every workload at this share of the fleet's capacity (default: each its own)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    args.workloads = args.workloads.split(",")
    args.rules = args.rules.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    # what bench/gate/workloads.py's prepare_workload reads of the gate's own arguments
    args.replicas, args.max_tokens, args.wall_rate, args.wall_rate_given = REPLICAS, MAX_TOKENS, WALL_RATE, None
    args.profile = resolve_profile(None, "late binding")
    return args


def run_workload(name: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from dataclasses import replace

    from kvroute.router.placement.policy import make_policy

    args.seed = seed
    spec = WORKLOADS[name] if args.load is None else replace(WORKLOADS[name], load=args.load)
    prep = prepare_workload(spec, args, out, args.profile)
    runs, stats = {}, {}
    for rule in args.rules:
        room = RULES[rule]
        if room is not None and args.hold_max_s is not None:
            room = replace(room, hold_max_s=args.hold_max_s)
        runs[rule], stats[rule] = simulate_held(prep.sim, make_policy(args.policy, seed=seed), prep.cfg, room)
    limit_all = fleet_limit([r.limit_ttft for r in runs.values()])
    limit = percentiles(limit_all[~np.isnan(limit_all)])
    rows = {}
    for rule, run in runs.items():
        m = run.metrics()
        rows[rule] = {
            "reuse": m["reuse_delivered"] / m["reuse_available"] if m["reuse_available"] else float("nan"),
            **{k: m[k] / limit[k] for k in TTFT_KEYS},
            "answered": m["requests"],
            **wait_summary(stats[rule]),
        }
        if prep.spec.slow:
            counts = np.bincount(run.replica[run.replica >= 0], minlength=prep.cfg.replicas)
            rows[rule]["slow_share"] = float(counts[-prep.spec.slow:].sum() / max(1, counts.sum()))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = REPO / "build" / "late-binding"
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {}
    for name in args.workloads:
        for seed in args.seeds:
            t0 = time.perf_counter()
            rows = run_workload(name, seed, args, out)
            doc.setdefault(name, {})[seed] = rows
            print(f"## {name} seed {seed} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for rule, r in rows.items():
                slow = f" slow {r['slow_share']:.1%}" if "slow_share" in r else ""
                print(f"  {rule:<16} reuse {r['reuse']:.1%}  p50/p90/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p90_s']:.2f}/"
                      f"{r['ttft_p99_s']:.2f}x  held {r['held']} (expired {r['expired']}, mean {r['wait_mean_s'] * 1000:.0f} ms, "
                      f"max {r['wait_max_s'] * 1000:.0f} ms){slow}", flush=True)
    print_summary(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def print_summary(doc: dict[str, Any]) -> None:
    """Per workload and rule, against ``off`` seed by seed: reuse in points, TTFT percentiles as
    ratios (median over seeds, then the range), and how many seeds held anything."""
    print("\n## against off, per seed: reuse pts median [min, max]; p50 / p90 / p99 ratio median [min, max]")
    for name, seeds in doc.items():
        rules = [r for r in next(iter(seeds.values())) if r != "off"]
        for rule in rules:
            d_reuse = [100 * (s[rule]["reuse"] - s["off"]["reuse"]) for s in seeds.values()]
            ratios = {k: [s[rule][k] / s["off"][k] for s in seeds.values()] for k in TTFT_KEYS}
            held = sum(1 for s in seeds.values() if s[rule]["held"])
            cells = [f"{np.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]" for v in ratios.values()]
            print(f"  {name:<16} {rule:<16} held in {held}/{len(seeds)} seeds  reuse {np.median(d_reuse):+.1f} "
                  f"[{min(d_reuse):+.1f}, {max(d_reuse):+.1f}]  " + "  ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
