"""The verdict: a configuration against the compared checkout's router, each metric against the
measured run-to-run spread."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .settings import COMPARE_PREFIX, DEFAULT_POLICY, SPREAD_FACTOR, TTFT_KEYS


def load_spread(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def spread_for(spread: dict[str, Any], workload: str) -> dict[str, float]:
    out = dict(spread.get("default") or {})
    out.update((spread.get("workloads") or {}).get(workload) or {})
    return out


ENGINE_KEYS = tuple(f"engine_{k}" for k in TTFT_KEYS)
METRICS = ("reuse", *TTFT_KEYS, *ENGINE_KEYS, "router_cpu", "errors")
ABSOLUTE = ("reuse", "errors")  # compared as differences (points, requests); the rest as ratios


def metric_value(fig: dict[str, Any], metric: str) -> float:
    if metric == "reuse":
        return float(fig.get("delivered_share_of_available") or math.nan)
    if metric == "errors":
        return float(fig.get("errors") or 0)
    if metric == "router_cpu":  # the router's CPU per request sent, ready to the replay's end
        cpu = (fig.get("cpu_s") or {}).get("router")
        return cpu / fig["requests"] if cpu is not None and fig.get("requests") else math.nan
    if metric.startswith("engine_"):
        return float((fig.get("engine") or {}).get(metric[7:]) or math.nan)
    return float(fig.get(metric) or math.nan)


def metric_label(metric: str) -> str:
    if metric in ("reuse", "router_cpu", "errors"):
        return metric.replace("_", " ")
    return ("engine " if metric.startswith("engine_") else "") + metric.split("_")[-2]


def others_cores(fig: dict[str, Any]) -> float:
    return float((fig.get("cpu_s") or {}).get("others_cores") or 0.0)


def verdict(workload: str, configs: dict[str, dict[str, Any]], spread: dict[str, Any]) -> dict[str, Any] | None:
    """The default policy against the compared checkout's: a regression where it loses reuse (its
    delivered share of the available, in points), any TTFT percentile or router CPU (relative),
    or has more errors, by more than the measured run-to-run spread.  Only reuse is judged when a
    run had the machine busier with other jobs than any of the spread's runs had it: beyond that
    the timings, CPU and time-outs measure the machine, and the verdict says so."""
    mine, theirs = configs.get(DEFAULT_POLICY), configs.get(COMPARE_PREFIX + DEFAULT_POLICY)
    if mine is None or theirs is None:
        return None
    allowed = spread_for(spread, workload)
    worse: list[str] = []
    deltas: dict[str, float] = {}
    busiest = max(others_cores(mine), others_cores(theirs))
    envelope = spread.get("max_others_cores")
    unjudged = envelope is not None and busiest > envelope
    for metric in METRICS:
        a, b = metric_value(mine, metric), metric_value(theirs, metric)
        if not (math.isfinite(a) and math.isfinite(b)):
            continue
        measured = allowed.get(metric, 0.0)
        limit = measured * SPREAD_FACTOR if metric in ABSOLUTE else (1 + measured) ** SPREAD_FACTOR - 1
        if metric == "reuse":
            d = deltas[metric] = a - b  # points lost are negative
            if d < -limit:
                worse.append(f"reuse {d * 100:+.1f} pts (spread {measured * 100:.1f}, allowed {limit * 100:.1f})")
        elif metric == "errors":
            d = deltas[metric] = a - b
            if d > limit and not unjudged:
                worse.append(f"errors {a:.0f} vs {b:.0f} (spread {measured:.0f}, allowed {limit:.0f})")
        else:
            d = deltas[metric] = a / b - 1 if b else math.nan
            if d > limit and not unjudged:
                worse.append(f"{metric_label(metric)} {d:+.0%} (spread {measured:.0%}, allowed {limit:.0%})")
    note = (f"only reuse judged: other jobs took {busiest:.1f} cores, more than in any of the spread's runs "
            f"({envelope:.2f}); rerun on a quieter machine" if unjudged else None)
    return {"regression": bool(worse), "worse": worse, "deltas": deltas, "spread": allowed, "note": note}


def measure_spread(paths: list[Path]) -> dict[str, Any]:
    """Per workload and metric, the largest difference between two runs of the same router: every
    run of the default policy in gate JSONs whose compared checkout is the same code (main against
    itself), so each file holds two samples per workload."""
    samples: dict[str, dict[str, list[float]]] = {}
    busiest: dict[str, float] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        for name, w in doc["workloads"].items():
            for cfg in (DEFAULT_POLICY, COMPARE_PREFIX + DEFAULT_POLICY):
                fig = w["configs"].get(cfg)
                if fig is None:
                    continue
                for metric in METRICS:
                    samples.setdefault(name, {}).setdefault(metric, []).append(metric_value(fig, metric))
                busiest[name] = max(busiest.get(name, 0.0), others_cores(fig))
    workloads: dict[str, dict[str, float]] = {}
    for name, per in samples.items():
        workloads[name] = {}
        for metric, xs in per.items():
            xs = [x for x in xs if math.isfinite(x)]
            if len(xs) < 2:
                continue
            # rounded up: the pair that set a spread must not exceed it
            d = max(xs) - min(xs) if metric in ABSOLUTE else (max(xs) / min(xs) - 1 if min(xs) > 0 else math.inf)
            workloads[name][metric] = math.ceil(d * 1e4 - 1e-6) / 1e4 if math.isfinite(d) else d
    default = {m: max((w[m] for w in workloads.values() if m in w), default=0.0) for m in METRICS}
    # the machine's conditions the spread covers: other jobs took at most this many cores in its runs
    return {"samples_per_workload": {n: len(next(iter(p.values()))) for n, p in samples.items()},
            "max_others_cores": round(max(busiest.values(), default=0.0), 2), "workloads": workloads, "default": default}


