"""The SRE series at the router (issue 21 item 7): end-to-end duration, TTFT, inter-token latency
and output tokens per model after real requests from the openai client, streamed and not; output
tokens counted from a stream's events when the replica reports no usage; ``process_*`` present,
for one process and summed over ``--workers 2``; no ``_created`` series anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.conftest import free_port
from tests.router_support import MODEL, RouterProcess, ScriptedReplica, emulated_replicas, openai_client
from tests.router_support import running_router, sample, scrape

SRE_HISTOGRAMS = ("kvroute_request_duration_seconds", "kvroute_ttft_seconds", "kvroute_inter_token_latency_seconds")
PROCESS_SERIES = (
    "process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
    "process_open_fds", "process_max_fds", "process_start_time_seconds",
)  # fmt: skip


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics", headers={"Connection": "close"}) as resp:
        assert resp.status == 200
        return await resp.text()


def assert_no_created(text: str) -> None:
    created = [line for line in text.splitlines() if "_created" in line.split("{")[0].split(" ")[0]]
    assert not created, created[:5]


async def test_duration_ttft_itl_and_output_tokens_after_streamed_and_whole_answers():
    async with emulated_replicas(2, time_scale=1.0) as reps, running_router([r.url for r in reps]) as app:
        client = openai_client(app)
        whole = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=6
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me more"}], max_tokens=9, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        streamed_usage = None
        async for chunk in stream:
            streamed_usage = chunk.usage or streamed_usage
        assert whole.usage is not None and streamed_usage is not None
        samples = await scrape(app.url)
        text = await metrics_text(app.url)

    # every answer counted, its output tokens as its usage says
    assert sample(samples, "kvroute_request_duration_seconds_count", model=MODEL) == 2
    assert sample(samples, "kvroute_output_tokens_total", model=MODEL) == (
        whole.usage.completion_tokens + streamed_usage.completion_tokens
    )
    # TTFT and inter-token latency: streams only
    assert sample(samples, "kvroute_ttft_seconds_count", model=MODEL) == 1
    assert sample(samples, "kvroute_inter_token_latency_seconds_count", model=MODEL) == 1
    itl = sample(samples, "kvroute_inter_token_latency_seconds_sum", model=MODEL)
    ttft = sample(samples, "kvroute_ttft_seconds_sum", model=MODEL)
    duration = sample(samples, "kvroute_request_duration_seconds_sum", model=MODEL)
    assert 0 < itl < duration and 0 < ttft < duration
    for name in SRE_HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
    for name in PROCESS_SERIES:
        assert sample(samples, name) > 0, name
    assert sample(samples, "process_resident_memory_bytes") > 20e6  # a Python router: tens of MB at least
    assert_no_created(text)
    assert "kvroute_replica_prefill_tokens_per_second" in text and "kvroute_replica_prefill_rate" not in text


class UsagelessStream(ScriptedReplica):
    """Streams ``TOKENS`` one-token events ``GAP_S`` apart, then [DONE], with no usage anywhere (as
    an engine that ignores ``stream_options``)."""

    TOKENS = 5
    GAP_S = 0.05

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.stream_tokens(request, self.TOKENS, self.GAP_S, wait_first=False)


async def test_output_tokens_are_a_streams_events_when_the_replica_reports_no_usage():
    async with UsagelessStream() as replica, running_router([replica.url]) as app:
        stream = await openai_client(app).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        samples = await scrape(app.url)
    assert len(pieces) == UsagelessStream.TOKENS
    assert sample(samples, "kvroute_output_tokens_total", model=MODEL) == UsagelessStream.TOKENS
    # the mean gap: at least the replica's sleep (a loaded machine only makes it longer)
    assert sample(samples, "kvroute_inter_token_latency_seconds_count", model=MODEL) == 1
    assert sample(samples, "kvroute_inter_token_latency_seconds_sum", model=MODEL) >= UsagelessStream.GAP_S * 0.9


async def test_process_metrics_sum_the_supervisor_and_its_workers():
    async with emulated_replicas(1) as reps:
        router = await RouterProcess.start([reps[0].url], "--port", str(free_port()), "--workers", "2")
        try:
            children = Path(f"/proc/{router.proc.pid}/task/{router.proc.pid}/children").read_text().split()
            workers = [int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert len(workers) == 2
            rss = {pid: _rss(pid) for pid in (router.proc.pid, *workers)}
            worker_start = min(_start(pid) for pid in workers)
            text = await metrics_text(router.url)
            samples = await scrape(router.url)
        finally:
            await router.stop()
    for name in PROCESS_SERIES:
        assert sample(samples, name) > 0, name
    # the sum of three processes: more than any one of them, about their total (they move a little)
    exposed = sample(samples, "process_resident_memory_bytes")
    assert exposed > max(rss.values()) * 1.5
    assert abs(exposed - sum(rss.values())) < 0.25 * sum(rss.values())
    # the router's start: the supervisor's, not the (later) workers'
    assert sample(samples, "process_start_time_seconds") <= worker_start
    assert sum(1 for line in text.splitlines() if line.startswith("process_resident_memory_bytes")) == 1
    assert_no_created(text)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _start(pid: int) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    return boot + float(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks


async def test_the_replica_label_is_the_name_discovery_gives_and_the_url_is_in_an_info_series(redis_url, redis_prefix):
    """A static entry named in the config file, one by URL alone (its host:port), a Redis
    registration's name: each replica's series carry that label, never its URL, and
    ``kvroute_replica_info`` maps it to the URL."""
    import redis.asyncio as aioredis

    from kvroute.common.registration import ReplicaRecord, register

    async with emulated_replicas(3) as (named, plain, registered):
        client = aioredis.Redis.from_url(redis_url)
        try:
            await register(client, redis_prefix, ReplicaRecord(url=registered.url, name="vllm-7", model=MODEL), ttl=60)
            fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
            replicas = [{"url": named.url, "name": "gpu-0"}, plain.url]
            async with running_router(replicas, fleet=fleet, policy="round_robin") as app:
                client_ai = openai_client(app)
                for i in range(6):
                    await client_ai.completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=2)
                samples = await scrape(app.url)
                text = await metrics_text(app.url)
        finally:
            await client.aclose()
    expected = {"gpu-0": named.url, plain.url.split("://")[1]: plain.url, "vllm-7": registered.url}
    for replica, url in expected.items():
        assert sample(samples, "kvroute_replica_info", replica=replica, url=url, model=MODEL) == 1
        assert sample(samples, "kvroute_requests_total", model=MODEL, replica=replica, status="200") == 2
        assert sample(samples, "kvroute_replica_healthy", replica=replica) == 1
        assert sample(samples, "kvroute_replica_prefill_tokens_per_second", replica=replica) >= 0
    # no series names a replica by its URL, but the info series' url label
    for url in expected.values():
        assert all(f'replica="{url}"' not in line for line in text.splitlines()), url


async def test_an_alerts_replica_label_drains_it_through_the_admin_api():
    """What an alert names (the label) is what the admin API takes, beside the URL."""
    async with emulated_replicas(2) as (named, other):
        replicas = [{"url": named.url, "name": "gpu-0"}, other.url]
        async with running_router(replicas, admin_token="admin-secret") as app:
            headers = {"Authorization": "Bearer admin-secret"}
            async with aiohttp.ClientSession(headers=headers) as http:
                async with http.post(app.url + "/admin/replicas/drain", json={"replica": "gpu-0"}) as resp:
                    assert resp.status == 200 and await resp.json() == {"replica": named.url, "draining": True}
                async with http.get(app.url + "/admin/replicas") as resp:
                    states = {r["label"]: (r["name"], r["draining"]) for r in (await resp.json())["replicas"]}
                assert states == {"gpu-0": (named.url, True), other.url.split("://")[1]: (other.url, False)}
                async with http.post(app.url + "/admin/replicas/undrain", json={"replica": named.url}) as resp:
                    assert resp.status == 200 and (await resp.json())["draining"] is False
                async with http.post(app.url + "/admin/replicas/drain", json={"replica": "gpu-9"}) as resp:
                    assert resp.status == 404 and (await resp.json())["error"]["code"] == "replica_not_found"


def test_a_label_two_replicas_would_share_or_the_reserved_one_falls_back_to_the_url():
    from kvroute.common.registration import ReplicaRecord
    from kvroute.router.fleet.discovery import replica_label, unique_labels

    a, b, c, d = (f"http://10.0.0.{i}:8000" for i in range(1, 5))
    labels = {
        a: replica_label(a, [None, "gpu-0"], None),  # the first name a source gives
        b: replica_label(b, ["gpu-0"], None),  # the same name again
        c: replica_label(c, [], ReplicaRecord(url=c, name="none")),  # the unrouted requests' label
        d: replica_label(d, [None], ReplicaRecord(url=d)),  # a registration named by its URL
    }
    assert labels == {a: "gpu-0", b: "gpu-0", c: "none", d: "10.0.0.4:8000"}
    assert unique_labels(labels) == {a: a, b: b, c: c, d: "10.0.0.4:8000"}
