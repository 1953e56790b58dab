"""The emulated replica end to end: real HTTP on loopback, the official openai client, real ZMQ.

KV events are read off the wire with msgspec's schemaless msgpack decoder (never the publisher's
own structs), so these tests pin vLLM's format as a subscriber sees it.  Expected values are
derived from the inputs (token counts from /tokenize, block counts from the block size), not
copied from a run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvroute.replica.cli import main as replica_main
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from kvroute.common.tokens import Tokenizer
from tests.conftest import free_port
from tests.router_support import label

ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = ROOT / "tests" / "assets" / "tiny-tokenizer"
MODEL = "tiny-emulated"
BS = 16  # the cpu-tiny profile's block size
SETTLE_S = 0.3  # ZMQ slow joiner: let a new SUB's subscription reach the PUB before publishing


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TINY_TOKENIZER)


def make_replica(tokenizer: Tokenizer, **overrides) -> EmulatedReplica:
    config = dict(model=MODEL, profile="cpu-tiny", time_scale=0.2,
                  events_endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{free_port()}")
    config.update(overrides)
    return EmulatedReplica(ReplicaConfig(**config), tokenizer=tokenizer)


@pytest.fixture
async def replica(tokenizer):
    r = make_replica(tokenizer)
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
async def client(replica):
    c = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def subscribe(endpoint: str) -> zmq.asyncio.Socket:
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    await asyncio.sleep(SETTLE_S)
    return sub


async def events_until(sub: zmq.asyncio.Socket, done, timeout: float = 5.0) -> list[tuple[int, list]]:
    """(seq, decoded batch) messages until ``done(events so far)`` holds."""
    got: list[tuple[int, list]] = []

    async def loop():
        while not done([e for _, batch in got for e in batch[1]]):
            topic, seq, payload = await sub.recv_multipart()
            assert topic == b"kv"
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))

    await asyncio.wait_for(loop(), timeout)
    return got


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, list]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: dict[str, list], name: str, **labels) -> float:
    for family in samples.values():
        for s in family:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# OpenAI protocol through the official client


async def test_completion_and_chat_non_streaming(client, tokenizer):
    prompt = "Tell me about the router and its cache."
    n_prompt = len(tokenizer.encode_prompt(prompt))
    comp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=7)
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion" and comp.model == MODEL
    assert len(comp.choices) == 1 and comp.choices[0].finish_reason == "length" and comp.choices[0].text
    assert comp.usage.prompt_tokens == n_prompt
    assert comp.usage.completion_tokens == 7 and comp.usage.total_tokens == n_prompt + 7

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    n_chat = len(tokenizer.encode_chat(messages))
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    msg = chat.choices[0].message
    assert msg.role == "assistant" and msg.content and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_chat, 5)
    # without max_tokens a chat "stops" by itself after the configured default length
    free = await client.chat.completions.create(model=MODEL, messages=messages)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens == 16


async def test_streaming_matches_non_streaming(client):
    prompt = "Streaming should deliver the same text, token by token."
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True})]
    *content, usage_chunk = chunks
    assert len(content) > 1  # incremental, not one blob
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": prompt}]
    whole_chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole_chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole_chat.usage.total_tokens
    # no usage chunk unless asked for
    plain = [c async for c in await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                                     stream=True)]
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


async def test_continuous_usage_stats(client):
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


async def test_cached_tokens_grow_with_a_repeated_and_extended_prompt(client):
    first = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    turn2 = first + list(range(500, 530))  # 70 tokens: 4 full blocks + 6

    async def cached(prompt: list[int]) -> int:
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details else 0  # vLLM leaves the details out at 0

    assert await cached(first) == 0
    assert await cached(first) == 2 * BS  # its full blocks; the partial one is never cached
    assert await cached(turn2) == 2 * BS  # the shared prefix's full blocks
    assert await cached(turn2) == 4 * BS
    # streaming reports it too, in the usage chunk
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=turn2, max_tokens=2, stream=True, stream_options={"include_usage": True})]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4 * BS


async def test_cache_salt_separates_tenants(client):
    prompt = list(range(1000, 1050))

    async def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    assert await cached("tenant-a") == 0
    assert await cached("tenant-b") == 0
    assert await cached(None) == 0
    assert await cached("tenant-a") == 3 * BS


async def test_prompt_forms_and_request_id(replica, http):
    for prompt in ("a plain string", ["a one-element list"], [5, 6, 7], [[5, 6, 7]]):
        async with http.post(replica.url + "/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
    async with http.post(replica.url + "/v1/completions", headers={"X-Request-Id": "trace-42"},
                         json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as resp:
        assert resp.headers["X-Request-Id"] == "trace-42"
        assert (await resp.json())["id"] == "cmpl-trace-42"
    async with http.post(replica.url + "/v1/chat/completions", headers={"X-Request-Id": "trace-43"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                               "max_tokens": 2}) as resp:
        assert resp.headers["X-Request-Id"] == "trace-43"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        body = await resp.text()
    frames = body.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert all(f.startswith("data: {") for f in frames[:-2])
    assert msgspec.json.decode(frames[0][len("data: "):])["id"] == "chatcmpl-trace-43"


async def test_instant_time_scale_answers(tokenizer):
    async with make_replica(tokenizer, time_scale=0.0, events_endpoint=None, replay_endpoint=None) as r:
        c = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        outs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20)
                                      for i in range(8)))
        await c.close()
    assert all(o.usage.completion_tokens == 20 for o in outs)


async def test_replicas_in_one_process_are_independent(tokenizer, http):
    replicas = [make_replica(tokenizer) for _ in range(3)]
    for r in replicas:
        await r.start()
    try:
        assert len({r.url for r in replicas}) == 3
        async with http.post(replicas[0].url + "/v1/completions",
                             json={"model": MODEL, "prompt": list(range(40)), "max_tokens": 3}) as resp:
            assert resp.status == 200
        scraped = [await metrics(http, r.url) for r in replicas]
        assert value(scraped[0], "vllm:generation_tokens_total") == 3
        assert [value(m, "vllm:generation_tokens_total") for m in scraped[1:]] == [0, 0]
    finally:
        for r in replicas:
            await r.stop()


async def test_stop_with_a_request_in_flight(tokenizer, http):
    r = make_replica(tokenizer)
    await r.start()
    body = {"model": MODEL, "prompt": "never ending", "max_tokens": 15000, "stream": True}
    async with http.post(r.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        await asyncio.wait_for(r.stop(), 10)  # the grace period runs out, the request is cut
        with pytest.raises(aiohttp.ClientError):
            await resp.read()
    assert r.engine.num_running == 0 and r.engine.kv_usage == 0


async def test_engine_failure_ends_requests_and_fails_health(tokenizer, http):
    async with make_replica(tokenizer, events_endpoint=None, replay_endpoint=None) as r:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10000, "stream": True}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")

            def broken(now: float) -> list:
                raise RuntimeError("injected engine fault")

            r.engine.run_until = broken  # fault injection: the next step fails
            frames = (await asyncio.wait_for(resp.text(), 10)).split("\n\n")
        assert frames[-2] == "data: [DONE]"  # the stream ends instead of hanging
        assert msgspec.json.decode(frames[-3][len("data: "):])["choices"][0]["finish_reason"] == "abort"
        async with http.get(r.url + "/health") as resp:
            assert_error(resp.status, await resp.json(), 503)
        async with http.post(r.url + "/v1/completions", json={**body, "stream": False}) as resp:
            assert_error(resp.status, await resp.json(), 503)


async def test_chat_tools_enter_the_prompt(client, replica, http):
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    with_tools = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1)
    async with http.post(replica.url + "/tokenize", json={"messages": messages, "tools": tools}) as resp:
        count = (await resp.json())["count"]
    assert with_tools.usage.prompt_tokens == count > plain.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------
# Other endpoints


async def test_models_health_tokenize_detokenize(replica, http, tokenizer):
    async with http.get(replica.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == replica.max_model_len
    async with http.get(replica.url + "/health") as resp:
        assert resp.status == 200

    text = "Hello there, tokenizer."
    async with http.post(replica.url + "/tokenize", json={"model": MODEL, "prompt": text}) as resp:
        tok = await resp.json()
    assert tok["tokens"] == tokenizer.encode_prompt(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == replica.max_model_len
    messages = [{"role": "user", "content": text}]
    async with http.post(replica.url + "/tokenize", json={"model": MODEL, "messages": messages}) as resp:
        chat_tok = await resp.json()
    async with http.post(replica.url + "/v1/chat/completions",
                         json={"model": MODEL, "messages": messages, "max_tokens": 1}) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == chat_tok["count"]
    async with http.post(replica.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}) as resp:
        assert (await resp.json())["prompt"] == text


# ---------------------------------------------------------------------------------------------
# Metrics


async def test_metrics_follow_requests(replica, client, http):
    before = await metrics(http, replica.url)
    labels = {"model_name": MODEL, "engine": "0"}
    info = before["vllm:cache_config_info"][0].labels
    assert info["block_size"] == str(BS) and info["num_gpu_blocks"] == str(replica.num_gpu_blocks)
    assert info["enable_prefix_caching"] == "True" and "prefix_caching_hash_algo" in info
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(before, name, **labels) == 0

    prompt = list(range(2000, 2050))  # 50 tokens, 3 full blocks
    for _ in range(2):
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    after = await metrics(http, replica.url)

    def delta(name: str, **more: str) -> float:
        return value(after, name, **labels, **more) - value(before, name, **labels, **more)

    assert delta("vllm:prompt_tokens_total") == 2 * len(prompt)
    assert delta("vllm:generation_tokens_total") == 2 * 4
    assert delta("vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert delta("vllm:prefix_cache_hits_total") == 3 * BS
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:request_success_total", finished_reason="length") == 2


async def test_running_gauge_and_disconnect_abort(replica, http):
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 5000, "stream": True}
    async with http.post(replica.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token is out: the request is running
        during = await metrics(http, replica.url)
        assert value(during, "vllm:num_requests_running", model_name=MODEL) == 1
        assert value(during, "vllm:kv_cache_usage_perc", model_name=MODEL) > 0
    # leaving the block closed the connection: the replica aborts the request in its engine
    for _ in range(200):
        now = await metrics(http, replica.url)
        if value(now, "vllm:num_requests_running", model_name=MODEL) == 0:
            break
        await asyncio.sleep(0.02)
    assert value(now, "vllm:num_requests_running", model_name=MODEL) == 0
    assert value(now, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0
    assert value(now, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(now, "vllm:generation_tokens_total") < 5000

    # a non-streaming client that gives up is aborted too
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(http.post(replica.url + "/v1/completions", json={**body, "stream": False}), 0.3)
    for _ in range(200):
        now = await metrics(http, replica.url)
        if value(now, "vllm:request_success_total", finished_reason="abort") == 2:
            break
        await asyncio.sleep(0.02)
    assert value(now, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(now, "vllm:num_requests_running", model_name=MODEL) == 0


# ---------------------------------------------------------------------------------------------
# Errors


def assert_error(status: int, body: dict, want_status: int, param: str | None = None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == want_status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param


BAD_BODIES = [
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [-1, 2]}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": 7}, 400, "cache_salt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -3}, 400, None),
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": ["not", "a string"]}, 400, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_BODIES)
async def test_bad_bodies_get_errors_in_shape(replica, http, path, body, status, param):
    async with http.post(replica.url + path, json=body) as resp:
        assert_error(resp.status, await resp.json(), status, param)


async def test_malformed_requests(replica, http, tokenizer):
    for raw in (b"{not json", b"", b"[1, 2]", b"\xff\xfe"):
        async with http.post(replica.url + "/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"}) as resp:
            assert_error(resp.status, await resp.json(), 400)
    async with http.get(replica.url + "/no/such/route") as resp:
        assert_error(resp.status, await resp.json(), 404)
    async with http.get(replica.url + "/v1/completions") as resp:
        assert_error(resp.status, await resp.json(), 405)
    too_long = "word " * (replica.max_model_len + 10)
    async with http.post(replica.url + "/v1/completions", json={"model": MODEL, "prompt": too_long}) as resp:
        assert_error(resp.status, await resp.json(), 400)


async def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="x", n=3)


async def test_api_key(tokenizer, http):
    async with make_replica(tokenizer, api_key="s3cret", events_endpoint=None, replay_endpoint=None) as r:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            async with http.post(r.url + "/v1/completions", json=body, headers=headers) as resp:
                assert_error(resp.status, await resp.json(), 401)
        async with http.post(r.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
        async with http.get(r.url + "/health") as resp:  # as in vLLM, only /v1 routes need the key
            assert resp.status == 200
        c = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="s3cret", max_retries=0)
        assert (await c.models.list()).data[0].id == MODEL
        await c.close()


# ---------------------------------------------------------------------------------------------
# KV events on the wire


async def test_block_stored_events_chain_and_carry_token_ids(replica, client):
    sub = await subscribe(replica.events_endpoint)
    try:
        first = list(range(3000, 3000 + 3 * BS + 5))  # 3 full blocks
        await client.completions.create(model=MODEL, prompt=first, max_tokens=1)
        got = await events_until(sub, lambda ev: sum(len(e["block_hashes"]) for e in of_type(ev, "BlockStored")) >= 3)
        second = first[: 3 * BS] + list(range(3500, 3500 + 2 * BS))  # shares 3 blocks, adds 2
        await client.completions.create(model=MODEL, prompt=second, max_tokens=1)
        got += await events_until(sub, lambda ev: sum(len(e["block_hashes"]) for e in of_type(ev, "BlockStored")) >= 2)
    finally:
        sub.close()

    seqs = [seq for seq, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous: one batch per step, no gap
    for _, batch in got:
        ts, events, rank = batch  # EventBatch is positional
        assert isinstance(ts, float) and rank == 0 and events
    stored = [e for _, batch in got for e in of_type(batch[1], "BlockStored")]
    chain, tokens, parent = [], [], None
    # first prompt's blocks: a chain from the root, token_ids exactly its full blocks
    first_events = []
    for e in stored:
        first_events.append(e)
        if sum(len(x["block_hashes"]) for x in first_events) == 3:
            break
    for e in first_events:
        assert e["parent_block_hash"] == parent
        assert e["block_size"] == BS and len(e["token_ids"]) == BS * len(e["block_hashes"])
        assert e["medium"] == "GPU" and e["lora_name"] is None
        assert len(e["extra_keys"]) == len(e["block_hashes"])
        chain += e["block_hashes"]
        tokens += e["token_ids"]
        parent = e["block_hashes"][-1]
    assert tokens == first[: 3 * BS] and len(set(chain)) == 3
    # the second prompt stores only its 2 new blocks, chained to the shared prefix's last block
    rest = stored[len(first_events):]
    assert rest[0]["parent_block_hash"] == chain[-1]
    assert [t for e in rest for t in e["token_ids"]] == second[3 * BS:]
    assert sum(len(e["block_hashes"]) for e in rest) == 2


async def test_salted_chain_lists_its_salt_in_extra_keys(replica, client):
    sub = await subscribe(replica.events_endpoint)
    try:
        await client.completions.create(model=MODEL, prompt=list(range(50, 50 + 2 * BS)), max_tokens=1,
                                        extra_body={"cache_salt": "tenant-z"})
        got = await events_until(sub, lambda ev: bool(of_type(ev, "BlockStored")))
    finally:
        sub.close()
    first = of_type([e for _, b in got for e in b[1]], "BlockStored")[0]
    assert first["parent_block_hash"] is None
    assert first["extra_keys"][0] == ["tenant-z"] and all(k is None for k in first["extra_keys"][1:])


async def test_eviction_emits_block_removed(tokenizer, client):
    # 8 blocks of 16 tokens: a second large prompt must reuse the first one's cached blocks.
    async with make_replica(tokenizer, num_gpu_blocks=8) as r:
        c = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        sub = await subscribe(r.events_endpoint)
        try:
            a = list(range(10, 10 + 3 * BS))
            await c.completions.create(model=MODEL, prompt=a, max_tokens=1)
            got = await events_until(sub, lambda ev: sum(len(e["block_hashes"]) for e in of_type(ev, "BlockStored")) >= 3)
            stored_a = {h for e in of_type([e for _, b in got for e in b[1]], "BlockStored") for h in e["block_hashes"]}
            b = list(range(900, 900 + 7 * BS - 2))  # needs 7 of the 8 blocks
            await c.completions.create(model=MODEL, prompt=b, max_tokens=1)
            got = await events_until(sub, lambda ev: bool(of_type(ev, "BlockRemoved")))
        finally:
            sub.close()
            await c.close()
    removed = {h for e in of_type([e for _, bt in got for e in bt[1]], "BlockRemoved") for h in e["block_hashes"]}
    assert removed and removed <= stored_a
    assert all(e["medium"] == "GPU" for e in of_type([e for _, bt in got for e in bt[1]], "BlockRemoved"))


async def test_reset_prefix_cache_clears_and_announces(replica, client, http):
    prompt = list(range(3700, 3700 + 2 * BS + 3))
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    sub = await subscribe(replica.events_endpoint)
    try:
        async with http.post(replica.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        got = await events_until(sub, lambda ev: bool(of_type(ev, "AllBlocksCleared")))
    finally:
        sub.close()
    assert {"type": "AllBlocksCleared"} in got[-1][1][1]
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert out.usage.prompt_tokens_details is None  # nothing cached any more


async def test_replay_over_a_dealer(replica, client):
    sub = await subscribe(replica.events_endpoint)
    try:
        for i in range(3):
            await client.completions.create(model=MODEL, prompt=list(range(i * 100, i * 100 + 2 * BS)), max_tokens=1)
        live = await events_until(sub, lambda ev: len(of_type(ev, "BlockStored")) >= 3)
    finally:
        sub.close()
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replica.replay_endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        dealer.close()
    *batches, end = replies
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert all(f[0] == b"" and f[1] == b"kv" for f in batches)
    replayed = {int.from_bytes(f[2], "big"): msgspec.msgpack.decode(f[3]) for f in batches}
    assert sorted(replayed) == list(range(len(replayed)))  # from seq 0, no gap
    for seq, batch in live:
        assert replayed[seq] == batch  # the same bytes' content as the live stream


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        replica_main(["--model", "m", "--time-scale", "-1"])
    assert exc.value.code == 2


async def test_cli_serves_until_sigterm(http):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvroute.replica.cli import main; sys.exit(main(sys.argv[1:]))",
         "--engine", "emulated", "--model", MODEL, "--port", str(port), "--profile", "cpu-tiny",
         "--tokenizer", str(TINY_TOKENIZER), "--events-endpoint", f"tcp://*:{free_port()}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.startswith(f"http://127.0.0.1:{port}"), (line, proc.stderr.read() if proc.poll() else "")
        async with http.post(f"http://127.0.0.1:{port}/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes


async def test_cli_registers_in_redis_and_routers_follow_its_events(http, redis_url, redis_prefix):
    import redis.asyncio as aioredis

    from kvroute.router.app import RouterApp
    from kvroute.router.config import RouterSettings
    from kvroute.common.registration import list_replicas

    port, events_port, replay_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvroute.replica.cli import main; sys.exit(main(sys.argv[1:]))",
         "--engine", "emulated", "--model", MODEL, "--host", "0.0.0.0", "--port", str(port),
         "--advertise-host", "127.0.0.1", "--profile", "cpu-tiny", "--tokenizer", str(TINY_TOKENIZER),
         "--events-endpoint", f"tcp://*:{events_port}", "--replay-endpoint", f"tcp://*:{replay_port}",
         "--redis-url", redis_url, "--redis-key-prefix", redis_prefix, "--drain-grace", "0.2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    redis = aioredis.Redis.from_url(redis_url)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        url = f"http://127.0.0.1:{port}"
        assert line.startswith(url), (line, proc.stderr.read() if proc.poll() else "")
        (record,) = await list_replicas(redis, redis_prefix)  # registered before the ready line
        assert (record.url, record.engine, record.model) == (url, "emulated", MODEL)
        assert record.events_endpoint == f"tcp://127.0.0.1:{events_port}"
        assert record.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
        assert record.block_size and record.capacity_blocks

        # a router that knows no replica finds it in Redis and confirms its blocks from its events
        settings = RouterSettings(
            host="127.0.0.1", port=0, replicas=[], tokenizer=str(TINY_TOKENIZER), redis_url=redis_url,
            redis_key_prefix=redis_prefix, log_level="warning",
            fleet={"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix,
                   "health_interval_s": 0.2},
        )
        router = RouterApp(settings)
        await router.start()
        try:
            client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
            for _ in range(100):
                async with http.get(router.url + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
            words = " ".join(f"word{i}" for i in range(200))
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=2)
            applied = 0.0
            for _ in range(100):
                async with http.get(router.url + "/metrics") as resp:
                    text = await resp.text()
                applied = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                              if s.name == "kvroute_kv_events_applied_total" and s.labels.get("replica") == label(url))
                if applied:
                    break
                await asyncio.sleep(0.1)
            assert applied > 0
            await client.close()
        finally:
            await router.stop()

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
        assert await list_replicas(redis, redis_prefix) == []  # deregistered on the way out
    finally:
        await redis.aclose()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
