"""The official OpenAI client against the router, in front of real emulated replicas on loopback."""

from __future__ import annotations

import random

import aiohttp
import pytest

from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, sample, scrape, total, label

SYSTEM = "You are a meticulous assistant for the kvroute test suite. " * 12


@pytest.fixture
async def fleet():
    async with emulated_replicas(2) as reps:
        yield reps


@pytest.fixture
async def router(fleet):
    async with running_router([r.url for r in fleet]) as app:
        yield app


@pytest.fixture
def client(router):
    return openai_client(router, "unused")


async def test_chat_and_completions_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Say something."}]
    chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4

    chunks = [c async for c in await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"

    comp = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0

    chunks = [c async for c in await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, stream=True)]
    assert "".join(c.choices[0].text for c in chunks if c.choices)


async def test_usage_chunk_only_for_clients_that_ask(client):
    msgs = [{"role": "user", "content": "Count to three."}]
    plain = [c async for c in await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True)]
    assert plain and all(c.usage is None for c in plain)
    asked = [
        c
        async for c in await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    ]
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 3


async def test_multi_turn_conversation_reuses_cache_and_metrics_show_it(client, router):
    before = await scrape(router.url)
    for counter in ("prompt_tokens", "reuse_available_tokens", "reuse_predicted_tokens", "reuse_delivered_tokens"):
        assert sample(before, f"kvroute_{counter}_total", model=MODEL) == 0  # exists from the first scrape

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
    cached = []
    for turn in range(4):
        resp = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, user="alice")
        details = resp.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        msgs += [{"role": "assistant", "content": resp.choices[0].message.content},
                 {"role": "user", "content": f"Follow-up number {turn}?"}]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached

    after = await scrape(router.url)
    prompt = sample(after, "kvroute_prompt_tokens_total", model=MODEL)
    available = sample(after, "kvroute_reuse_available_tokens_total", model=MODEL)
    predicted = sample(after, "kvroute_reuse_predicted_tokens_total", model=MODEL)
    delivered = sample(after, "kvroute_reuse_delivered_tokens_total", model=MODEL)
    assert delivered == sum(cached)
    assert 0 < predicted <= available < prompt
    # one session, routed by its cache: every request on one replica
    per_replica = [total(after, "kvroute_requests_total", replica=r.label, status="200") for r in router.fleet.replicas()]
    assert sorted(per_replica) == [0, 4]
    assert total(after, "kvroute_routing_decisions_total", reason="cache") >= 3


async def test_request_id_passed_upstream_and_returned(router):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "req-abc.123"}) as r:
            data = await r.json()
            assert r.headers["X-Request-Id"] == "req-abc.123"
            assert data["id"] == "chatcmpl-req-abc.123"  # the replica named its answer after it
        async with s.post(router.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            rid = r.headers["X-Request-Id"]
            first = (await r.content.readline()).decode()
            assert len(rid) >= 16 and f"chatcmpl-{rid}" in first  # created, and sent upstream
            await r.read()


async def test_models_union_and_passthrough_endpoints(client, router):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}) as r:
            tokens = (await r.json())["tokens"]
            assert r.status == 200 and tokens
        async with s.post(router.url + "/detokenize", json={"tokens": tokens}) as r:  # model optional: one served
            assert r.status == 200 and "hello world" in (await r.json())["prompt"]
        async with s.post(router.url + "/tokenize", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_health_ready_and_metrics_series_from_first_scrape(router):
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/health") as r:
            assert r.status == 200
        async with s.get(router.url + "/ready") as r:
            assert r.status == 200
    first = await scrape(router.url)
    for r in router.fleet.replicas():
        assert sample(first, "kvroute_replica_healthy", replica=r.label) == 1
        assert sample(first, "kvroute_replica_in_flight", replica=r.label) == 0
        assert sample(first, "kvroute_replica_breaker_state", replica=r.label) == 0
        assert sample(first, "kvroute_requests_total", model=MODEL, replica=r.label, status="200") == 0
    assert sample(first, "kvroute_cache_hostile_prompts_total", client="other") == 0
    assert sample(first, "kvroute_routing_decisions_total", policy="cost_model", reason="cache") == 0
    assert sample(first, "kvroute_router_added_latency_seconds_count") == 0
    assert sample(first, "kvroute_index_errors_total", op="lookup", kind="timeout") == 0


async def test_cache_hostile_prompts_counted_per_client(client, router):
    document = " ".join(f"Clause {i}: replica {i % 7} keeps block {i * 31 % 97} warm." for i in range(150))
    for second in range(3):
        await client.completions.create(
            model=MODEL, prompt=f"Now: 2025-01-01 10:00:{second:02d}. {document}", max_tokens=1, user="bob"
        )
    rng = random.Random(5)
    words = ["cache", "block", "replica", "router", "token", "prefix", "engine", "queue", "tenant", "stream"]
    for second in range(3):  # new content each time: nothing to reuse, nothing hostile
        other = " ".join(rng.choice(words) for _ in range(600))
        await client.completions.create(model=MODEL, prompt=f"Now: 10:00:{second:02d}. {other}", max_tokens=1,
                                        user=f"carol-{second}")
    samples = await scrape(router.url)
    assert sample(samples, "kvroute_cache_hostile_prompts_total", client="bob") == 2  # the first one was new
    assert total(samples, "kvroute_cache_hostile_prompts_total") == 2
