"""The routing gate's workloads in the simulator over several seeds: reuse and TTFT multiples per policy.

    python -m kvroute.bench.gate_sim --seeds 0-4 --policies cost_model,sglang_cache_aware
    python -m kvroute.bench.gate_sim --seeds 0-4 --variant 'nohot=cost_model:{"explore": false}'

Each workload of ``bench/gate/workloads.py`` is prepared as the gate prepares it (its requests,
load and fleet) at each seed, and every policy (and ``--variant NAME=POLICY:JSON_OPTIONS``) runs
on the same requests.  Per workload and policy it prints the mean over seeds of delivered reuse
as % of available and TTFT p50/p90/p99 as multiples of the physical limit (one limit per seed,
shared by the policies, as the gate does), then per seed the difference from the first policy
(``--per-seed``).  ``--misses`` adds, for cost_model, which decisions lost its reuse (blocks an infinite
shared cache would have hit and the engine did not), by the rule that made them.  A change to a policy is judged here before the live gate
(docs/routing-gate.md): about a second per workload, policy and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

TTFT = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run_one(prep: Any, factories: dict[str, tuple[str, dict]]) -> dict[str, dict[str, float]]:
    from kvroute.router.placement.policy import make_policy

    from .limit import fleet_limit, percentiles
    from .sim import simulate_policy

    runs, limits = {}, []
    for label, (policy, options) in factories.items():
        run = simulate_policy(prep.sim, make_policy(policy, seed=prep.spec.seed, **options), prep.cfg)
        runs[label] = run.metrics()
        limits.append(run.limit_ttft)
    per_request = fleet_limit(limits)
    limit = percentiles(per_request[~np.isnan(per_request)])
    return {
        label: {"reuse": 100 * m["reuse_delivered"] / m["reuse_available"], **{k: m[k] / limit[k] for k in TTFT}}
        for label, m in runs.items()
    }


def misses(prep: Any) -> dict[str, list[int]]:
    """cost_model's lost blocks (available - delivered) per cause: [blocks, requests].  A request that
    left the replica the index matched deepest (its prefix held or being computed there) did so by
    the argmin of the cost (reason cache/load) with ``behind`` 0 for explore (the best holder had
    under half the prompt) or a hot prefix, or with the full price (the holder's queue cost more
    than a copy); or a rule overrode the argmin (balance: the in-flight bound, new-session
    spreading, starvation) or kept the session (session)."""
    from kvroute.router.placement.policy.cost_model import CostModelPolicy

    from .reuse_loss import AuditedSim

    class Traced(CostModelPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[tuple[str, int, int, float, bool]] = []
            self._behind = 0.0

        def behind(self, req: Any, replicas: Any) -> float:
            self._behind = super().behind(req, replicas)
            return self._behind

        def choose(self, req: Any, replicas: Any) -> Any:
            new = req.session_key is not None and self.sessions.home(req.session_key) is None
            choice = super().choose(req, replicas)
            held = min(max(req.matches.values(), default=0), len(req.chain))
            explore = self.explore and 2 * held * req.block_size < req.prompt_tokens
            self.log.append((choice.reason, held, choice.matched_blocks, self._behind if not explore else -1.0, new))
            return choice

    policy = Traced()
    sim = AuditedSim(prep.sim, policy, prep.cfg)
    run = sim.simulate()
    delivered = run.cached_tokens // run.block_size
    out: dict[str, list[int]] = {}
    for i, (reason, held, chosen, behind, new) in zip(sim._order, policy.log):
        lost = int(run.available[i] - delivered[i])
        if lost <= 0:
            continue
        if chosen >= held:
            cause = "chosen replica held it (lost after) or no holder known"
        elif reason in ("cache", "load"):
            cause = "cost: " + ("explore (behind 0)" if behind < 0 else "hot prefix (behind 0)" if behind == 0
                                else "holder's queue over the copy's price")
        else:
            cause = f"rule: {reason}" + (" (new session)" if new else "")
        entry = out.setdefault(cause, [0, 0])
        entry[0] += lost
        entry[1] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    from .gate.workloads import WORKLOADS, prepare_workload
    from .routing_gate import parse_args as gate_args

    p = argparse.ArgumentParser(prog="python -m kvroute.bench.gate_sim", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default="cost_model,sglang_cache_aware")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY:JSON",
                   help='a policy with options, e.g. x=cost_model:{"starve_window": 0}')
    p.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7 (default 0-4)")
    p.add_argument("--requests-scale", default="1", help="multiply every workload's requests, as the gate's flag (default 1)")
    p.add_argument("--per-seed", action="store_true", help="also print each seed's figures")
    p.add_argument("--misses", action="store_true", help="also where cost_model's reuse went, by cause")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    factories: dict[str, tuple[str, dict]] = {x: (x, {}) for x in args.policies.split(",") if x}
    for v in args.variant:
        label, _, rest = v.partition("=")
        policy, _, options = rest.partition(":")
        factories[label] = (policy, json.loads(options or "{}"))
    seeds = seeds_of(args.seeds)
    workloads = [w for w in args.workloads.split(",") if w]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    lost: dict[str, dict[str, list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in workloads:
            for seed in seeds:
                gargs = gate_args(["--workloads", w, "--seed", str(seed), "--no-sim", "--requests-scale", args.requests_scale])
                prep = prepare_workload(WORKLOADS[w], gargs, Path(tmp), gargs.profile)
                for label, figures in run_one(prep, factories).items():
                    results.setdefault(w, {}).setdefault(label, []).append(figures)
                if args.misses:
                    for cause, (blocks, count) in misses(prep).items():
                        entry = lost.setdefault(w, {}).setdefault(cause, [0, 0])
                        entry[0] += blocks
                        entry[1] += count
            print_workload(w, results[w], seeds, args.per_seed)
            if args.misses:
                total = sum(b for b, _ in lost.get(w, {}).values()) or 1
                print("  cost_model's lost blocks by cause (all seeds):")
                for cause, (blocks, count) in sorted(lost.get(w, {}).items(), key=lambda kv: -kv[1][0]):
                    print(f"    {100 * blocks / total:5.1f}%  {blocks:7,} blocks  {count:4} requests  {cause}")
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps({"seeds": seeds, "factories": factories, "results": results, "lost": lost}))
    return 0


def print_workload(w: str, rows: dict[str, list[dict[str, float]]], seeds: list[int], per_seed: bool) -> None:
    first = next(iter(rows))
    print(f"{w} (seeds {seeds[0]}..{seeds[-1]}, mean; reuse % of available, TTFT x limit; max over seeds of the "
          f"TTFT multiple's excess over {first} in brackets)")
    for label, figs in rows.items():
        mean = {k: float(np.mean([f[k] for f in figs])) for k in ("reuse", *TTFT)}
        worst = {k: max(f[k] - g[k] for f, g in zip(figs, rows[first])) for k in TTFT}
        print(f"  {label:<22} {mean['reuse']:6.2f}%  " + "  ".join(f"{mean[k]:6.2f} [{worst[k]:+.2f}]" for k in TTFT))
        if per_seed:
            for s, f in zip(seeds, figs):
                print(f"      seed {s:<3} {f['reuse']:6.2f}%  " + "  ".join(f"{f[k]:6.2f}" for k in TTFT))


if __name__ == "__main__":
    raise SystemExit(main())
