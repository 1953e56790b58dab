"""Dashboards and alerts against a real Prometheus scraping real routers and emulated replicas.

One fleet for the module, on loopback:

- router A (``kvroute router`` process, cost_model, the shared Redis under a test key prefix) in
  front of 3 emulated replicas of ``tiny`` and one of ``quiet`` (found through their Redis
  registrations, which carry their KV-event endpoints), 3 of ``hot``, one replica of ``broken``
  that answers every generation with a 500 and whose registered KV-event endpoint is a publisher
  that skips sequence numbers, and one of ``lagging`` (no request goes there) whose publisher
  stamps its batches 30 s in the past;
- router B (``kvroute router`` process, round_robin, a Redis URL where nothing listens) in front of
  6 emulated replicas of ``tiny-rr``;
- router C (round_robin, no Redis) in front of one emulated replica of ``solo``, also watching
  Kubernetes pods through a kubeconfig whose API server refuses connections;
- Prometheus (Debian's ``prometheus``) scraping the routers and the emulated replicas each
  second, with ``deploy/prometheus/alerts.yml`` loaded (its windows shortened to seconds and its
  ``for`` durations to zero, so the alerts can fire within the test; thresholds unchanged);
- load from the official ``openai`` client: multi-turn sessions on ``tiny`` (A) and ``tiny-rr``
  (B), one repeated long prompt on ``hot``, requests for ``broken`` and ``quiet``, and prompts that
  start with a timestamp before a long shared document (cache-hostile) from one client.

Each alert is made to fire by the condition it names: round-robin routing of sessions leaves
delivered reuse far below available (``tiny-rr``), routing a hot prefix to its holder concentrates
``hot`` on one replica, router B's Redis is unreachable (a warning), so is router C's Kubernetes
API, ``broken`` answers 5xx and its breaker keeps opening, its KV-event stream has gaps,
``lagging``'s events arrive late; the last tests stop ``quiet``'s publisher (stream down), kill
``solo`` (no healthy replica) and stop router C (target down).  Where a condition is absent, its
alert must stay silent.
Every dashboard query is evaluated with Grafana's "All" for each variable, and with each of
``$namespace``, ``$job``, ``$replica`` set to a value nothing has (every query then comes back empty).

The replicas and the load run on an event loop in a background thread, so the fleet keeps running
between the (synchronous) tests; routers and Prometheus are child processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import REDIS_URL, delete_keys, free_port, require_redis

REPO = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = REPO / "tests" / "assets" / "tiny-tokenizer"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))

WINDOW = "10s"  # replaces the rules' minute windows and Grafana's $__rate_interval (1 s scrapes)
# Grafana's "All" of each template variable is the regex .*
VARIABLES = {"$__rate_interval": WINDOW, "$__interval": "2s", "$__range": "60s", "$model": ".*", "$replica": ".*",
             "$job": ".*", "$namespace": ".*"}
SELECTIONS = ("$namespace", "$job", "$replica")  # every query honours each
TIME_SCALE = 0.1  # emulated engines run 10x faster than the profile (an H100 serving an 8B model)
ALERT_TIMEOUT_S = 60.0
# the alerts of deploy/prometheus/alerts.yml, each made to fire by its condition below
EXPECTED_ALERTS = ("KvrouteDeliveredReuseLow", "KvrouteReplicaShareHigh", "KvrouteRedisErrors", "KvrouteRouter5xx",
                   "KvrouteKvEventGaps", "KvrouteIndexRebuilt", "KvrouteNoHealthyReplica", "KvrouteRouterTargetDown",
                   "KvrouteBreakerOpen", "KvrouteKvEventStreamDown", "KvrouteKvEventLagHigh",
                   "KvrouteDiscoveryErrors", "KvrouteRegistrationRejected", "KvrouteTtftBudgetBurn",
                   "KvrouteShedding", "KvrouteClientConnectionsRefused",
                   "KvrouteClientConnectionsEvicted", "KvrouteReplicaAuthRefused")
# the TTFT objective the live rules get (the chart's alerts.ttftObjectiveSeconds writes one so): the
# smallest bucket bound, which the streams through a router here miss (deploy/prometheus/alerts.yml)
TTFT_OBJECTIVE = 'le="0.005"'
SHIPPED_TTFT_OBJECTIVE = 'le="2.5"'
# alerts this fleet does not provoke (tests/test_alert_rules.py fires them from synthetic series):
# the connection cap and a replica refusing the router's key need a router at its open-file limit
# and a misconfigured key (test_router_connections.py and test_router_auth.py show the counters move); their recorded
# quantities are checked here where their series exist at zero
NOT_PROVOKED_HERE = {"KvrouteClientConnectionsRefused", "KvrouteClientConnectionsEvicted",
                     "KvrouteReplicaAuthRefused"}
NO_SERIES_AT_ZERO = {"KvrouteReplicaAuthRefused"}  # a replica's series appears with its first refusal
RUNBOOK = REPO / "docs" / "runbook.md"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is required for the observability tests and is not installed: run `make deps-observe` "
                    "(apt-get install -y prometheus, which also brings promtool)", pytrace=False)
    return path


# ---------------------------------------------------------------------------------------------
# Prometheus: rules, config, process, HTTP API


def shortened_rules(text: str, window: str = WINDOW) -> dict[str, Any]:
    """The rule file with every range window set to ``window`` and every ``for`` to 0s: the same
    expressions and thresholds, on a time scale a test can wait for."""
    rules = yaml.safe_load(text)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = re.sub(r"\[\d+[smhd]\]", f"[{window}]", rule["expr"])
            if "for" in rule:
                rule["for"] = "0s"
    return rules


def label(url: str) -> str:
    """The ``replica`` label of a replica listed by URL alone: its host:port (router/fleet/discovery/labels.py)."""
    return urllib.parse.urlsplit(url).netloc


def prometheus_config(routers: list[str], replicas: list[str], rule_file: Path) -> dict[str, Any]:
    def hostport(url: str) -> str:
        return urllib.parse.urlsplit(url).netloc

    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(rule_file)],
        "scrape_configs": [
            {"job_name": "kvroute", "static_configs": [{"targets": [hostport(u) for u in routers]}]},
            {"job_name": "vllm", "static_configs": [{"targets": [hostport(u) for u in replicas]}]},
        ],
    }


class Prometheus:
    def __init__(self, workdir: Path, config: dict[str, Any]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.command = [
            _binary("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ]
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus did not become ready in 30 s")
            time.sleep(0.2)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=str(start), end=str(end), step=step)["result"]

    def firing(self) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == "firing"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# Routers: `kvroute router` processes


class RouterProcess:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, cwd=str(REPO), text=True, env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"router {name} did not start ({line!r}): {log_path.read_text()[-2000:]}")
        self.url = line.rsplit(" ", 1)[-1].strip()
        self.instance = urllib.parse.urlsplit(self.url).netloc  # Prometheus's `instance` label

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.2)
        raise RuntimeError(f"router {self.name} not ready: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# Replicas and load, on an event loop in a background thread


class LoopThread:
    """An asyncio loop running in its own thread, so servers keep serving between tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="observe-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def failing_replica(model: str) -> tuple[Any, str]:
    """A replica whose health is fine and whose every generation fails with a 500 (an engine that
    crashes on each request): the router's retries run out and it answers 5xx."""
    from aiohttp import web

    async def fail(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"error": {"message": "engine failure", "type": "InternalServerError", "param": None, "code": 500}},
            status=500)

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "test", "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/chat/completions", fail)
    app.router.add_post("/v1/completions", fail)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud paper lamp "
         "garden window market silver orange purple yellow copper marble forest desert ocean valley").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Load:
    """Request loops through the routers until ``stop``; counts outcomes per loop."""

    router_a: str
    router_b: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def _count(self, name: str, ok: bool) -> None:
        book = self.counts if ok else self.errors
        book[name] = book.get(name, 0) + 1

    async def _chat(self, client: Any, name: str, **kwargs: Any) -> str:
        import openai

        try:
            if kwargs.get("stream"):
                text = []
                async for chunk in await client.chat.completions.create(**kwargs):
                    if chunk.choices and chunk.choices[0].delta.content:
                        text.append(chunk.choices[0].delta.content)
                answer = "".join(text)
            else:
                resp = await client.chat.completions.create(**kwargs)
                answer = resp.choices[0].message.content or ""
        except openai.APIStatusError:
            self._count(name, False)
            return ""
        self._count(name, True)
        return answer

    async def sessions(self, client: Any, name: str, model: str, seed: int, *, turns: int = 8,
                       system_words: int = 250, user_words: int = 20) -> None:
        """Multi-turn chats: each turn resends the conversation so far plus a new message."""
        rng = random.Random(seed)
        while not self.stop.is_set():
            sid = uuid.uuid4().hex
            messages = [{"role": "system", "content": f"Session {sid}. " + words(rng, system_words)}]
            for turn in range(turns):
                if self.stop.is_set():
                    return
                messages.append({"role": "user", "content": words(rng, user_words)})
                answer = await self._chat(client, name, model=model, messages=messages, max_tokens=4,
                                          stream=turn % 2 == 1, extra_headers={"X-Session-ID": sid})
                messages.append({"role": "assistant", "content": answer})

    async def hot_prompt(self, client: Any) -> None:
        """One long prompt again and again (a shared document): its holder answers fastest."""
        rng = random.Random(7)
        doc = words(rng, 400)
        while not self.stop.is_set():
            await self._chat(client, "hot", model="hot", max_tokens=2,
                             messages=[{"role": "system", "content": doc}, {"role": "user", "content": "Summarize."}])
            await asyncio.sleep(0.02)

    async def broken(self, client: Any) -> None:
        while not self.stop.is_set():
            await self._chat(client, "broken", model="broken", max_tokens=2,
                             messages=[{"role": "user", "content": "Hello?"}])
            await asyncio.sleep(0.1)

    async def quiet(self, client: Any) -> None:
        """New prompts for `quiet`, whose replica publishes KV events until a test stops them."""
        rng = random.Random(13)
        while not self.stop.is_set():
            await self._chat(client, "quiet", model="quiet", max_tokens=2,
                             messages=[{"role": "user", "content": words(rng, 60)}])
            await asyncio.sleep(0.2)

    async def hostile(self, client: Any) -> None:
        """A timestamp before a long shared document: no prefix cache can reuse it."""
        rng = random.Random(11)
        doc = words(rng, 300)
        while not self.stop.is_set():
            await self._chat(client, "hostile", model="tiny", max_tokens=2, user="hostile-app",
                             messages=[{"role": "system", "content": f"Now: {time.time_ns()}. {doc}"},
                                       {"role": "user", "content": "What changed?"}])
            await asyncio.sleep(0.3)

    async def run(self, *also: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
        import openai

        a = openai.AsyncOpenAI(base_url=self.router_a + "/v1", api_key="unused", max_retries=0, timeout=30)
        b = openai.AsyncOpenAI(base_url=self.router_b + "/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            await asyncio.gather(
                *(self.sessions(a, "tiny", "tiny", seed) for seed in range(3)),
                # one session at a time over 6 replicas: round-robin sends each turn to another
                # replica, and a turn finds its earlier turns only 6 turns later
                self.sessions(b, "tiny-rr", "tiny-rr", 100, turns=8, system_words=10, user_words=60),
                self.hot_prompt(a), self.broken(a), self.hostile(a), self.quiet(a),
                *(task(self.stop) for task in also),
            )
        finally:
            await a.close()
            await b.close()


# ---------------------------------------------------------------------------------------------
# KV events: registrations in Redis (where routers learn event endpoints) and a lossy publisher


async def register_replicas(prefix: str, records: list[Any]) -> None:
    import redis.asyncio as aioredis

    from kvroute.common.registration import register

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for record in records:
            await register(client, prefix, record, ttl=600)  # outlives the module: no heartbeat needed
    finally:
        await client.aclose()


class StubPublisher:
    """A KV-event publisher of empty batches in vLLM's frames (topic, seq, msgpack EventBatch).
    With ``skip_every``, every ``skip_every``-th sequence number is never sent, as a PUB socket past
    its high-water mark drops them (a gap is a property of the sequence alone); with ``late_s``,
    each batch's engine timestamp is that far in the past (a stream that lags, or a replica
    whose clock runs behind)."""

    def __init__(self, skip_every: int = 0, late_s: float = 0.0, interval_s: float = 0.2):
        import zmq
        import zmq.asyncio

        self.skip_every = skip_every
        self.late_s = late_s
        self.interval_s = interval_s
        self.socket = zmq.asyncio.Context.instance().socket(zmq.PUB)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sent = self.skipped = 0

    async def run(self, stop: asyncio.Event) -> None:
        import msgspec

        seq = 0
        try:
            while not stop.is_set():
                if self.skip_every and seq % self.skip_every == self.skip_every - 1:
                    self.skipped += 1
                else:
                    payload = msgspec.msgpack.encode([time.time() - self.late_s, [], 0])
                    await self.socket.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
                    self.sent += 1
                seq += 1
                await asyncio.sleep(self.interval_s)
        finally:
            self.socket.close(linger=0)


# ---------------------------------------------------------------------------------------------
# The fleet


@dataclass
class Fleet:
    prometheus: Prometheus
    router_a: RouterProcess
    router_b: RouterProcess
    load: Load
    replicas: dict[str, list[str]]
    started_at: float
    gaps: StubPublisher
    redis_prefix: str  # router A's index keys
    late: StubPublisher  # the `lagging` replica's events, stamped 30 s in the past
    router_c: RouterProcess  # in front of `solo` alone
    emulated: dict[str, Any]  # model -> its EmulatedReplica (quiet, solo)
    loop: LoopThread
    summary: dict[str, Any] = field(default_factory=dict)


async def _start_replicas(groups: dict[str, int], with_events: set[str]) -> tuple[list[Any], dict[str, list[str]]]:
    from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig

    started: list[Any] = []
    urls: dict[str, list[str]] = {}
    for model, n in groups.items():
        events = {"events_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"} if model in with_events else {}
        for _ in range(n):
            rep = EmulatedReplica(ReplicaConfig(model=model, tokenizer_dir=str(TINY_TOKENIZER), time_scale=TIME_SCALE,
                                                **events))
            await rep.start()
            started.append(rep)
            urls.setdefault(model, []).append(rep.url)
    return started, urls


async def _stop_all(replicas: list[Any], runners: list[Any]) -> None:
    for rep in replicas:
        with contextlib.suppress(Exception):  # a test may have stopped it already
            await rep.stop()
    for runner in runners:
        await runner.cleanup()


async def _make_publisher(**kwargs: Any) -> StubPublisher:
    return StubPublisher(**kwargs)  # its socket belongs to the loop thread


def refused_kubeconfig(workdir: Path) -> Path:
    """A kubeconfig (JSON is YAML) whose API server is a free loopback port nobody listens on."""
    path = workdir / "kubeconfig-refused"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "refused",
        "clusters": [{"name": "refused", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "router", "user": {"token": "unused"}}],
        "contexts": [{"name": "refused", "context": {"cluster": "refused", "user": "router", "namespace": "llm"}}],
    }))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    _binary("prometheus")
    require_redis()
    workdir = tmp_path_factory.mktemp("observe")
    prefix = f"kvroute-test-{uuid.uuid4().hex[:12]}"
    loop = LoopThread()
    replicas, runners, routers, prom, load_future, load = [], [], [], None, None, None
    try:
        replicas, urls = loop.run(_start_replicas({"tiny": 3, "hot": 3, "tiny-rr": 6, "quiet": 1, "solo": 1},
                                                  with_events={"tiny", "quiet"}))
        emulated = {rep.model: rep for rep in replicas if rep.model in ("quiet", "solo")}
        for model in ("broken", "lagging"):
            runner, url = loop.run(failing_replica(model))
            runners.append(runner)
            urls[model] = [url]
        gaps = loop.run(_make_publisher(skip_every=5))
        late = loop.run(_make_publisher(late_s=30.0))
        # Router A learns the `tiny` and `quiet` replicas and their KV-event endpoints from Redis,
        # as a launcher registers them; the events of `broken` come from the lossy publisher, those
        # of `lagging` (a healthy replica no request is sent to) from the late one.
        from kvroute.common.registration import ReplicaRecord

        records = [ReplicaRecord(url=rep.url, model=rep.model, events_endpoint=rep.events_endpoint,
                                 replay_endpoint=rep.replay_endpoint, block_size=rep.block_size, engine="emulated")
                   for rep in replicas if rep.model in ("tiny", "quiet")]
        records.append(ReplicaRecord(url=urls["broken"][0], model="broken", events_endpoint=gaps.endpoint,
                                     engine="emulated"))
        records.append(ReplicaRecord(url=urls["lagging"][0], model="lagging", events_endpoint=late.endpoint,
                                     engine="emulated"))
        loop.run(register_replicas(prefix, records))
        common = ["--tokenizer", str(TINY_TOKENIZER), "--fleet.health-interval-s", "1", "--fleet.metrics-interval-s", "1",
                  "--log-level", "warning"]
        dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: every index call fails
        router_a = RouterProcess("A", [*common, "--policy", "cost_model", "--redis-url", REDIS_URL,
                                       "--redis-key-prefix", prefix, "--fleet.discovery-redis",
                                       "--replicas", ",".join(urls["hot"] + urls["broken"])],
                                 workdir / "router-a.log")
        routers.append(router_a)
        router_b = RouterProcess("B", [*common, "--policy", "round_robin", "--redis-url", dead_redis,
                                       "--index-timeout-s", "0.05", "--replicas", ",".join(urls["tiny-rr"])],
                                 workdir / "router-b.log")
        routers.append(router_b)
        # router C fronts `solo` alone: the replica dies in one test, the router in another; it also
        # watches Kubernetes pods, through an API server that refuses connections (discovery errors)
        router_c = RouterProcess("C", [*common, "--policy", "round_robin", "--replicas", urls["solo"][0], "--max-in-flight", "1",
                                       "--max-queue-wait-s", "0",
                                       "--fleet.k8s-selector", "app=vllm", "--fleet.discovery-timeout-s", "0.5"],
                                 workdir / "router-c.log", env={"KUBECONFIG": str(refused_kubeconfig(workdir))})
        routers.append(router_c)
        for r in routers:
            r.wait_ready()
        rule_file = workdir / "alerts.yml"
        rules = ALERTS.read_text().replace(SHIPPED_TTFT_OBJECTIVE, TTFT_OBJECTIVE)
        rule_file.write_text(yaml.safe_dump(shortened_rules(rules), sort_keys=False))
        engines = [u for model in ("tiny", "hot", "tiny-rr") for u in urls[model]]
        prom = Prometheus(workdir, prometheus_config([r.url for r in routers], engines, rule_file))
        print(f"\nprometheus: {' '.join(prom.command)}\n"
              f"router A: {router_a.url}  router B: {router_b.url}  router C: {router_c.url}")
        load = Load(router_a.url, router_b.url)
        load_future = asyncio.run_coroutine_threadsafe(load.run(gaps.run, late.run), loop.loop)
        started = time.time()
        time.sleep(15)  # rate windows (10 s) filled with load
        if load_future.done():
            load_future.result()  # raises what ended the load early
        yield Fleet(prom, router_a, router_b, load, urls, started, gaps, prefix, late, router_c, emulated, loop)
    finally:
        if load is not None:
            loop.loop.call_soon_threadsafe(load.stop.set)
            with contextlib.suppress(Exception):
                load_future.result(30)
        if prom is not None:
            prom.stop()
        for r in routers:
            r.stop()
        loop.run(_stop_all(replicas, runners))
        loop.close()
        delete_keys(prefix)


# ---------------------------------------------------------------------------------------------
# Dashboard queries


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, PromQL) of every target of every dashboard."""
    out = []
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        for panel in model["panels"]:
            for target in panel.get("targets", []):
                out.append((model["title"], panel["title"], target["expr"]))
    return out


def substitute(expr: str, values: dict[str, str] = VARIABLES) -> str:
    """Grafana's variables replaced by concrete values (longest names first: $__range_s vs $__range)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    assert not re.search(r"\$(?!\d)", expr), f"unreplaced variable in {expr!r}"  # $1: label_replace's
    return expr


def numeric(result: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in result if not math.isnan(float(s["value"][1]))]


# ---------------------------------------------------------------------------------------------
# Tests


def test_promtool_checks_the_alerting_rules():
    promtool = _binary("promtool")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_dashboards_are_up_to_date_with_their_builder():
    out = subprocess.run([sys.executable, str(REPO / "dashboards" / "build.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)) and model["uid"] and model["templating"]["list"][0]["type"] == "datasource"
        assert all(t["datasource"]["uid"] == "${datasource}" for p in model["panels"] for t in p["targets"])


def test_shortened_rules_change_only_windows_and_durations():
    original = yaml.safe_load(ALERTS.read_text())
    short = shortened_rules(ALERTS.read_text())
    pairs = [(a, b) for ga, gb in zip(original["groups"], short["groups"]) for a, b in zip(ga["rules"], gb["rules"])]
    assert pairs and all(re.sub(r"\[\d+[smhd]\]", "[W]", a["expr"]) == re.sub(r"\[\d+[smhd]\]", "[W]", b["expr"])
                         for a, b in pairs)
    assert all(b.get("for", "0s") == "0s" for _, b in pairs)


KV_EVENT_METRIC = "kvroute_kv_event"


def require_kv_event_subscriber(fleet: Fleet) -> None:
    """The KV-event parts need the router's KV-event subscriber: its /metrics carries
    kvroute_kv_event* series from the first scrape."""
    with urllib.request.urlopen(fleet.router_a.url + "/metrics", timeout=5) as resp:
        assert KV_EVENT_METRIC in resp.read().decode(), "the router exports no kvroute_kv_event* metrics"


def check_queries(fleet: Fleet, queries: list[tuple[str, str, str]]) -> None:
    report, empty = [], []
    for dash, panel, expr in queries:
        result = fleet.prometheus.query(substitute(expr))
        report.append((dash, panel, len(result)))
        if not numeric(result):
            empty.append(f"{dash} / {panel}: {expr}")
    fleet.summary.setdefault("queries", []).extend(report)
    print("\nseries per dashboard query:")
    for dash, panel, n in report:
        print(f"  {n:3d}  {dash} / {panel}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


SRE_SERIES = ("kvroute_request_duration_seconds_bucket", "kvroute_ttft_seconds_bucket",
              "kvroute_inter_token_latency_seconds_bucket", "kvroute_output_tokens_total", "kvroute_replica_info",
              "kvroute_replica_prefill_tokens_per_second", "process_cpu_seconds_total", "process_resident_memory_bytes",
              "process_open_fds", "process_max_fds")


def test_prometheus_scrapes_the_sre_series_and_no_created_ones(fleet: Fleet):
    """Every router's SRE series reach Prometheus under the routers' load (streamed and whole
    answers from the openai client); no `_created` series at all; replicas named by their
    label, their URL in the info series."""
    routers = {fleet.router_a.instance, fleet.router_b.instance}
    for name in SRE_SERIES:
        scraped = {s["metric"]["instance"] for s in fleet.prometheus.query(f'{name}{{job="kvroute"}}')}
        assert routers <= scraped, (name, scraped)
    assert fleet.prometheus.query(f'sum by (model) (kvroute_output_tokens_total{{job="kvroute"}}) > 0')
    assert fleet.prometheus.query('{__name__=~".+_created", job="kvroute"}') == []
    info = {s["metric"]["replica"]: s["metric"]["url"]
            for s in fleet.prometheus.query(f'kvroute_replica_info{{instance="{fleet.router_b.instance}"}}')}
    assert info == {label(url): url for url in fleet.replicas["tiny-rr"]}


def test_every_dashboard_query_returns_data(fleet: Fleet):
    queries = dashboard_queries()
    assert len(queries) >= 40
    check_queries(fleet, [q for q in queries if KV_EVENT_METRIC not in q[2]])


def test_kv_event_dashboard_queries_return_data(fleet: Fleet):
    require_kv_event_subscriber(fleet)
    queries = [q for q in dashboard_queries() if KV_EVENT_METRIC in q[2]]
    assert len(queries) >= 6
    check_queries(fleet, queries)


def test_dashboard_queries_filter_by_model(fleet: Fleet):
    """With $model set to one model, model-filtered queries return only that model's series."""
    values = dict(VARIABLES, **{"$model": "tiny"})
    for _, panel, expr in dashboard_queries():
        if 'model=~"$model"' not in expr or "sum by (model)" not in expr:
            continue
        result = fleet.prometheus.query(substitute(expr, values))
        assert {s["metric"].get("model") for s in result} == {"tiny"}, panel


GAP_ALERT = "KvrouteKvEventGaps"
STREAM_DOWN_ALERT = "KvrouteKvEventStreamDown"
LAG_ALERT = "KvrouteKvEventLagHigh"
KV_EVENT_ALERTS = {GAP_ALERT, STREAM_DOWN_ALERT, LAG_ALERT}
ROUTER_DOWN_ALERT = "KvrouteRouterTargetDown"  # compares `up`, which Prometheus records itself
Matcher = Callable[[dict[str, str]], bool]


def check_inner_expressions(fleet: Fleet, alert_names: set[str]) -> None:
    """Every recorded quantity the alerts compare to a threshold evaluates to data, as an
    expression and as the recorded series Prometheus keeps."""
    rules = shortened_rules(ALERTS.read_text())
    recorded = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    alerts = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") in alert_names]
    assert {a["alert"] for a in alerts} == alert_names
    missing = []
    for alert in alerts:
        names = set(re.findall(r"kvroute:[a-z0-9_:]+", alert["expr"]))
        assert names, f"{alert['alert']} compares no recorded quantity"
        for name in names:
            if not numeric(fleet.prometheus.query(recorded[name])):
                missing.append(f"{alert['alert']}: {name} = {recorded[name]}")
            if not numeric(fleet.prometheus.query(name)):
                missing.append(f"{alert['alert']}: recorded series {name} is empty")
    assert not missing, "\n".join(missing)


def wait_for_alerts(fleet: Fleet, expected: dict[str, Matcher], unexpected: dict[str, Matcher]) -> None:
    """Poll Prometheus until each expected alert fires for the labels its matcher accepts; fail
    at once if an alert fires for labels ``unexpected`` names."""
    seen: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    while time.monotonic() < deadline and len(seen) < len(expected):
        for alert in fleet.prometheus.firing():
            name, labels = alert["labels"]["alertname"], alert["labels"]
            if name in expected and expected[name](labels):
                seen.setdefault(name, labels)
            assert not (name in unexpected and unexpected[name](labels)), f"{name} fired wrongly: {labels}"
        time.sleep(1)
    fleet.summary.setdefault("alerts", {}).update(seen)
    recorded = {f"{s['metric']['__name__']}{{{','.join(f'{k}={v}' for k, v in s['metric'].items() if k != '__name__')}}}":
                s["value"][1] for s in fleet.prometheus.query('{__name__=~"kvroute:.+"}')}
    assert set(seen) == set(expected), (f"did not fire: {sorted(set(expected) - set(seen))}; load {fleet.load.counts}; "
                                        f"recorded quantities: {json.dumps(recorded, indent=1)}")


def test_alert_rules_are_the_expected_ones():
    rules = yaml.safe_load(ALERTS.read_text())
    assert {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r} == set(EXPECTED_ALERTS)


def test_each_alert_inner_expression_returns_data(fleet: Fleet):
    check_inner_expressions(fleet, set(EXPECTED_ALERTS) - KV_EVENT_ALERTS - {ROUTER_DOWN_ALERT} - NO_SERIES_AT_ZERO)


def test_each_alert_fires_by_its_condition(fleet: Fleet):
    a, b, c = fleet.router_a.instance, fleet.router_b.instance, fleet.router_c.instance
    expected: dict[str, Matcher] = {
        "KvrouteDeliveredReuseLow": lambda lab: lab.get("model") == "tiny-rr",  # round-robin sessions
        "KvrouteReplicaShareHigh": lambda lab: lab.get("model") == "hot",  # a hot prefix stays on its holder
        "KvrouteRedisErrors": lambda lab: lab.get("instance") == b,  # router B's Redis does not exist
        "KvrouteRouter5xx": lambda lab: lab.get("model") == "broken",  # its only replica answers 500
        "KvrouteBreakerOpen": lambda lab: lab.get("replica") == label(fleet.replicas["broken"][0]),  # ... every time
        # streams miss the live rules' 5 ms TTFT objective (the burn-rate windows all 10 s here)
        "KvrouteTtftBudgetBurn": lambda lab: lab.get("model") in ("tiny", "hot", "tiny-rr"),
        # router C's Kubernetes API refuses connections (the errors come at its backoff, 30 s apart
        # at most, so the 10 s window holds one for a third of the time: seen within the timeout)
        "KvrouteDiscoveryErrors": lambda lab: lab.get("instance") == c and lab.get("source") == "k8s",
    }
    # where the condition is absent the alert must not fire: a reachable Redis, models without errors
    unexpected: dict[str, Matcher] = {
        "KvrouteRedisErrors": lambda lab: lab.get("instance") == a,
        "KvrouteDiscoveryErrors": lambda lab: lab.get("instance") in (a, b),  # they watch no API
        "KvrouteRouter5xx": lambda lab: lab.get("model") in ("tiny", "hot", "tiny-rr"),
        "KvrouteDeliveredReuseLow": lambda lab: lab.get("model") in ("tiny", "hot"),  # cost_model follows the cache
        "KvrouteReplicaShareHigh": lambda lab: lab.get("model") == "tiny-rr",  # round-robin spreads evenly
        "KvrouteIndexRebuilt": lambda lab: True,  # nothing emptied Redis (yet: see the test below)
        # (its firing: tests/test_alert_rules.py; the rogue registrations: tests/test_registration_auth.py)
        "KvrouteRegistrationRejected": lambda lab: True,  # every registration here is believed
        "KvrouteBreakerOpen": lambda lab: lab.get("replica") in healthy_replicas(fleet),
        "KvrouteNoHealthyReplica": lambda lab: True,  # every model has a healthy replica (until a test below)
        ROUTER_DOWN_ALERT: lambda lab: True,  # every router answers (until a test below)
        **{name: (lambda lab: True) for name in NOT_PROVOKED_HERE},  # nothing here is overloaded
    }
    wait_for_alerts(fleet, expected, unexpected)
    # a Redis outage is a warning (requests still succeed), a model without replicas critical
    severities = {r["alert"]: r["labels"]["severity"] for g in yaml.safe_load(ALERTS.read_text())["groups"]
                  for r in g["rules"] if "alert" in r}
    assert severities["KvrouteRedisErrors"] == "warning" and severities["KvrouteNoHealthyReplica"] == "critical"
    assert severities["KvrouteDiscoveryErrors"] == "warning"  # the last listing still routes
    refused = fleet.prometheus.query(f'kvroute_discovery_errors_total{{instance="{c}",error="connection"}}')
    assert numeric(refused) and numeric(refused)[0] > 0, refused
    assert fleet.summary["alerts"]["KvrouteRedisErrors"]["severity"] == "warning"


def healthy_replicas(fleet: Fleet) -> set[str]:
    """The replicas nothing in this module makes fail."""
    return {label(url) for model in ("tiny", "hot", "tiny-rr") for url in fleet.replicas[model]}


def test_kv_event_gap_alert_fires_for_the_lossy_publisher(fleet: Fleet):
    require_kv_event_subscriber(fleet)
    check_inner_expressions(fleet, {GAP_ALERT})
    lossy, lossless = label(fleet.replicas["broken"][0]), {label(url) for url in fleet.replicas["tiny"]}
    wait_for_alerts(fleet, {GAP_ALERT: lambda lab: lab.get("replica") == lossy},
                    {GAP_ALERT: lambda lab: lab.get("replica") in lossless})
    assert fleet.gaps.skipped > 0


def test_index_rebuild_alert_fires_when_redis_loses_the_index(fleet: Fleet):
    """Router A's index loses its epoch key, as a Redis restarted empty or flushed would: A
    registers its replicas again, counts the rebuild, and the alert fires for A alone."""
    import redis

    from kvroute.common.blocks import HASH_SCHEME

    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.delete(f"{fleet.redis_prefix}:{{{HASH_SCHEME}}}:epoch") == 1
    finally:
        client.close()
    a, b = fleet.router_a.instance, fleet.router_b.instance
    wait_for_alerts(fleet, {"KvrouteIndexRebuilt": lambda lab: lab.get("instance") == a},
                    {"KvrouteIndexRebuilt": lambda lab: lab.get("instance") == b})


def test_load_went_through_the_routers(fleet: Fleet):
    """The load really ran: every loop had answers, and only `broken` failed."""
    counts, errors = dict(fleet.load.counts), dict(fleet.load.errors)
    assert all(counts.get(name, 0) > 0 for name in ("tiny", "tiny-rr", "hot", "hostile")), counts
    assert errors.get("broken", 0) > 0 and counts.get("broken", 0) == 0, (counts, errors)
    assert set(errors) == {"broken"}, errors
    hostile = fleet.prometheus.query('sum by (client) (kvroute_cache_hostile_prompts_total{client="hostile-app"})')
    assert numeric(hostile) and numeric(hostile)[0] > 0, "no cache-hostile prompt was flagged for hostile-app"


# ---------------------------------------------------------------------------------------------
# The cache dashboard, rendered from Prometheus (no Grafana here): docs/cache-dashboard.png

CACHE_PANELS = ("Reuse per model: available vs predicted vs delivered", "Delivered / available per model",
                "Engine prefix-cache hit rate per replica", "Cache-hostile prompts / s by client")


def render_cache_dashboard(prom: Prometheus, start: float, end: float, out: Path) -> dict[str, int]:
    """The cache dashboard's panels drawn with matplotlib from query_range results of the same
    queries Grafana runs; returns the number of series drawn per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cache = json.loads((REPO / "dashboards" / "kvroute-cache.json").read_text())
    panels = {p["title"]: p for p in cache["panels"]}
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), constrained_layout=True)
    styles = ("-", "--", ":")  # one per target of a panel (available, predicted, delivered)
    drawn = {}
    for ax, title in zip(axes.flat, CACHE_PANELS):
        panel, n, colors = panels[title], 0, {}
        for style, target in zip(styles, panel["targets"]):
            for series in prom.query_range(substitute(target["expr"]), start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"] if not math.isnan(float(v))]
                if not points:
                    continue  # e.g. a model whose every request failed: no ratio to draw
                key = next(iter(sorted(v for k, v in series["metric"].items() if k != "__name__")), "")
                color = colors.setdefault(key, f"C{len(colors) % 10}")
                legend = re.sub(r"\{\{(\w+)\}\}", lambda m: series["metric"].get(m.group(1), ""), target["legendFormat"])
                ax.plot(*zip(*points), style, color=color, label=legend, linewidth=1.6)
                n += 1
        drawn[title] = n
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds of load", fontsize=8)
        if panel["fieldConfig"]["defaults"]["unit"] == "percentunit":
            ax.set_ylim(-0.02, 1.02)
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2)
    fig.suptitle(f"{cache['title']}: panels from a live Prometheus (routers A cost_model, B round_robin)", fontsize=11)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn


def test_cache_dashboard_renders_from_prometheus(fleet: Fleet, tmp_path: Path):
    """Set KVROUTE_OBSERVE_PNG=docs/cache-dashboard.png to keep the picture."""
    keep = os.environ.get("KVROUTE_OBSERVE_PNG")
    out = Path(keep or tmp_path / "cache-dashboard.png")
    if keep:  # a longer picture for the docs
        time.sleep(max(0.0, fleet.started_at + 60 - time.time()))
    drawn = render_cache_dashboard(fleet.prometheus, fleet.started_at + 5, time.time(), out)
    assert all(n > 0 for n in drawn.values()), drawn
    assert out.stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------
# Dashboards: variables, descriptions, units, and every panel honouring the selection

UNITS = {"s", "ms", "percentunit", "reqps", "ops", "bytes", "short"}


def test_every_panel_has_a_description_a_unit_and_the_selection_variables():
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert {"namespace", "job", "replica"} <= set(variables), path.name
        for v in variables.values():
            if v["type"] == "query":
                assert v["definition"].startswith("label_values(") and v["includeAll"] and v["allValue"] == ".*"
        for panel in model["panels"]:
            where = f"{path.name} / {panel['title']}"
            assert len(panel["description"]) > 20, where
            assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, where
            for target in panel["targets"]:
                assert all(name in target["expr"] for name in SELECTIONS), where


def variable_values(fleet: Fleet, definition: str) -> list[str]:
    """What Grafana lists for a ``label_values(selector, label)`` variable (All selected above)."""
    selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", definition).groups()
    return fleet.prometheus.api(f"label/{label}/values", **{"match[]": substitute(selector)})


def test_variables_list_the_fleet(fleet: Fleet):
    board = json.loads((REPO / "dashboards" / "kvroute-replicas.json").read_text())
    definitions = {v["name"]: v["definition"] for v in board["templating"]["list"] if v["type"] == "query"}
    assert variable_values(fleet, definitions["job"]) == ["kvroute"]
    assert variable_values(fleet, definitions["namespace"]) == []  # no namespace here: All (.*) matches
    replicas = set(variable_values(fleet, definitions["replica"]))
    assert {label(url) for url in fleet.replicas["tiny"] + fleet.replicas["tiny-rr"]} <= replicas
    assert {"tiny", "hot", "tiny-rr"} <= set(variable_values(fleet, definitions["model"]))


def test_every_dashboard_query_honours_namespace_job_and_replica(fleet: Fleet):
    """With any of the three set to a value nothing has, every query comes back empty: no panel
    ignores the selection."""
    ignored = []
    for name in SELECTIONS:
        values = dict(VARIABLES, **{name: "no-such-value"})
        for dash, panel, expr in dashboard_queries():
            if numeric(fleet.prometheus.query(substitute(expr, values))):
                ignored.append(f"{name}: {dash} / {panel}")
    assert not ignored, "\n".join(ignored)


def test_one_replica_selected_shows_that_replica(fleet: Fleet):
    """$replica set to one replica (of router B): per-replica panels show it alone, engine panels
    its instance alone, and router-wide panels by instance router B alone."""
    url = fleet.replicas["tiny-rr"][0]
    replica = label(url)
    values = dict(VARIABLES, **{"$replica": replica})  # its dots match themselves too
    engine = urllib.parse.urlsplit(url).netloc  # its instance: from kvroute_replica_info's url
    checked = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                legend, expr = target["legendFormat"], target["expr"]
                if "{{replica}}" in legend:
                    key, want = "replica", replica
                elif "{{instance}}" in legend:
                    key, want = "instance", engine if "vllm:" in expr else fleet.router_b.instance
                else:
                    continue
                got = {s["metric"].get(key) for s in fleet.prometheus.query(substitute(expr, values))}
                assert got <= {want}, (panel["title"], got)
                checked += [panel["title"]] if got else []
    assert len(checked) >= 15, checked


def test_runbook_has_a_section_per_alert():
    """Each alert's runbook_url names a section of docs/runbook.md (GitHub's anchor: the
    heading in lower case) that says what it means, how to check and what to do."""
    sections = {}
    for block in re.split(r"^## ", RUNBOOK.read_text(), flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        sections[heading.strip().lower()] = body
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            assert rule["labels"]["severity"] in ("warning", "critical") and "for" in rule, rule["alert"]
            path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
            assert path == "docs/runbook.md" and anchor == rule["alert"].lower(), rule["alert"]
            body = sections[anchor]
            assert all(part in body for part in ("**Means**", "**Check**", "**Act**")), rule["alert"]


# ---------------------------------------------------------------------------------------------
# Alerts made to fire by breaking one part of the fleet: these tests run last (in file order)


def test_kv_event_lag_alert_fires_for_the_late_publisher(fleet: Fleet):
    require_kv_event_subscriber(fleet)
    check_inner_expressions(fleet, {LAG_ALERT})
    late = label(fleet.replicas["lagging"][0])
    wait_for_alerts(fleet, {LAG_ALERT: lambda lab: lab.get("replica") == late and lab.get("instance") ==
                            fleet.router_a.instance}, {})
    p99 = {s["metric"]["replica"]: float(s["value"][1])
           for s in fleet.prometheus.query("kvroute:kv_event_lag:p99_rate5m") if s["metric"]["replica"] != late}
    assert p99 and all(v < 2.5 for v in p99.values() if not math.isnan(v)), p99  # the others keep up


def test_kv_event_stream_down_alert_fires_when_a_publisher_stops(fleet: Fleet):
    """`quiet` keeps serving requests after its publisher stops: the router applies nothing."""
    require_kv_event_subscriber(fleet)
    check_inner_expressions(fleet, {STREAM_DOWN_ALERT})
    quiet = fleet.emulated["quiet"]
    assert fleet.prometheus.query(f'kvroute:kv_events_applied:rate10m{{replica="{label(quiet.url)}"}} > 0')

    async def stop_publisher() -> None:
        publisher, quiet.driver.wire.publisher = quiet.publisher, None  # the engine's events go nowhere
        await publisher.close()

    fleet.loop.run(stop_publisher())
    served = fleet.load.counts.get("quiet", 0)
    wait_for_alerts(fleet, {STREAM_DOWN_ALERT: lambda lab: lab.get("replica") == label(quiet.url)},
                    {STREAM_DOWN_ALERT: lambda lab: lab.get("replica") in {label(url) for url in fleet.replicas["tiny"]}})
    assert fleet.load.counts.get("quiet", 0) > served  # still served meanwhile


def test_shedding_alert_fires_when_a_router_refuses_requests(fleet: Fleet):
    """Router C admits one request at a time (--max-in-flight 1, no queue: --max-queue-wait-s 0):
    six clients sending to `solo` one request after another get mostly 429s; the alert fires for
    C, not for A or B."""
    a, b, c = fleet.router_a.instance, fleet.router_b.instance, fleet.router_c.instance
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            body = {"model": "solo", "prompt": "a long answer please", "max_tokens": 40}
            async with session.post(fleet.router_c.url + "/v1/completions", json=body) as resp:
                await resp.read()

    async def burst() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(client(session) for _ in range(6)))

    running = asyncio.run_coroutine_threadsafe(burst(), fleet.loop.loop)
    try:
        wait_for_alerts(fleet, {"KvrouteShedding": lambda lab: lab.get("instance") == c},
                        {"KvrouteShedding": lambda lab: lab.get("instance") in (a, b)})
    finally:
        fleet.loop.loop.call_soon_threadsafe(stop.set)
        running.result(30)
    refused = fleet.prometheus.query(f'sum(kvroute_shed_requests_total{{instance="{c}",reason="no_queue"}})')
    assert numeric(refused) and numeric(refused)[0] > 0, refused


def test_no_healthy_replica_alert_fires_when_the_only_replica_dies(fleet: Fleet):
    solo = fleet.emulated["solo"]
    fleet.loop.run(solo.stop())
    wait_for_alerts(fleet, {"KvrouteNoHealthyReplica": lambda lab: lab.get("model") == "solo"},
                    {"KvrouteNoHealthyReplica": lambda lab: lab.get("model") != "solo"})
    assert fleet.summary["alerts"]["KvrouteNoHealthyReplica"]["severity"] == "critical"


def test_router_target_down_alert_fires_when_a_router_stops(fleet: Fleet):
    fleet.router_c.stop()
    c = fleet.router_c.instance
    wait_for_alerts(fleet, {ROUTER_DOWN_ALERT: lambda lab: lab.get("instance") == c},
                    {ROUTER_DOWN_ALERT: lambda lab: lab.get("instance") != c})
