"""One gate run's processes: the emulated fleet, a router (this checkout's or another's), the
replay, and the figures each gives."""

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

from .settings import MAX_MODEL_LEN, MODEL, READY_TIMEOUT_S, REPO, TTFT_KEYS
from .workloads import Prepared


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

    from ..demo import parse_metrics
    from ..demo_fleet import wait_ready

    loop = asyncio.get_running_loop()
    await wait_ready(url, timeout_s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
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

    from ..demo import parse_metrics

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
    from ..limit import percentiles

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


