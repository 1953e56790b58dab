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
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = "gate"
DEFAULT_POLICY = "cost_model"
POLICIES = ("cost_model", "sglang_cache_aware", "round_robin")
REPLICAS = 8
WALL_RATE = 14.0  # requests per wall second, every workload
REQUEST_TIMEOUT_S = 20.0  # a request not answered within this (wall) fails: the user gave up
# Every output token is one SSE event through three Python processes (replica, router, client):
# ~60 us each in the router and the replicas here, the gate's largest CPU cost.  Outputs are capped
# (live and simulated alike); the cap is part of each workload's load calibration.
MAX_TOKENS = 128
SPREAD_FILE = Path(__file__).resolve().parent / "gate_spread.json"
# A few runs underestimate the range of a new pair's difference (four normal samples span ~2
# standard deviations; a difference of two new ones has 1.4): the verdict allows twice the
# measured spread (its square for ratios), ~4 standard deviations of the difference.
SPREAD_FACTOR = 2.0
COMPARE_PREFIX = "compare:"
SIM_PREFIX = "sim:"
TRACE_MAX_CONTEXT = 30_000  # Mooncake rows longer than this (input + output) are left out (router and replica CPU)
# The replicas serve a 128k context (Llama 3.1's; their KV cache holds 444k tokens).  Every prompt
# of the workloads fits 32k; the context matters to how a router bounds a prompt's length before
# it has counted its tokens (docs/routing-gate.md).
MAX_MODEL_LEN = 131_072
READY_TIMEOUT_S = 60.0
TTFT_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")


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


# --- preparing a workload: rows, tokens, calibration, the simulator's requests ----------------


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
    from .chat_trace import chat_prompt_ids, dump_chat_trace
    from .chat_workloads import nominal_rate, rows, sim_workload
    from .replay import chat_available_tokens
    from .sim import FleetConfig, prepare
    from .sim_cli import offered_rate, retimed
    from .workloads import DEFAULT_TRACE, Workload, load_trace, trace_stream, trace_unit_rate

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

    from .limit import fleet_limit, percentiles
    from .sim import simulate_policy

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


# --- processes: the fleet, routers, the replay ------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a live process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


async def stop_process(proc: asyncio.subprocess.Process, grace_s: float = 15.0) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class FleetProcess:
    """`python -m kvroute.replica.emulated.fleet` in a child process: N replicas, reset between runs."""

    def __init__(self, replicas: int, time_scale: float, slow: int, slow_factor: float, log: Path):
        self.args = ["--replicas", str(replicas), "--time-scale", repr(time_scale), "--slow", str(slow),
                     "--slow-factor", repr(slow_factor), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    async def start(self) -> None:
        with open(self.log, "ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvroute.replica.emulated.fleet", *self.args, cwd=str(REPO),
                stdout=asyncio.subprocess.PIPE, stderr=err)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if not line:
            await self.proc.wait()
            raise RuntimeError(f"the replica fleet did not start (exit {self.proc.returncode}); see {self.log}")
        self.info = json.loads(line)

    @property
    def entries(self) -> list[dict[str, str]]:
        return [{k: r[k] for k in ("url", "events_endpoint", "replay_endpoint")} for r in self.info["replicas"]]

    async def reset(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.post(self.info["control"] + "/reset", json={"timeout_s": 90}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"fleet reset failed: HTTP {resp.status}: {await resp.text()}")

    async def engine_ttfts(self) -> list[list[float]]:
        """Per replica, the engines' own TTFTs since the last reset (wall-equivalent seconds)."""
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(self.info["control"] + "/ttfts") as resp:
                return (await resp.json())["ttfts"]

    def cpu(self) -> float | None:
        return cpu_seconds(self.proc.pid) if self.proc else None

    async def stop(self) -> None:
        if self.proc is not None:
            await stop_process(self.proc)


def ensure_checkout(path: Path) -> Path:
    """A checkout's `kvroute` (its own virtualenv; `make install` there if it has none)."""
    exe = path / ".venv" / "bin" / "kvroute"
    if not exe.exists():
        print(f"routing gate: {path} has no .venv: make -C {path} install", file=sys.stderr)
        subprocess.run(["make", "-C", str(path), "install"], check=True)
    if not exe.exists():
        raise SystemExit(f"routing gate: no {exe} after make install")
    return exe


def router_command(checkout: Path | None) -> tuple[list[str], Path]:
    """How to start a router of ``checkout`` (None: this one), and its working directory."""
    if checkout is None or checkout == REPO:
        return [sys.executable, "-m", "kvroute.cli", "router"], REPO
    return [str(ensure_checkout(checkout)), "router"], checkout


async def router_ready(url: str, replicas: int, timeout_s: float) -> None:
    """/ready answers 200, then (where the router exports them) every replica healthy and its KV
    events followed, so that the first requests see the whole fleet."""
    import aiohttp

    from .demo import parse_metrics

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while True:
            try:
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        break
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = repr(exc)
            if loop.time() > deadline:
                raise TimeoutError(f"router at {url} not ready in {timeout_s:g} s ({last})")
            await asyncio.sleep(0.1)
        settle = loop.time() + 10.0
        while loop.time() < settle:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(url + "/metrics") as resp:
                    samples = parse_metrics(await resp.text())
                healthy = sum(v for (n, _), v in samples.items() if n == "kvroute_replica_healthy")
                following = sum(v for (n, lab), v in samples.items()
                                if n == "kvroute_replica_kv_events_state" and dict(lab).get("state") == "following")
                if healthy >= replicas and following >= replicas:
                    return
            await asyncio.sleep(0.1)


async def router_figures(url: str) -> dict[str, Any]:
    """What the router counted: answered requests per replica, routing decisions by reason."""
    import aiohttp

    from .demo import parse_metrics

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(url + "/metrics") as resp:
            samples = parse_metrics(await resp.text())
    per_replica: dict[str, int] = {}
    routed: dict[str, int] = {}
    decisions: dict[str, int] = {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "kvroute_requests_total" and lab.get("model") == MODEL:
            replica = lab.get("replica", "?")
            routed[replica] = routed.get(replica, 0) + int(value)  # answered, failed, given up (499)
            if lab.get("status", "").startswith("2"):
                per_replica[replica] = per_replica.get(replica, 0) + int(value)
        elif name == "kvroute_routing_decisions_total" and value:
            decisions[lab.get("reason", "?")] = decisions.get(lab.get("reason", "?"), 0) + int(value)
    return {"requests_per_replica": per_replica, "routed_per_replica": routed, "decisions": decisions}


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine (Linux /proc/stat), None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def engine_figures(per_replica: list[list[float]], limit: dict[str, float] | None) -> dict[str, Any]:
    """TTFT percentiles as the engines saw them (submission to first token, no HTTP, router or
    client time): the routing's effect without this machine's CPU noise."""
    from .limit import percentiles

    ttfts = np.array([t for ts in per_replica for t in ts])
    out: dict[str, Any] = {**percentiles(ttfts), "first_tokens": int(ttfts.size)}
    if limit:
        out["ttft_vs_limit"] = {k: out[k] / limit[k] if limit[k] else math.nan for k in TTFT_KEYS}
    return out


@dataclass
class Config:
    name: str  # the row's name: policy, or compare:policy
    policy: str
    checkout: Path | None  # None: the checkout under test is this one


async def run_config(prep: Prepared, config: Config, fleet: FleetProcess, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One run: a fresh router of ``config``, the workload replayed through it, the fleet reset after."""
    cmd, cwd = router_command(config.checkout)
    cfg_file = logs / f"{prep.spec.name}.router.json"
    cfg_file.write_text(json.dumps({"replicas": fleet.entries}))
    tag = f"{prep.spec.name}.{config.name.replace(':', '-')}"
    started = time.perf_counter()
    router = None
    for attempt in range(3):  # a port picked free can be taken before the router binds it
        port = free_port()
        with open(logs / f"{tag}.router.log", "ab") as log:
            router = await asyncio.create_subprocess_exec(
                *cmd, "--config", str(cfg_file), "--policy", config.policy, "--tokenizer", str(args.tokenizer),
                "--port", str(port), "--host", "127.0.0.1", cwd=str(cwd), stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            await router_ready(url, args.replicas, READY_TIMEOUT_S)
            break
        except TimeoutError:
            await stop_process(router, 5)
            if attempt == 2:
                raise
    assert router is not None
    phases = {"ready_s": round(time.perf_counter() - started, 2)}
    router_cpu0 = cpu_seconds(router.pid)
    try:
        fleet_cpu0 = fleet.cpu()
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        jiffies0, t_replay = cpu_jiffies(), time.perf_counter()
        replay_cmd = [sys.executable, "-m", "kvroute.cli", "bench", "replay",
                      "--chat-trace" if prep.kind == "chat" else "--trace", str(prep.trace_file),
                      "--url", url, "--speedup", repr(prep.speedup), "--profile", args.profile.name,
                      "--replica-time-scale", repr(prep.time_scale), "--request-timeout", repr(args.request_timeout), "--json"]
        if args.records:
            replay_cmd.append("--records")
        if prep.reuse_file is not None:
            replay_cmd += ["--available", str(prep.reuse_file)]
        with open(logs / f"{tag}.replay.log", "ab") as log:
            replay = await asyncio.create_subprocess_exec(*replay_cmd, cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=log)
            try:
                out, _ = await replay.communicate()
            finally:
                await stop_process(replay, 5)  # a cancelled gate (Ctrl-C, SIGTERM) leaves nothing running
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        jiffies1, replay_wall = cpu_jiffies(), time.perf_counter() - t_replay
        phases["replay_s"] = round(time.perf_counter() - started - phases["ready_s"], 2)
        if replay.returncode not in (0, 1) or not out.strip():
            raise RuntimeError(f"replay failed (exit {replay.returncode}); see {logs / (tag + '.replay.log')}")
        figures = json.loads(out)
        router_cpu1 = cpu_seconds(router.pid)
        figures["cpu_s"] = {
            # from ready (its start-up, imports and tokenizer load, left out) to the replay's end
            "router": None if router_cpu0 is None or router_cpu1 is None else round(router_cpu1 - router_cpu0, 2),
            "router_startup": router_cpu0,
            "replicas": None if fleet_cpu0 is None or fleet.cpu() is None else round(fleet.cpu() - fleet_cpu0, 2),  # type: ignore[operator]
            "client": round(usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime, 2),
        }
        ours = [figures["cpu_s"][k] for k in ("router", "replicas", "client")]
        if jiffies0 is not None and jiffies1 is not None and None not in ours:
            busy = (jiffies1[0] - jiffies0[0]) / os.sysconf("SC_CLK_TCK")
            # What the rest of the machine (other jobs) took meanwhile, in cores: noise, not routing.
            figures["cpu_s"]["others_cores"] = round(max(0.0, busy - sum(ours)) / replay_wall, 2)
            figures["cpu_s"]["machine_cores"] = os.cpu_count()
        with contextlib.suppress(Exception):
            figures.update(await router_figures(url))
        figures["engine"] = engine_figures(await fleet.engine_ttfts(), figures.get("limit"))
        if prep.spec.slow:
            slow_urls = [r["url"] for r in fleet.info["replicas"][-prep.spec.slow :]]
            per = figures.get("routed_per_replica") or {}
            total = sum(per.values())
            figures["slow_share"] = sum(v for k, v in per.items() if k in slow_urls) / total if total else None
    finally:
        t_stop = time.perf_counter()
        await stop_process(router)
        phases["router_stop_s"] = round(time.perf_counter() - t_stop, 2)
    t_reset = time.perf_counter()
    await fleet.reset()
    phases["reset_s"] = round(time.perf_counter() - t_reset, 2)
    figures["phases"] = phases
    figures["run_wall_s"] = round(time.perf_counter() - started, 2)
    return figures


# --- verdicts ---------------------------------------------------------------------------------


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


# --- output -----------------------------------------------------------------------------------


def fmt_ms(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def print_workload(name: str, w: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from .report import pct

    info = w["workload"]
    slow = f", replica {info['slow_factor']:g}x slower" if info.get("slow_replicas") else ""
    table = Table(title=f"{name}: {info['requests']} requests, {info['load']:.0%} load{slow}, replicas' time scale "
                  f"{info['time_scale']:.2f}, {info['wall_rate']:g} req/s", title_justify="left")
    for col in ("config", "available", "delivered", "deliv/avail", "TTFT p50", "TTFT p90", "TTFT p99",
                "engine p50/p90/p99", "errors", "note"):
        table.add_column(col, justify="left" if col in ("config", "note") else "right")
    limit = w.get("limit") or {}
    if limit:
        table.add_row("[i]physical limit[/]", "", "", "", *(fmt_ms(limit[k]) for k in TTFT_KEYS), "", "", "",
                      end_section=True)

    def mult(x: float | None, k: str) -> str:
        return f"{x / limit[k]:.2f}x" if x is not None and limit.get(k) and math.isfinite(x) else "-"

    live = list(w["configs"].items())
    for i, (cfg, fig) in enumerate([*live, *w.get("sim", {}).items()]):
        sim = cfg.startswith(SIM_PREFIX)
        client = ["" if sim else f"{mult(fig.get(k), k)} {fmt_ms(fig.get(k))}" for k in TTFT_KEYS]
        engine = fig if sim else (fig.get("engine") or {})
        notes = []
        if fig.get("slow_share") is not None:
            notes.append(f"slow replica {fig['slow_share']:.0%} of requests")
        cpu = fig.get("cpu_s") or {}
        if cpu.get("router") is not None:
            notes.append(f"router {cpu['router']:.1f} s")
        if cpu.get("others_cores") is not None:
            notes.append(f"others {cpu['others_cores']:.1f}")
        table.add_row(cfg, pct(fig.get("reuse_available", math.nan)), pct(fig.get("reuse_delivered", math.nan)),
                      pct(fig.get("delivered_share_of_available", math.nan)), *client,
                      " / ".join(mult(engine.get(k), k) for k in TTFT_KEYS), str(fig.get("errors", 0)),
                      ", ".join(notes), end_section=i == len(live) - 1)
    table.caption = ("TTFT: at the client, as a multiple of the physical limit's percentile (each request alone on an idle "
                     "replica, one infinite shared cache), then wall ms.  engine: the replicas' own TTFT (submission to first "
                     "token: no HTTP, router or client time, so little of this machine's noise), as multiples.  sim: the "
                     "simulator on the same requests (engine time x time scale).  note: the slow replica's share of the requests, the "
                     "router's CPU seconds during the replay, the cores other jobs on the machine took meanwhile.")
    table.caption_justify = "left"
    console.print(table)
    v = w.get("verdict")
    if v is not None:
        deltas = ", ".join(f"reuse {d * 100:+.1f} pts" if m == "reuse" else f"errors {d:+.0f}" if m == "errors"
                           else f"{metric_label(m)} {d:+.0%}" for m, d in v["deltas"].items())
        if v["regression"]:
            console.print(f"[bold red]REGRESSION[/] {name}: {DEFAULT_POLICY} vs {COMPARE_PREFIX}{DEFAULT_POLICY}: "
                          f"{'; '.join(v['worse'])}  ({deltas})")
        else:
            console.print(f"[green]OK[/] {name}: {DEFAULT_POLICY} vs {COMPARE_PREFIX}{DEFAULT_POLICY} within the "
                          f"run-to-run spread ({deltas})")
        if v.get("note"):
            console.print(f"   [yellow]{v['note']}[/]")


# --- the run ----------------------------------------------------------------------------------


def configs_of(args: argparse.Namespace) -> list[Config]:
    out = [Config(p, p, args.checkout) for p in args.policies]
    if args.compare is not None:
        out.append(Config(COMPARE_PREFIX + DEFAULT_POLICY, DEFAULT_POLICY, args.compare))
    return out


async def run_gate(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    err = Console(stderr=True)
    out_dir = Path(args.out)
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
