"""The fleet layer against real HTTP replicas on loopback, real Redis and a real MemoryIndex.

``FakeReplica`` is a tiny aiohttp server speaking the parts of vLLM's protocol the fleet reads:
``/health``, ``/v1/models`` and ``/metrics`` in vLLM's exposition format.  Tests flip its state
(health status, load, restart) and watch the fleet follow.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from kvroute.router.fleet.discovery import address_url, normalize_url, select_addresses
from kvroute.router.fleet.membership import Fleet
from tests.router_support import index_client
from kvroute.router.fleet.settings import FleetSettings
from kvroute.router.index.memory import MemoryIndex
from kvroute.common.registration import ReplicaRecord, keep_registered, register
from kvroute.common.scrape import parse_vllm_metrics
from tests.conftest import free_port

FAST = dict(health_interval_s=0.05, health_timeout_s=0.5, metrics_interval_s=0.05, metrics_timeout_s=0.5)


# -- a replica on loopback ------------------------------------------------------------------
class FakeReplica:
    def __init__(
        self,
        models: tuple[str, ...] = ("m1",),
        *,
        block_size: int = 16,
        num_gpu_blocks: int = 1000,
        engines: int = 1,
        host: str = "127.0.0.1",
        api_key: str | None = None,
    ):
        self.models = list(models)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.engines = engines
        self.host = host
        self.api_key = api_key
        self.port = free_port() if host == "127.0.0.1" else _free_port6()
        self.health_status = 200
        self.running = 0  # per engine
        self.waiting = 0
        self.kv_usage = 0.0
        self.start_time = 1_700_000_000.0
        self.hang_metrics = asyncio.Event()  # set: /metrics does not answer until stop()
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return address_url("http", self.host, self.port)

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        return self

    async def stop(self) -> None:
        self._stopping.set()  # release hanging handlers, or shutdown waits for them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm", "root": m} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.hang_metrics.is_set():
            await self._stopping.wait()
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    def metrics_text(self) -> str:
        model = self.models[0]
        lines = []
        for name, kind, value in (
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", self.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", self.kv_usage),
            ("vllm:prefix_cache_queries_total", "counter", 4096),
        ):
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{engine="{e}",model_name="{model}"}} {float(value)}' for e in range(self.engines)]
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge"]
        lines += [
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",enable_prefix_caching="True",'
            f'engine="{e}",num_cpu_blocks="None",num_gpu_blocks="{self.num_gpu_blocks}",'
            f'prefix_caching_hash_algo="sha256"}} 1.0'
            for e in range(self.engines)
        ]
        lines += ["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
                  "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {self.start_time}"]
        return "\n".join(lines) + "\n"


def _free_port6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def replicas():
    started: list[FakeReplica] = []

    async def make(*args, **kwargs) -> FakeReplica:
        r = await FakeReplica(*args, **kwargs).start()
        started.append(r)
        return r

    yield make
    for r in started:
        await r.stop()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def fleets(session):
    """Build fleets on real parts; each is stopped afterwards."""
    made: list[Fleet] = []

    async def make(index: MemoryIndex | None = None, redis=None, **settings) -> Fleet:
        fleet = Fleet(
            FleetSettings(**{**FAST, **settings}),
            session,
            index=index_client(index if index is not None else MemoryIndex()),
            redis=redis,
        )
        made.append(fleet)
        await fleet.start()
        return fleet

    yield make
    for f in made:
        await f.stop()


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a state the fleet's background loops must reach (bounded, so a bug fails)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def held_blocks(index: MemoryIndex, replica: str, n: int = 10) -> int:
    """Record an n-block prediction for ``replica`` and count what the index then holds for it."""
    await index.record_prediction(replica, list(range(1, n + 1)))
    return await index.entry_count(replica)


# -- static fleet -----------------------------------------------------------------------------
async def test_static_fleet_comes_up_with_models_geometry_and_load(replicas, fleets):
    a = await replicas(("m1", "shared"), block_size=32, num_gpu_blocks=50)
    b = await replicas(("m2", "shared"), block_size=32, num_gpu_blocks=700, engines=2)
    a.running, a.waiting, a.kv_usage = 3, 2, 0.25
    b.running, b.waiting, b.kv_usage = 1, 4, 0.5
    index = MemoryIndex()
    fleet = await fleets(index, replicas=f"{a.url}/, {b.url}")  # comma string, trailing slash

    assert fleet.ready()
    assert [r.name for r in fleet.replicas()] == [a.url, b.url]
    assert all(r.healthy and r.sources == {"static"} for r in fleet.replicas())
    assert sorted(fleet.models()) == ["m1", "m2", "shared"]
    assert [r.name for r in fleet.models()["shared"]] == [a.url, b.url]
    assert sorted(c["id"] for c in fleet.model_cards()) == ["m1", "m2", "shared"]
    assert all(c["object"] == "model" for c in fleet.model_cards())
    assert [r.name for r in fleet.eligible("m1")] == [a.url]
    assert [r.name for r in fleet.eligible("shared")] == [a.url, b.url]
    assert fleet.eligible("nope") == []

    assert fleet.block_size("m1") == 32
    assert fleet.block_size("unknown-model") == 16  # vLLM's default
    ra, rb = fleet.get(a.url), fleet.get(b.url)
    assert (ra.capacity_blocks, rb.capacity_blocks) == (50, 1400)  # two engines, two caches
    # The index was told the capacity: it holds no more than 50 blocks for a.
    assert await held_blocks(index, a.url, 80) == 50
    assert await held_blocks(index, b.url, 80) == 80

    rb = fleet.get(b.url)
    assert (rb.running, rb.waiting, rb.kv_usage, rb.capacity_blocks, rb.healthy) == (2, 8, 0.5, 1400, True)
    assert fleet.get(a.url).running == 3

    # Load follows the replica's /metrics on the metrics interval.
    a.running = 7
    await until(lambda: fleet.get(a.url).running == 7)
    assert {s.name: s.running for s in fleet.status()}[a.url] == 7


async def test_configured_geometry_overrides_scraped(replicas, fleets):
    a = await replicas(block_size=32, num_gpu_blocks=50)
    index = MemoryIndex()
    fleet = await fleets(index, replicas=[a.url], block_size=64, capacity_blocks=20)
    assert fleet.block_size("m1") == 64
    assert fleet.get(a.url).capacity_blocks == 20
    assert await held_blocks(index, a.url, 30) == 20


async def test_unreachable_replica_never_comes_up(replicas, fleets):
    a = await replicas()
    dead = f"http://127.0.0.1:{free_port()}"
    fleet = await fleets(replicas=[a.url, dead])
    assert fleet.get(dead) is not None and not fleet.get(dead).healthy
    assert [r.name for r in fleet.eligible("m1")] == [a.url]
    assert fleet.ready()


# -- health -----------------------------------------------------------------------------------
async def test_health_failures_take_a_replica_out_and_recovery_readds_it(replicas, fleets):
    a = await replicas()
    b = await replicas()
    index = MemoryIndex()
    fleet = await fleets(index, replicas=[a.url, b.url], unhealthy_after=3)
    events: list[tuple[str, str]] = []
    fleet.subscribe(lambda event, r: events.append((event, r.name)))
    assert await held_blocks(index, a.url) == 10

    a.health_status = 503
    await until(lambda: not fleet.get(a.url).healthy)
    assert fleet.get(a.url).health_failures >= 3
    assert [r.name for r in fleet.eligible("m1")] == [b.url]
    assert await index.lookup([1, 2, 3]) == {}
    assert await held_blocks(index, a.url) == 0  # out of the index: its entries are dropped
    assert events == [("down", a.url)]

    a.health_status = 200
    await until(lambda: fleet.get(a.url).healthy)
    assert [r.name for r in fleet.eligible("m1")] == [a.url, b.url]
    assert await held_blocks(index, a.url) == 10  # back in the index, empty but accepting
    assert events == [("down", a.url), ("up", a.url)]


async def test_killed_replica_becomes_ineligible(replicas, fleets):
    a = await replicas()
    index = MemoryIndex()
    fleet = await fleets(index, replicas=[a.url], unhealthy_after=2)
    assert fleet.ready() and fleet.eligible("m1")
    await index.record_prediction(a.url, [1, 2, 3])
    await a.stop()
    await until(lambda: not fleet.ready())
    assert fleet.eligible("m1") == []
    assert await index.lookup([1, 2, 3]) == {}
    assert fleet.models() == {} and fleet.model_cards() == []


async def test_restart_between_health_checks_clears_index_entries(replicas, fleets):
    a = await replicas()
    index = MemoryIndex()
    fleet = await fleets(index, replicas=[a.url])
    events: list[str] = []
    fleet.subscribe(lambda event, r: events.append(event))
    await index.record_prediction(a.url, [1, 2, 3])
    a.start_time += 60  # the process restarted: same URL, empty cache
    await until(lambda: "restarted" in events)
    assert await index.entry_count(a.url) == 0
    assert fleet.get(a.url).healthy
    assert await held_blocks(index, a.url) == 10


async def test_a_hanging_replica_does_not_stall_the_others(replicas, fleets):
    slow = await replicas()
    fast = await replicas()
    fleet = await fleets(replicas=[slow.url, fast.url], metrics_timeout_s=30.0)
    slow.hang_metrics.set()
    await asyncio.sleep(0.2)  # the slow replica's scrape is now stuck for 30 s
    fast.running = 5
    await until(lambda: fleet.get(fast.url).running == 5, timeout=3.0)
    fast.running = 6
    await until(lambda: fleet.get(fast.url).running == 6, timeout=3.0)


async def test_replica_api_key_is_sent_upstream(replicas, fleets):
    locked = await replicas(api_key="secret")
    without = await fleets(replicas=[locked.url])
    assert not without.ready()  # its models cannot be read without the key
    assert without.upstream_headers() == {}
    keyed = await fleets(replicas=[locked.url], replica_api_key="secret")
    assert keyed.ready()
    assert keyed.upstream_headers() == {"Authorization": "Bearer secret"}


async def test_drain_stops_new_routing(replicas, fleets):
    a = await replicas()
    b = await replicas()
    fleet = await fleets(replicas=[a.url, b.url])
    assert await fleet.drain(a.url) is True
    assert await fleet.drain("http://nowhere:1") is False
    assert [r.name for r in fleet.eligible("m1")] == [b.url]
    assert await fleet.undrain(a.url)
    assert len(fleet.eligible("m1")) == 2


# -- circuit breaker --------------------------------------------------------------------------
async def test_breaker_opens_on_reported_failures_and_half_opens_after_cooldown(replicas, fleets):
    a = await replicas()
    b = await replicas()
    fleet = await fleets(replicas=[a.url, b.url], breaker_failures=2, breaker_cooldown_s=0.3)
    fleet.report_failure(a.url)
    assert len(fleet.eligible("m1")) == 2
    fleet.report_failure(a.url)
    assert [r.name for r in fleet.eligible("m1")] == [b.url]
    assert fleet.get(a.url).breaker.state == "open"
    status = {s.name: s for s in fleet.status()}
    assert status[a.url].breaker_state == "open" and status[a.url].breaker_opened_total == 1
    assert status[a.url].healthy  # /health still answers: only the breaker keeps it out

    await until(lambda: fleet.get(a.url).breaker.state == "half_open")
    for _ in range(3):  # offered to every request's policy; asking takes nothing
        assert [r.name for r in fleet.eligible("m1")] == [a.url, b.url]
    assert fleet.claim(b.url)  # the policy routed elsewhere: a's trial is still free
    assert fleet.claim(a.url)  # the request routed to a is the trial
    assert [r.name for r in fleet.eligible("m1")] == [b.url]
    assert not fleet.claim(a.url)  # one trial at a time
    fleet.report_success(a.url)
    assert fleet.get(a.url).breaker.state == "closed"
    assert len(fleet.eligible("m1")) == 2


async def test_a_replica_back_up_rejoins_with_its_breaker_closed(replicas, fleets):
    # Requests failing during the outage opened its circuit; once health checks see it up again it
    # takes requests at once, not after a cooldown and a trial.
    a = await replicas()
    b = await replicas()
    fleet = await fleets(replicas=[a.url, b.url], unhealthy_after=1, breaker_failures=1, breaker_cooldown_s=60)
    a.health_status = 503
    fleet.report_failure(a.url)
    await until(lambda: not fleet.get(a.url).healthy)
    assert fleet.get(a.url).breaker.state == "open"
    a.health_status = 200
    await until(lambda: fleet.get(a.url).healthy)
    assert fleet.get(a.url).breaker.state == "closed"
    assert [r.name for r in fleet.eligible("m1")] == [a.url, b.url]


async def test_a_restart_seen_between_health_checks_closes_the_breaker(replicas, fleets):
    a = await replicas()
    fleet = await fleets(replicas=[a.url], breaker_failures=1, breaker_cooldown_s=60)
    fleet.report_failure(a.url)
    assert fleet.get(a.url).breaker.state == "open" and fleet.eligible("m1") == []
    a.start_time += 60  # a new process on the same URL, answering its probes
    await until(lambda: fleet.get(a.url).breaker.state == "closed")
    assert fleet.eligible("m1")


async def test_passthrough_order_takes_a_half_open_trial_only_first(replicas, fleets):
    a = await replicas()
    b = await replicas()
    fleet = await fleets(replicas=[a.url, b.url], breaker_failures=1, breaker_cooldown_s=0.2)
    fleet.report_failure(a.url)
    await until(lambda: fleet.get(a.url).breaker.state == "half_open")
    # a fallback is tried only if the first fails: it must not take (and waste) the trial
    assert fleet.claim_in_order([b.url, a.url], 2) == [b.url]
    assert fleet.get(a.url).breaker.available()
    assert fleet.claim_in_order([a.url, b.url], 2) == [a.url, b.url]
    assert not fleet.get(a.url).breaker.available()
    assert fleet.claim_in_order([a.url, b.url], 1) == [b.url]


async def test_status_exposes_plain_data(replicas, fleets):
    a = await replicas()
    a.running = 2
    fleet = await fleets(replicas=[a.url])
    [s] = fleet.status()
    assert (s.name, s.healthy, s.draining, s.breaker_state) == (a.url, True, False, "closed")
    # the router's own load is not the fleet's to know (kvroute.router.placement.load owns it; the app joins them)
    assert (s.in_flight, s.queued_prefill_tokens, s.running) == (0, 0, 2)
    assert s.models == ["m1"] and s.capacity_blocks == 1000 and s.scrape_age_s is not None


# -- Redis discovery --------------------------------------------------------------------------
async def test_redis_registrations_join_and_leave_with_their_ttl(replicas, fleets, redis_url, redis_prefix):
    import redis.asyncio as aioredis

    kept = await replicas()
    lapsing = await replicas()
    client = aioredis.Redis.from_url(redis_url)
    clock_now = [0.0]
    index = MemoryIndex(predicted_ttl_s=5.0, clock=lambda: clock_now[0])
    heart = asyncio.create_task(
        keep_registered(client, redis_prefix, ReplicaRecord(url=kept.url, model="m1"), ttl=1.0, interval=0.2)
    )
    try:
        await register(
            client,
            redis_prefix,
            ReplicaRecord(url=lapsing.url, model="m1", events_endpoint="tcp://127.0.0.1:5557", capacity_blocks=3),
            ttl=1.0,
        )
        await asyncio.sleep(0.05)  # let the heartbeat task write its first registration
        fleet = await fleets(index, discovery_redis=True, redis_url=redis_url, redis_key_prefix=redis_prefix)
        events: list[tuple[str, str]] = []
        fleet.subscribe(lambda event, r: events.append((event, r.name)))
        assert sorted(r.name for r in fleet.eligible("m1")) == sorted([kept.url, lapsing.url])
        r = fleet.get(lapsing.url)
        assert r.sources == {"redis"} and r.events_endpoint == "tcp://127.0.0.1:5557"
        assert r.capacity_blocks == 1000  # scraped beats registered
        # A replica with KV events: the index lets its predictions expire until events confirm them.
        await index.record_prediction(lapsing.url, [1, 2])
        await index.record_prediction(kept.url, [1, 2])
        clock_now[0] += 6.0
        assert await index.lookup([1, 2]) == {kept.url: 2}

        # `lapsing` never heartbeats: its registration expires after ~1 s and it leaves.
        await until(lambda: fleet.get(lapsing.url) is None, timeout=5.0)
        assert events == [("left", lapsing.url)]
        assert await held_blocks(index, lapsing.url) == 0
        assert [r.name for r in fleet.eligible("m1")] == [kept.url]

        # Re-registered with KV events: the fleet notices, and the index learns it publishes them.
        await register(client, redis_prefix,
                       ReplicaRecord(url=kept.url, model="m1", events_endpoint="tcp://127.0.0.1:5559"), ttl=1.0)
        await until(lambda: ("changed", kept.url) in events)
        assert fleet.get(kept.url).events_endpoint == "tcp://127.0.0.1:5559"
        await index.record_prediction(kept.url, [3, 4])
        clock_now[0] += 6.0
        assert await index.lookup([3, 4]) == {}
    finally:
        heart.cancel()
        await asyncio.gather(heart, return_exceptions=True)
        await client.aclose()


class TcpRelay:
    """A loopback TCP relay in front of Redis: closing it is a Redis outage as the fleet sees one."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in self._writers:
                w.close()
            await self._server.wait_closed()
            self._server = None


async def test_redis_outage_keeps_the_known_registrations(replicas, fleets, redis_url, redis_prefix):
    import redis.asyncio as aioredis
    from redis.asyncio.connection import parse_url

    a = await replicas()
    writer = aioredis.Redis.from_url(redis_url)
    await register(writer, redis_prefix, ReplicaRecord(url=a.url), ttl=30)
    await writer.aclose()
    target = parse_url(redis_url)
    relay = await TcpRelay(target.get("host", "127.0.0.1"), target.get("port", 6379)).start()
    db = target.get("db", 0)
    try:
        fleet = await fleets(
            discovery_redis=True,
            redis_url=f"redis://127.0.0.1:{relay.port}/{db}",
            redis_key_prefix=redis_prefix,
            discovery_timeout_s=0.2,
        )
        assert fleet.eligible("m1")
        await relay.close()  # Redis unreachable from here on
        await asyncio.sleep(0.5)  # several failed discovery rounds
        assert [r.name for r in fleet.eligible("m1")] == [a.url]
        assert fleet.get(a.url).sources == {"redis"}
    finally:
        await relay.close()


# -- DNS discovery ----------------------------------------------------------------------------
async def test_dns_name_resolves_to_replicas(replicas, fleets):
    a = await replicas()
    fleet = await fleets(dns_name=f"localhost:{a.port}")
    [r] = fleet.replicas()  # localhost may also answer ::1: still one replica
    assert r.name == f"http://127.0.0.1:{a.port}" and r.sources == {"dns"}
    assert r.healthy and fleet.eligible("m1") == [r]


async def test_dns_ipv6_addresses_are_bracketed(replicas, fleets):
    a = await replicas(host="::1")
    fleet = await fleets(dns_name=f"[::1]:{a.port}")
    [r] = fleet.replicas()
    assert r.name == f"http://[::1]:{a.port}"
    assert r.healthy


async def test_dns_and_static_sources_merge(replicas, fleets):
    a = await replicas()
    fleet = await fleets(replicas=[a.url], dns_name=f"127.0.0.1:{a.port}")
    [r] = fleet.replicas()
    assert r.sources == {"static", "dns"}


async def test_unresolvable_dns_name_leaves_the_fleet_empty_but_running(fleets):
    fleet = await fleets(dns_name="no-such-host.invalid:8000", discovery_timeout_s=1.0)
    assert fleet.replicas() == [] and not fleet.ready()


async def test_address_selection_dedupes_dual_stack():
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)
    infos += await loop.getaddrinfo("::1", 80, type=socket.SOCK_STREAM)
    infos += await loop.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)  # duplicate answer
    assert select_addresses(infos, "auto") == ["127.0.0.1"]
    assert select_addresses(infos, "ipv6") == ["::1"]
    assert select_addresses(infos, "both") == ["127.0.0.1", "::1"]
    v6_only = await loop.getaddrinfo("::1", 80, type=socket.SOCK_STREAM)
    assert select_addresses(v6_only, "auto") == ["::1"]
    assert address_url("https", "::1", 8000) == "https://[::1]:8000"
    assert normalize_url("10.0.0.1:8000/") == "http://10.0.0.1:8000"


# -- scraping ---------------------------------------------------------------------------------
# In the spirit of a real vLLM V1 /metrics page: two data-parallel engines, counters with the
# _total suffix plus their _created gauges, histograms, the cache config as labels.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.72e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8192.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4096.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.72e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6144.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1024.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 14.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 14.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27865",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27865",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""


def test_scrape_parses_a_realistic_vllm_page():
    s = parse_vllm_metrics(VLLM_METRICS)
    assert (s.running, s.waiting, s.kv_usage) == (7, 2, 0.4375)
    model = s.per_model["meta-llama/Llama-3.1-8B-Instruct"]
    assert (model.running, model.waiting, model.kv_usage) == (7, 2, 0.4375)
    assert (s.block_size, s.capacity_blocks, s.engines) == (16, 2 * 27865, 2)
    assert s.process_start_time == 1.72e9
    assert s.counters == {
        "vllm:prefix_cache_queries": 12288.0,
        "vllm:prefix_cache_hits": 7168.0,
        "vllm:prompt_tokens": 9000.0,
    }


def test_scrape_tolerates_missing_metrics_and_other_spellings():
    empty = parse_vllm_metrics("")
    assert (empty.running, empty.kv_usage, empty.block_size, empty.capacity_blocks) == (0, 0.0, None, None)
    # An older vLLM: no engine label, gpu_cache_usage_perc, counters written without _total,
    # and a cache config whose num_gpu_blocks is not known.
    old = parse_vllm_metrics(
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a"} 2.0\n'
        'vllm:num_requests_running{model_name="b"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="a"} 0.3\n'
        '# TYPE vllm:prompt_tokens counter\n'
        'vllm:prompt_tokens{model_name="a"} 50.0\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1.0\n'
    )
    assert (old.running, old.waiting, old.kv_usage) == (3, 0, 0.3)
    assert sorted(old.per_model) == ["a", "b"]
    assert (old.block_size, old.capacity_blocks) == (32, None)
    assert old.counters == {"vllm:prompt_tokens": 50.0}


def test_scrape_rejects_garbage():
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:num_requests_running{model_name="a" 2.0\n')


# -- against the project's emulated replica ---------------------------------------------------
async def test_fleet_follows_an_emulated_replica_registered_in_redis(fleets, redis_url, redis_prefix):
    import redis.asyncio as aioredis

    from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig

    emu = EmulatedReplica(
        ReplicaConfig(model="tiny-emulated", profile="cpu-tiny", block_size=32, num_gpu_blocks=300,
                      events_endpoint=f"tcp://127.0.0.1:{free_port()}")
    )
    await emu.start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        await register(client, redis_prefix,
                       ReplicaRecord(url=emu.url, model=emu.model, events_endpoint=emu.events_endpoint,
                                     engine="emulated"), ttl=30)
        index = MemoryIndex()
        fleet = await fleets(index, discovery_redis=True, redis_url=redis_url, redis_key_prefix=redis_prefix,
                             unhealthy_after=2)
        [r] = fleet.eligible("tiny-emulated")
        assert (r.name, r.block_size, r.capacity_blocks) == (emu.url, 32, 300)
        assert r.events_endpoint == emu.events_endpoint
        assert fleet.block_size("tiny-emulated") == 32
        assert [c["id"] for c in fleet.model_cards()] == ["tiny-emulated"]
        await index.record_prediction(emu.url, [7, 8, 9])

        await emu.stop()  # killed mid-test; its registration is still live
        await until(lambda: not fleet.ready())
        assert fleet.eligible("tiny-emulated") == []
        assert fleet.get(emu.url) is not None  # still registered, just down
        assert await index.lookup([7, 8, 9]) == {}
    finally:
        await emu.stop()
        await client.aclose()


async def test_a_refused_connection_takes_a_replica_out_at_once(replicas, fleets):
    # A request to it failed and the probe that follows finds nothing listening: out now, not
    # after unhealthy_after checks (which, 30 s apart here, would take minutes).
    a = await replicas()
    b = await replicas()
    index = MemoryIndex()
    fleet = await fleets(index, replicas=[a.url, b.url], health_interval_s=30, unhealthy_after=3)
    await index.record_prediction(a.url, [1, 2, 3])
    await a.stop()
    fleet.report_failure(a.url)  # as the proxy does on a connect error
    await until(lambda: not fleet.get(a.url).healthy, timeout=3.0)
    assert fleet.get(a.url).health_failures == 1
    assert [r.name for r in fleet.eligible("m1")] == [b.url]
    assert await index.lookup([1, 2, 3]) == {}  # what it cached died with it


async def test_an_error_status_still_takes_unhealthy_after_checks(replicas, fleets):
    a = await replicas()
    fleet = await fleets(replicas=[a.url], health_interval_s=30, unhealthy_after=3)
    a.health_status = 503  # it answers: maybe a passing overload, not a crash
    fleet.report_failure(a.url)
    await until(lambda: fleet.get(a.url).health_failures == 1, timeout=3.0)
    assert fleet.get(a.url).healthy
