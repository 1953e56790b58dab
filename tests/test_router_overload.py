"""The admission queue of a saturated router (router/edge/overload/): real routers on loopback in
front of a real HTTP replica that takes a fixed time per request, the official ``openai`` client.

A router with ``max_in_flight`` slots in front of a replica taking T per request serves at most
slots / T requests a second; offered more, the rest queue (at most ``max_queue_wait_s``) or get a
429 ``router_overloaded`` with Retry-After.  Bounds carry margins for a loaded 2-core machine: what
is asserted is the mechanism (who waited, who was refused, in which order), not a tight figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import logging
import shutil
import time
from typing import Any

import openai
import pytest
from aiohttp import web
from pydantic import ValidationError

from kvroute.common.errors import ApiError
from kvroute.router.config import load_settings
from kvroute.router.edge.admission import Admission
from kvroute.router.edge.overload.fair_queue import FairQueue, Queued
from kvroute.router.main import main
from kvroute.router.metrics import RouterMetrics
from tests.router_support import MODEL, RouterProcess, ScriptedReplica, openai_client, running_router, sample, scrape

MSGS = [{"role": "user", "content": "Hello there"}]
MARGIN_S = 1.0  # scheduling on a loaded machine


class PacedReplica(ScriptedReplica):
    """Answers each chat after ``delay_s`` (``slow``: other delays by user message); a stream sends
    ``chunks`` chunks ``delay_s`` apart."""

    def __init__(self, delay_s: float, chunks: int = 1, slow: dict[str, float] | None = None):
        super().__init__()
        self.delay_s, self.chunks, self.slow = delay_s, chunks, slow or {}
        self.order: list[str] = []  # the user message of each request, in the order served

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        content = body["messages"][-1]["content"]
        self.order.append(content)
        if not body.get("stream"):
            await asyncio.sleep(self.slow.get(content, self.delay_s))
            return web.json_response({
                "id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            })  # fmt: skip
        return await self.stream_tokens(request, self.chunks, self.delay_s, wait_first=True)


async def timed_chat(client: openai.AsyncOpenAI, at: float, content: str = "Hello there", **kwargs: Any) -> dict:
    """One chat sent at loop time ``at``: its status, time to answer and (for a 429) the error."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sent = time.perf_counter()
    try:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)
        return {"status": 200, "elapsed": time.perf_counter() - sent}
    except openai.RateLimitError as exc:
        return {"status": 429, "elapsed": time.perf_counter() - sent, "error": exc.body,
                "retry_after": exc.response.headers.get("Retry-After")}


def open_loop(client: openai.AsyncOpenAI, rate: float, duration_s: float, **kwargs: Any) -> list[asyncio.Task]:
    start = time.perf_counter() + 0.05
    return [asyncio.create_task(timed_chat(client, start + i / rate, **kwargs)) for i in range(int(rate * duration_s))]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def test_saturated_router_serves_within_the_budget_and_refuses_with_429_never_cutting_a_stream():
    budget = 0.5
    async with PacedReplica(delay_s=0.1, chunks=25) as rep, \
            running_router([rep.url], max_in_flight=3, max_queue_wait_s=budget, retry_after_s=2) as app:
        client = openai_client(app)

        async def whole_stream() -> list[str]:
            stream = await client.chat.completions.create(model=MODEL, messages=MSGS, stream=True)
            return [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]

        streaming = asyncio.create_task(whole_stream())  # ~2.5 s: admitted first, runs through the overload
        while app.admission.in_flight < 1:
            await asyncio.sleep(0.01)
        # 50 requests/s for 1.5 s against 2 free slots x 10/s
        results = await asyncio.gather(*open_loop(client, 50, 1.5))
        tokens = await streaming
        samples = await scrape(app.url)

    assert tokens == [f"t{i} " for i in range(25)]  # the stream ran to its end, never cut
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(served) + len(refused) == len(results) and served and refused, results
    for r in refused:  # within the budget (some at once), in OpenAI's shape, with Retry-After
        assert r["elapsed"] <= budget + MARGIN_S, r
        assert r["error"]["code"] == "router_overloaded" and set(r["error"]) == {"message", "type", "param", "code"}
        assert r["retry_after"] == "2"
    assert max(r["elapsed"] for r in served) <= budget + 0.1 + MARGIN_S
    # some were served after queueing, none after waiting past the budget
    admitted = sample(samples, "kvroute_queue_wait_seconds_count")
    assert admitted == len(served) + 1  # and the stream
    assert sample(samples, "kvroute_queue_wait_seconds_bucket", le="0.001") < admitted  # some waited
    assert sample(samples, "kvroute_queue_wait_seconds_bucket", le="0.75") == admitted
    shed = {reason: sum(sample(samples, "kvroute_shed_requests_total", reason=reason, priority=p)
                        for p in ("high", "normal", "low"))
            for reason in ("over_budget", "displaced", "timeout", "saturated", "stale")}
    assert sum(shed.values()) == len(refused), shed


async def test_a_heavy_tenant_sheds_its_own_excess_and_leaves_the_light_ones_latency():
    """Light at 4/s, heavy at 10x that, against 2 slots x 10/s: the heavy tenant alone overloads the
    router.  Fair queueing puts the light tenant's requests in front of the heavy one's backlog: none
    is shed and its p99 stays near its unloaded p99, where FIFO would queue it behind ~2 s of heavy
    (measured with a FIFO order instead: light p99 2.1 s, some of its requests shed; fair: 0.2 s)."""
    delay = 0.1
    async with PacedReplica(delay_s=delay) as rep, \
            running_router([rep.url], max_in_flight=2, max_queue_wait_s=2.0) as app:
        light, heavy = openai_client(app, api_key="light-key"), openai_client(app, api_key="heavy-key")
        alone = await asyncio.gather(*open_loop(light, 4, 2.0))
        loaded_light = open_loop(light, 4, 3.0)
        loaded_heavy = open_loop(heavy, 40, 3.0)
        light_results = await asyncio.gather(*loaded_light)
        heavy_results = await asyncio.gather(*loaded_heavy)

    assert all(r["status"] == 200 for r in alone)
    unloaded = p99([r["elapsed"] for r in alone])
    light_latency = [r["elapsed"] for r in light_results if r["status"] == 200]
    heavy_shed = sum(r["status"] == 429 for r in heavy_results)
    print(f"light unloaded p99 {unloaded * 1000:.0f} ms; loaded p50 {sorted(light_latency)[len(light_latency) // 2] * 1000:.0f}"
          f" p99 {p99(light_latency) * 1000:.0f} ms; heavy shed {heavy_shed}/{len(heavy_results)}")
    assert len(light_latency) == len(light_results), light_results  # the light tenant lost nothing
    assert heavy_shed > len(heavy_results) // 4  # the heavy one shed its excess
    # at worst a light request waits for one of the two slots to free (<= one service time)
    assert p99(light_latency) <= unloaded + 2 * delay + 0.5, (unloaded, light_latency)


async def test_a_higher_class_is_served_first_when_queued():
    async with PacedReplica(delay_s=0.05, slow={"holder": 2.0}) as rep, \
            running_router([rep.url], max_in_flight=1, max_queue_wait_s=10) as app:
        client = openai_client(app)
        holder = asyncio.create_task(timed_chat(client, 0, "holder"))
        while app.admission.in_flight < 1:
            await asyncio.sleep(0.01)
        queued = []
        for content, kwargs in (
            ("low-1", {"extra_headers": {"X-Kvroute-Priority": "low"}}),
            ("flex", {"service_tier": "flex"}),  # OpenAI's service tiers: flex is low, priority is high
            ("normal", {}),
            ("high-1", {"extra_headers": {"X-Kvroute-Priority": "HIGH"}}),
            ("priority", {"service_tier": "priority"}),
        ):
            queued.append(asyncio.create_task(timed_chat(client, 0, content, **kwargs)))
            async with asyncio.timeout(5):
                while len(app.admission.queue) < len(queued):  # each in the queue before the next is sent
                    await asyncio.sleep(0.01)
        assert not holder.done()  # all five queued behind it
        results = await asyncio.gather(holder, *queued)
        assert all(r["status"] == 200 for r in results), results
        # within a class in arrival order (one tenant: the client's address)
        assert rep.order == ["holder", "high-1", "priority", "normal", "low-1", "flex"]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers={"X-Kvroute-Priority": "urgent"})
        assert bad.value.body["code"] == "invalid_priority"


async def _logged_client(caplog, xff: str | None, **settings: Any) -> str:
    """The access log's client for one request with ``X-Forwarded-For: xff`` from 127.0.0.1."""
    caplog.clear()
    async with PacedReplica(delay_s=0) as rep, running_router([rep.url], **settings) as app:
        headers = {"X-Forwarded-For": xff} if xff is not None else {}
        await openai_client(app).chat.completions.create(model=MODEL, messages=MSGS, extra_headers=headers)
        await asyncio.sleep(0.05)  # the line is written a loop turn after the answer
    (record,) = [r for r in caplog.records if r.name == "kvroute.access"]
    return record.client


async def test_x_forwarded_for_is_honoured_only_from_a_trusted_proxy(caplog):
    caplog.set_level(logging.INFO, logger="kvroute.access")
    chain = "6.6.6.6, 10.0.0.5, 203.0.113.7"  # the client wrote 6.6.6.6; two proxies appended the rest
    assert await _logged_client(caplog, chain) == "127.0.0.1"  # no trusted proxy: the peer
    assert await _logged_client(caplog, chain, trusted_proxies="10.0.0.0/8") == "127.0.0.1"  # the peer is not one
    trusted = "127.0.0.0/8"
    assert await _logged_client(caplog, chain, trusted_proxies=trusted) == "203.0.113.7"  # rightmost untrusted
    assert await _logged_client(caplog, chain, trusted_proxies="127.0.0.1/32,203.0.113.0/24") == "10.0.0.5"
    assert await _logged_client(caplog, "6.6.6.6, not-an-ip", trusted_proxies=trusted) == "127.0.0.1"
    assert await _logged_client(caplog, None, trusted_proxies=trusted) == "127.0.0.1"


@pytest.mark.parametrize("flag, value", [
    ("--max-queue-wait-s", "-1"),
    ("--max-queue-length", "0"),
    ("--saturated-loop-lag-s", "-0.1"),
    ("--trusted-proxies", "10.0.0.300/8"),
    ("--trusted-proxies", "10.0.0.1/8"),  # host bits set: a typo for a network
    ("--tenant-weights", "key-0123456789=0"),
    ("--tenant-weights", "user:alice=-2"),
])
def test_bad_overload_settings_are_refused(flag, value, capsys):
    with pytest.raises(ValidationError):
        load_settings([flag, value])
    assert main([flag, value]) == 2  # the process says so and does not start


def test_overload_settings_parse():
    s = load_settings(["--max-queue-wait-s", "0.25", "--trusted-proxies", "10.0.0.0/8,::1/128",
                       "--tenant-weights", "user:alice=3", "--tenant-weights", "key-0123456789=0.5"])
    assert s.max_queue_wait_s == 0.25 and [str(n) for n in s.trusted_proxies] == ["10.0.0.0/8", "::1/128"]
    assert s.tenant_weights == {"user:alice": 3.0, "key-0123456789": 0.5}
    assert load_settings([]).max_queue_wait_s == 1.0 and load_settings([]).trusted_proxies == []


def test_weights_share_the_queue_and_an_idle_tenant_starts_even():
    """FairQueue alone: a tenant of weight 2 is served twice as often as one of weight 1 while both
    have a backlog; a tenant arriving late is not owed the turns it did not ask for, nor behind."""
    fair = FairQueue({"user:gold": 2.0})
    for i in range(30):
        fair.push(Queued("user:gold", 1))
        fair.push(Queued("user:plain", 1))
    served = [fair.pop().tenant for _ in range(30)]
    assert served.count("user:gold") == 20 and served.count("user:plain") == 10
    fair.push(Queued("addr:late", 1))
    assert [fair.pop().tenant for _ in range(3)].count("addr:late") == 1  # next in line, not first of all
    # the largest backlog for its weight sheds first: plain's 20 left (weight 1) over gold's 10 (weight 2)
    assert fair.last() is not None and fair.last().tenant == "user:plain"
    low = Queued("user:plain", 2)
    fair.push(low)
    assert fair.last() is low  # ... after the lowest class


async def test_a_lagging_loop_lowers_the_admission_limit_then_the_queue_drains_as_it_recovers():
    """The real Admission on this loop: a turn blocked for 0.3 s (a saturated router's long turn)
    brings the limit under what is in flight, so a new request queues though max_in_flight has room
    (--queue-when-saturated, the default; without it it is refused at once, the next test); once the lag is
    gone the limit climbs back and the request is admitted, nothing released."""
    admission = Admission(client_keys=[], admin_token=None, max_in_flight=400, retry_after_s=1,
                          metrics=RouterMetrics("cost_model"), max_queue_wait_s=5.0, saturated_loop_lag_s=0.05,
                          queue_when_saturated=True)
    admission.start()
    try:
        for _ in range(100):
            await admission.admit()
        assert admission.limit() == 400
        time.sleep(0.3)  # blocks the loop: the next tick runs 0.3 s late
        async with asyncio.timeout(5):
            while admission.limit() >= 100:
                await asyncio.sleep(0.01)
        assert admission.limit() >= 32  # never below the floor
        late = asyncio.create_task(admission.admit())
        await asyncio.sleep(0)
        assert len(admission.queue) == 1 and admission.in_flight == 100  # queued, with room under max_in_flight
        async with asyncio.timeout(5):
            await late  # the limit climbed back over 100
        assert admission.in_flight == 101 and admission.saturation.lag_s < 0.05
    finally:
        admission.stop()


async def test_a_saturated_router_refuses_at_once_what_finds_no_room():
    """With --no-queue-when-saturated a request that finds no room while the router's own CPU is
    saturated (here its loop lags) is answered 429 at once, reason ``saturated``, rather than queued
    (design.md §7.6)."""
    metrics = RouterMetrics("cost_model")
    admission = Admission(client_keys=[], admin_token=None, max_in_flight=400, retry_after_s=1,
                          metrics=metrics, max_queue_wait_s=5.0, saturated_loop_lag_s=0.05, queue_when_saturated=False)
    admission.start()
    try:
        for _ in range(100):
            await admission.admit()
        time.sleep(0.3)  # blocks the loop: the next tick runs 0.3 s late
        async with asyncio.timeout(5):
            while admission.limit() >= 100:
                await asyncio.sleep(0.01)
        started = time.perf_counter()
        with pytest.raises(ApiError) as refused:
            await admission.admit()
        assert time.perf_counter() - started < 0.05 and not len(admission.queue)
        assert refused.value.status == 429 and refused.value.code == "router_overloaded"
        assert metrics.overload.shed_requests.labels("saturated", "normal")._value.get() == 1
    finally:
        admission.stop()


async def test_a_backed_up_tokenizer_pool_lowers_the_admission_limit():
    """Jobs waiting for a tokenizer thread (the CPU new prompts cost) count as saturation too."""
    from kvroute.common.tokens import Tokenizer
    from tests.router_support import TINY_TOKENIZER

    tokenizer = Tokenizer.from_dir(TINY_TOKENIZER)
    admission = Admission(client_keys=[], admin_token=None, max_in_flight=400, retry_after_s=1,
                          metrics=RouterMetrics("cost_model"), max_queue_wait_s=5.0, saturated_loop_lag_s=0.0)
    admission.start()
    try:
        for _ in range(100):
            await admission.admit()
        jobs = [asyncio.create_task(tokenizer.run(lambda: time.sleep(0.05))) for _ in range(16 * (os.cpu_count() or 2))]
        async with asyncio.timeout(5):
            while admission.limit() >= 100:
                await asyncio.sleep(0.01)
        await asyncio.gather(*jobs)
        async with asyncio.timeout(5):  # the backlog gone, the limit climbs back
            while admission.limit() < 400:
                await asyncio.sleep(0.01)
    finally:
        admission.stop()


class InstantReplica(ScriptedReplica):
    """Answers every chat at once with a fixed completion, its body read but not parsed: the replica
    costs the test's core little, so the router's core is the one that runs out."""

    ANSWER = json.dumps({
        "id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }).encode()  # fmt: skip

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=self.ANSWER, content_type="application/json")


class RawClient:
    """Keep-alive HTTP/1.1 connections to the router, one request each at a time (an idle one
    reused, else a new one, as a pooled client under load does): each answer's status, its time
    from the send, and the body of a 429."""

    def __init__(self, port: int, head: bytes, body: bytes):
        self.port, self.head, self.body, self.sent = port, head, body, 0
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self) -> tuple[int, float, bytes]:
        sent = time.perf_counter()
        try:
            reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
            self.sent += 1  # each its own prompt (a number in front): none of it in the router's token cache
            body = b'%s%08d%s' % (self.body[:self.body.index(b"@")], self.sent, self.body[self.body.index(b"@") + 1:])
            writer.write(self.head % len(body) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            body = await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError):
            return 0, time.perf_counter() - sent, b""
        if b"connection: close" not in head.lower():
            self.idle.append((reader, writer))
        return int(head.split(None, 2)[1]), time.perf_counter() - sent, body

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


@pytest.mark.parametrize("mode", ["fair shares", "refuse when saturated"])
async def test_a_router_saturated_at_twice_its_capacity_serves_at_an_even_pace_and_refuses_fast(mode):
    """A one-worker router (pinned to one core where taskset exists; the test's client and replica
    on the other) offered twice what it serves, in chats of 4 KB that its tokenizer must encode, by
    two tenants (API keys), one at 10x the other's rate.  Short of CPU, it refuses the excess at
    once rather than letting it wait in the kernel (design.md §7.6), so its served requests keep p99
    within 3x their p50 (plus a margin for a loaded machine) and under the budget, and the 429s come
    within it (most at once).  By default (fair shares, overload/shares.py) the refusals fall on the
    heavy tenant: the light one, under its share, is served.  With --no-queue-when-saturated
    --stale-request-s 0.25 the router refuses whatever finds no room, both tenants alike.  With
    --no-fair-share-when-short (the router of before) the excess waits in the kernel: served p99 of
    seconds, nothing refused, and the test fails."""
    budget = 2.0
    content = "@ " + " ".join(f"word{i * 7 % 997} w{i}" for i in range(400))[:4096]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %%d\r\n\r\n")
    flags = ["--no-queue-when-saturated", "--stale-request-s", "0.25"] if mode != "fair shares" else []
    pinned = bool(shutil.which("taskset")) and (os.cpu_count() or 1) >= 2
    mine = os.sched_getaffinity(0)
    async with InstantReplica() as rep:
        router = await RouterProcess.start([rep.url], "--max-queue-wait-s", str(budget), "--no-access-log", *flags,
                                           *os.environ.get("KVROUTE_TEST_ROUTER_ARGS", "").split(),
                                           prefix=["taskset", "-c", "0"] if pinned else ())
        if pinned:
            os.sched_setaffinity(0, {1})
        heavy, light = (RawClient(router.port, head % key, body) for key in (b"heavy-key", b"light-key"))
        try:
            async def closed_loop(seconds: float, connections: int = 128) -> float:
                stop, statuses = time.perf_counter() + seconds, []

                async def one() -> None:
                    while time.perf_counter() < stop:
                        statuses.append((await heavy.send())[0])

                started = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(connections)))
                return statuses.count(200) / (time.perf_counter() - started)

            await closed_loop(1.0)  # warm-up: connections, the tokenizer's threads
            capacity = max([await closed_loop(1.5), await closed_loop(1.5)])  # a busy machine's dips aside
            await asyncio.sleep(0.5)
            rate, duration = 2 * capacity, 4.0
            start = time.perf_counter() + 0.05

            async def at(client: RawClient, t: float) -> tuple[int, float, bytes]:
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                return await client.send()

            light_every = 11  # one request in 11 is the light tenant's: 10x less than the heavy one
            results = await asyncio.gather(*(at(light if i % light_every == 0 else heavy, i / rate)
                                             for i in range(int(rate * duration))))
        finally:
            os.sched_setaffinity(0, mine)
            heavy.close()
            light.close()
            await router.stop()

    served = sorted(elapsed for status, elapsed, _ in results if status == 200)
    refused = sorted(elapsed for status, elapsed, _ in results if status == 429)
    light_statuses = [status for status, _, _ in results[::light_every]]
    light_refused = light_statuses.count(429) / len(light_statuses)
    heavy_refused = 1 - (len(served) - light_statuses.count(200)) / (len(results) - len(light_statuses))
    q = (lambda xs, p: round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000) if xs else None)
    print(f"{mode}: capacity {capacity:.0f} req/s, offered {rate:.0f}: served {len(served)} p50 {q(served, 0.5)} ms "
          f"p99 {q(served, 0.99)} ms; refused {len(refused)} p50 {q(refused, 0.5)} ms p99 {q(refused, 0.99)} ms; "
          f"other {len(results) - len(served) - len(refused)}; refused of light {light_refused:.0%}, "
          f"of heavy {heavy_refused:.0%}")
    p50 = served[len(served) // 2]
    assert len(served) + len(refused) == len(results)  # no connection dropped, no 5xx
    assert len(refused) > len(results) // 5  # saturated: the excess refused
    for status, _, answer in results:
        if status == 429:
            error = json.loads(answer)["error"]
            assert error["code"] == "router_overloaded" and set(error) == {"message", "type", "param", "code"}
    # margins for a loaded 2-core machine (measured: 429 p99 75-174 ms, served p99 169-299 ms against
    # a p50 of 118-163; once, at load average 7, 1.7 s and 1.2 s against 138 ms)
    # refused within the budget, nine in ten at least: the slowest 429s still cost reading their
    # request behind the excess (2.6 s once in a fresh-clone CI run; docs/experiments.md 2026-12-05)
    assert refused[int(0.9 * len(refused))] <= budget
    assert p99(served) <= budget  # no served request waited past it (before: 3.6-6.5 s)
    assert p99(served) <= 3 * p50 + 1.0, (p50, p99(served))
    if mode == "fair shares":  # the heavy tenant sheds its own excess: the light one loses far less
        # (measured 0-3 % against 63-83 %; once 25 % against 83 %, when the router's rate fell to less
        # than twice the light tenant's own and max-min fairness limited it too)
        assert 0.1 < heavy_refused and light_refused < heavy_refused / 2, (light_refused, heavy_refused)


async def test_a_request_that_waited_in_the_kernel_is_refused_but_a_pipelined_one_is_not():
    """A request whose bytes waited over --stale-request-s in the kernel before the router read them
    (here the loop blocked 0.4 s: a router short of CPU) is refused at once, reason ``stale``; a
    request pipelined behind a slow one waited in the router, not in the kernel, and is served."""
    def chat_bytes(content: str) -> bytes:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)) + body

    async def answer(reader: asyncio.StreamReader) -> tuple[int, dict]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        return int(head.split(None, 2)[1]), json.loads(await reader.readexactly(length))

    async with PacedReplica(delay_s=0.05, slow={"slow": 0.6}) as rep, \
            running_router([rep.url], max_queue_wait_s=1.0, stale_request_s=0.25, queue_when_saturated=False) as app:
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        writer.write(chat_bytes("fresh"))
        assert (await answer(reader))[0] == 200
        writer.write(chat_bytes("late"))
        await writer.drain()
        time.sleep(0.4)  # the loop blocked: the request's bytes wait in the kernel
        status, error = await answer(reader)
        assert status == 429 and error["error"]["code"] == "router_overloaded" and "waited" in error["error"]["message"]
        writer.write(chat_bytes("slow") + chat_bytes("pipelined"))  # the second read with the first
        answers = [await answer(reader), await answer(reader)]
        assert [a[0] for a in answers] == [200, 200], answers
        assert rep.order[-2:] == ["slow", "pipelined"]
        samples = await scrape(app.url)
        writer.close()
    assert sample(samples, "kvroute_shed_requests_total", reason="stale", priority="normal") == 1
