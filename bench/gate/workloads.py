"""The gate's workloads: what each replays, at what load, and its preparation (rows, tokens, the
replicas' time scale, the simulator's requests and figures)."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .settings import SIM_PREFIX, TRACE_MAX_CONTEXT, TTFT_KEYS


@dataclass(frozen=True)
class GateWorkload:
    name: str
    source: str  # "trace", or a bench/chat_workloads.py workload
    requests: int
    load: float  # target share of the fleet's capacity (offered-load estimate under round_robin)
    seed: int = 0
    slow: int = 0  # replicas (the last ones) that run `slow_factor` times slower
    slow_factor: float = 10.0
    trace_start: int = 0
    wall_rate: float | None = None  # requests per wall second, if not the gate's --wall-rate
    note: str = ""


WORKLOADS: dict[str, GateWorkload] = {w.name: w for w in (
    # Its prompts are one ~11k-token user message of new text each: ~30 ms of router CPU (and as
    # much in the replicas) per request, twice the chats'; at the chats' rate other jobs on the
    # machine then queue it into time-outs.
    GateWorkload("trace", "trace", 120, 0.70, trace_start=3500, wall_rate=8.0,
                 note="Mooncake's synthetic trace from row 3,500 (its reuse grows along it), rows over 30k tokens left out"),
    GateWorkload("conversation", "conversation", 200, 0.70,
                 note="long new first turns behind shared system prompts, then short turns; the shape that broke"),
    GateWorkload("sessions", "sessions", 200, 0.70, note="LMCache's multi-round QA as chats"),
    GateWorkload("handbook", "handbook", 200, 0.70, note="one hot shared document, short unique questions"),
    GateWorkload("conversation-90", "conversation", 200, 0.90, note="conversation at 90% of the fleet's capacity"),
    GateWorkload("slow-replica", "sessions", 160, 0.65, slow=1,
                 note="sessions on a fleet whose last replica serves 10x slower (healthy)"),
)}



@dataclass
class Prepared:
    spec: GateWorkload
    kind: str  # "chat" or "mooncake"
    rows: list[dict]
    trace_file: Path
    reuse_file: Path | None  # chat: the rows' prompt and available tokens (the replay need not tokenize)
    sim: Any  # kvroute.bench.sim.PreparedWorkload, arrivals in engine seconds
    cfg: Any  # kvroute.bench.sim.FleetConfig
    engine_rate: float  # requests per engine second
    rate_note: str
    time_scale: float  # wall seconds per engine second of the (fast) replicas
    speedup: float  # the replay's: timestamps (ms) / 1000 / speedup = wall seconds
    wall_rate: float
    prompt_tokens_mean: float

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "requests": len(self.rows), "load": self.spec.load, "seed": self.spec.seed,
                "slow_replicas": self.spec.slow, "slow_factor": self.spec.slow_factor if self.spec.slow else None,
                "engine_rate": round(self.engine_rate, 3), "wall_rate": self.wall_rate,
                "time_scale": round(self.time_scale, 4), "speedup": round(self.speedup, 4), "rate_note": self.rate_note,
                "mean_prompt_tokens": round(self.prompt_tokens_mean), "note": self.spec.note}


def prepare_workload(spec: GateWorkload, args: argparse.Namespace, out_dir: Path, profile: Any) -> Prepared:
    from ..chat_trace import chat_prompt_ids, dump_chat_trace
    from ..chat_workloads import nominal_rate, rows, sim_workload
    from ..replay import chat_available_tokens
    from ..sim import FleetConfig, prepare
    from ..sim_cli import offered_rate, retimed
    from ..workloads import (
        DEFAULT_TRACE,
        Workload,
        load_trace,
        trace_stream,
        trace_unit_rate,
    )

    n = max(4, round(spec.requests * args.requests_scale))
    seed = spec.seed if args.seed is None else args.seed
    reuse_file = None
    if spec.source == "trace":
        kind = "mooncake"
        picked = [{**r, "output_length": min(int(r["output_length"]), args.max_tokens)} for r in load_trace(DEFAULT_TRACE)[spec.trace_start :]
                  if int(r["input_length"]) + int(r["output_length"]) <= TRACE_MAX_CONTEXT][:n]
        nominal = trace_unit_rate(picked)
        workload = Workload(spec.name, list(trace_stream(picked)), nominal)
        trace_file = out_dir / f"{spec.name}.jsonl"
        trace_file.write_text("".join(json.dumps(r) + "\n" for r in picked))
        data = picked
    else:
        kind = "chat"
        data = [{**r, "max_tokens": min(r["max_tokens"], args.max_tokens)} for r in rows(spec.source, seed, n)]
        nominal = nominal_rate(data)
        ids = chat_prompt_ids(data)
        workload = sim_workload(spec.name, data, ids)
        trace_file = dump_chat_trace(data, out_dir / f"{spec.name}.jsonl.gz")
        reuse_file = out_dir / f"{spec.name}.available.json"
        bs = profile.block_size
        avail = chat_available_tokens(ids, bs)
        reuse_file.write_text(json.dumps({"prompt_tokens": [len(x) for x in ids], "available_tokens": avail.tolist(),
                                          "block_size": bs}))
    prepared = prepare(workload, profile.block_size)
    wall_rate = (spec.wall_rate or args.wall_rate) if args.wall_rate_given is None else args.wall_rate_given
    slow = (1.0,) * (args.replicas - spec.slow) + (spec.slow_factor,) * spec.slow
    cfg = FleetConfig(replicas=args.replicas, profile=profile, slowdown=slow)
    engine_rate, note = offered_rate(prepared, profile, cfg, spec.load, seed)
    return Prepared(
        spec=spec, kind=kind, rows=data, trace_file=trace_file, reuse_file=reuse_file, sim=retimed(prepared, nominal / engine_rate), cfg=cfg,
        engine_rate=engine_rate, rate_note=note, time_scale=engine_rate / wall_rate, speedup=wall_rate / nominal,
        wall_rate=wall_rate, prompt_tokens_mean=float(prepared.prompt_tokens.mean()),
    )


def simulate(prep: Prepared, policies: list[str]) -> dict[str, dict[str, Any]]:
    """The simulator's figures for the same requests (engine time scaled to wall time)."""
    from kvroute.router.placement.policy import make_policy

    from ..limit import fleet_limit, percentiles
    from ..sim import simulate_policy

    out: dict[str, dict[str, Any]] = {}
    limits = []
    for policy in policies:
        t0 = time.perf_counter()
        run = simulate_policy(prep.sim, make_policy(policy, seed=prep.spec.seed), prep.cfg)
        m = run.metrics()
        ts = prep.time_scale
        figures = {
            "requests": len(prep.rows), "answered": int(m["requests"]), "errors": int(run.too_long),
            **{k: m[k] * ts for k in TTFT_KEYS},
            "reuse_available": m["reuse_available"], "reuse_delivered": m["reuse_delivered"],
            "delivered_share_of_available": m["reuse_delivered"] / m["reuse_available"] if m["reuse_available"] else math.nan,
            "imbalance": m["imbalance"], "sim_wall_s": round(time.perf_counter() - t0, 2),
        }
        if prep.spec.slow:
            counts = np.bincount(run.replica[run.replica >= 0], minlength=prep.cfg.replicas)
            figures["slow_share"] = float(counts[-prep.spec.slow :].sum() / max(1, counts.sum()))
        out[SIM_PREFIX + policy] = figures
        limits.append(run.limit_ttft)
    per_request = fleet_limit(limits)
    limit = {k: v * prep.time_scale for k, v in percentiles(per_request[~np.isnan(per_request)]).items()}
    for figures in out.values():
        figures["limit"] = limit
        figures["ttft_vs_limit"] = {k: figures[k] / limit[k] if limit[k] else math.nan for k in TTFT_KEYS}
    return out


