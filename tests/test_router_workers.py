"""``kvroute router --workers N``: a real supervisor and its worker processes on one port, in
front of emulated replicas, driven by the official client.  Both workers serve; /metrics adds up
across them (whichever worker answers the scrape); a killed worker is started again and the
totals keep what it counted; SIGTERM drains every worker (a stream in flight ends normally) and
the supervisor exits 0; a worker that cannot start fails the whole start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai

from tests.conftest import free_port
from tests.router_support import MODEL, REPO, RouterProcess, emulated_replicas, scrape, total

DRAIN_S = 15.0
ADMIN = "admin-secret"


async def start_router(replica_urls: list[str], *args: str) -> RouterProcess:
    # a port of its own (the later --port wins over RouterProcess's 0): workers share one
    return await RouterProcess.start(replica_urls, "--port", str(free_port()), *args)


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


async def routed(client: openai.AsyncOpenAI, text: str) -> str:
    """One chat request; the X-Request-Id the router made for it (its prefix names the process)."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
        # the connection closes after the answer: every request a new one, given to either worker
        extra_headers={"Connection": "close"},
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-request-id"]


async def admin(url: str, op: str, replica: str) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        async with s.post(f"{url}/admin/replicas/{op}", json={"replica": replica}) as resp:
            assert resp.status == 200, await resp.text()


async def draining_everywhere(url: str, replica: str, draining: bool) -> None:
    """Each worker's /admin/replicas (new connections reach both) says ``replica`` is (not) draining."""
    workers = set()
    for _ in range(30):
        headers = {"Authorization": f"Bearer {ADMIN}", "Connection": "close"}
        async with aiohttp.ClientSession(headers=headers) as s, s.get(url + "/admin/replicas") as resp:
            states = {r["name"]: r["draining"] for r in (await resp.json())["replicas"]}
            workers.add(resp.headers["X-Request-Id"][:16])
        assert states[replica] is draining
    assert len(workers) == 2


async def eventually(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_two_workers_serve_add_up_restart_and_drain():
    async with emulated_replicas(2, time_scale=1.0) as reps:
        router = await start_router(
            [r.url for r in reps], "--workers", "2", "--drain-timeout-s", str(DRAIN_S), "--admin-token", ADMIN
        )
        proc, url = router.proc, router.url
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            ids = await asyncio.gather(*(routed(client, f"question {i}") for i in range(40)))
            processes = {rid[:16] for rid in ids}  # a request id is its process's prefix and a counter
            assert len(processes) == 2, processes

            async def totals(requests: int, restarts: int) -> None:
                for _ in range(6):  # whichever worker answers, the same sums
                    samples = await scrape(url)
                    assert total(samples, "kvroute_requests_total") == requests
                    assert total(samples, "kvroute_requests_total", status="200") == requests
                    assert total(samples, "kvroute_router_added_latency_seconds_count") == requests
                    assert total(samples, "kvroute_router_workers") == 2
                    assert total(samples, "kvroute_router_worker_restarts_total") == restarts
                    assert total(samples, "kvroute_in_flight") == 0
                    # one value per replica (the highest health; the lowest availability), but a
                    # learned prefill rate per worker
                    assert total(samples, "kvroute_replica_healthy") == 2
                    assert total(samples, "kvroute_index_available") == 1
                    # two replicas on one host: no KV events by convention, in every worker
                    assert total(samples, "kvroute_replica_kv_events_state", state="off") == 2
                    rates = [labels for name, labels in samples if name == "kvroute_replica_prefill_tokens_per_second"]
                    assert len(rates) == 4 and len({dict(labels)["pid"] for labels in rates}) == 2

            await totals(40, 0)

            # an admin drain reaches one worker; every worker applies it
            drained = reps[0].url
            await admin(url, "drain", drained)
            await eventually(lambda: draining_everywhere(url, drained, True))

            # a worker dies: it is started again, the drain applied; what it counted stays in the totals
            pids = worker_pids(proc.pid)
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            await eventually(lambda: totals(40, 1))
            new_pids = worker_pids(proc.pid)
            assert len(new_pids) == 2 and pids[0] not in new_pids and pids[1] in new_pids
            await draining_everywhere(url, drained, True)
            await admin(url, "undrain", drained)
            await eventually(lambda: draining_everywhere(url, drained, False))
            await asyncio.gather(*(routed(client, f"again {i}") for i in range(20)))
            await totals(60, 1)

            # SIGTERM with a stream in flight: it ends normally, then the supervisor exits 0
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 40, "stream": True}
                async with s.post(url + "/v1/chat/completions", json=body) as streaming:
                    assert streaming.status == 200
                    await streaming.content.readline()
                    signalled = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    rest = (await asyncio.wait_for(streaming.read(), DRAIN_S)).decode()
            events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert all("error" not in json.loads(e) for e in events[:-1])
            assert await asyncio.wait_for(proc.wait(), DRAIN_S) == 0
            assert time.monotonic() - signalled < DRAIN_S
        finally:
            await client.close()
            await router.stop()


async def test_a_worker_that_cannot_start_fails_the_start():
    async with emulated_replicas(1) as reps:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", str(free_port()),
            "--replicas", reps[0].url, "--tokenizer", "/nonexistent/tokenizer", "--workers", "2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO),
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"listening" not in out
    assert "before it listened" in err.decode() and "/nonexistent/tokenizer" in err.decode()
    assert time.monotonic() - started < 60


def test_workers_setting(tmp_path):
    from kvroute.router.config import load_settings, usable_cores

    assert load_settings(["--workers", "auto", "--port", "8000"]).workers == usable_cores()
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")  # no quota: the affinity
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))
    cpu_max.write_text("50000 100000\n")  # half a core: one worker
    assert usable_cores(cpu_max) == 1
    run = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "router", "--port", "0", "--workers", "2"],
        capture_output=True, text=True, cwd=str(REPO), timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "port 0 with several workers" in run.stderr


_DEPARTED = """
import os, sys, tempfile
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
from kvroute.router.metrics import RouterMetrics
m = RouterMetrics("round_robin")
m.know_model("tiny", ["a", "b"])
m.requests.labels("tiny", "a", "200").inc(3)
m.requests.labels("tiny", "b", "200").inc(4)
m.requests.labels("unknown", "none", "400").inc()
m.bind_replicas(lambda: [("a", True, "closed", 2, 10, 5e3), ("b", False, "open", 1, 0, 7e3)])
m.publish()
m.forget_replica("b")
sys.stdout.write(m.render({"a"}).decode())
"""


def test_multiprocess_metrics_hide_departed_replicas_and_read_live_values():
    """In multiprocess mode (a fresh interpreter: prometheus-client chooses at import), the
    series single-process mode drops for a replica that left are hidden, the unrouted ones kept,
    and the per-replica gauges read at scrape time are there."""
    from prometheus_client.parser import text_string_to_metric_families

    run = subprocess.run([sys.executable, "-c", _DEPARTED], capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert run.returncode == 0, run.stderr
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(run.stdout)
        for s in family.samples
    }
    assert total(samples, "kvroute_requests_total", replica="a") == 3
    assert total(samples, "kvroute_requests_total", replica="none") == 1
    assert total(samples, "kvroute_replica_in_flight", replica="a") == 2
    assert total(samples, "kvroute_replica_queued_prefill_tokens", replica="a") == 10
    assert not [key for key in samples if ("replica", "b") in key[1]]
    assert "Removal of labels" not in run.stderr  # nothing asked of the files that they cannot do


async def test_without_redis_every_worker_follows_the_kv_events(redis_url, redis_prefix):
    """The in-memory index (Redis only for discovery, where replicas register their KV-event
    endpoints): every worker subscribes to every replica, so a prefix one worker routed is known
    to the other through the engine's events, and a follow-up reaching either worker goes where the
    prefix is cached.  Without the events the other worker would know nothing: with 3 replicas, 4
    prefixes all reaching the cache holder by luck is 1 chance in 81 per attempt."""
    import redis.asyncio as aioredis

    from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
    from kvroute.common.registration import ReplicaRecord, register

    reps = []
    for _ in range(3):
        events, replay = f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"
        reps.append(EmulatedReplica(ReplicaConfig(model=MODEL, time_scale=0.0, events_endpoint=events, replay_endpoint=replay)))
    store = aioredis.Redis.from_url(redis_url)
    router = None
    try:
        for rep in reps:
            await rep.start()
            record = ReplicaRecord(url=rep.url, model=MODEL, events_endpoint=rep.config.events_endpoint,
                                   replay_endpoint=rep.config.replay_endpoint)  # fmt: skip
            await register(store, redis_prefix, record, ttl=60)
        router = await start_router(
            [], "--workers", "2", "--fleet.discovery-redis", "--fleet.redis-url", redis_url,
            "--fleet.redis-key-prefix", redis_prefix,
        )  # fmt: skip
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)

        async def cached(system: str, question: str) -> tuple[str, int]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=1, extra_headers={"Connection": "close"},
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            )  # fmt: skip
            details = raw.parse().usage.prompt_tokens_details
            return raw.headers["x-request-id"][:16], (details.cached_tokens or 0) if details else 0

        async def all_up() -> None:
            samples = await scrape(router.url)
            assert total(samples, "kvroute_replica_healthy") == 3

        await eventually(all_up)
        for attempt in range(3):
            systems = [f"Attempt {attempt}, topic {t}: " + " ".join(f"fact {t}.{i}" for i in range(300)) for t in range(4)]
            for system in systems:
                await cached(system, "first")

            async def events_settled(before: list[float] = [-1.0]) -> None:  # noqa: B006 - the last total seen
                now = total(await scrape(router.url), "kvroute_kv_events_applied_total", type="BlockStored")
                settled, before[0] = now == before[0] and now > 0, now
                assert settled
                await asyncio.sleep(0.5)

            await eventually(events_settled)
            answers = [await cached(system, f"follow-up {i}") for system in systems for i in range(4)]
            workers = {worker for worker, _ in answers}
            if len(workers) == 2 and all(hits > 0 for _, hits in answers):
                break
        else:
            raise AssertionError(f"follow-ups missed the cache on some worker: {answers}")
        await client.close()
    finally:
        if router is not None:
            await router.stop()
        await store.aclose()
        for rep in reps:
            await rep.stop()
