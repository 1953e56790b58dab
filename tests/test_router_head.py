"""A long new prompt routed on its head (router/tokens/head.py, router/routing.py): the decision
the whole chain would give, the whole chain's prediction recorded soon after, and the accounting
done on the whole prompt.  Real emulated replicas, the real router, its own memory index or Redis."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from router.blocks import block_hashes
from router.proxy import Outcome
from router.requests import parse_request
from router.tokens import Tokenizer
from tests.router_support import MODEL, TINY_TOKENIZER, emulated_replicas, openai_client, running_router, scrape, total

WORDS = "the router keeps every prefix warm while replicas answer questions about caches blocks tokens".split()


def document(seed: int, n_chars: int = 16_384) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_chars // 5))[:n_chars]


def chat(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]


async def test_a_new_long_prompt_is_routed_on_its_head_and_predicted_whole_soon_after():
    async with emulated_replicas(4) as reps, running_router([r.url for r in reps]) as app:
        messages = chat(document(1), "what is cached?")
        parsed = parse_request("chat", json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode())
        decision = await app.router.route(parsed, request_id="r1", session_header=None, api_key=None)
        routed = time.perf_counter()
        assert decision.rest is not None and not decision.rest.finished  # finished after the request left

        ids = Tokenizer.from_dir(TINY_TOKENIZER).encode_chat(messages)
        whole = block_hashes(ids, app.fleet.block_size(MODEL), decision.seed)
        head = decision.chains[0]
        assert 0 < len(head) < len(whole) / 10 and whole[: len(head)] == head
        # the head's blocks are predicted at once, the whole chain's once the rest is encoded
        assert app.index.lookup_now(whole) == {decision.replica: len(head)}
        async with asyncio.timeout(10):
            while app.index.lookup_now(whole).get(decision.replica, 0) < len(whole):
                await asyncio.sleep(0.0005)
        lag_ms = (time.perf_counter() - routed) * 1e3
        print(f"whole chain predicted {lag_ms:.1f} ms after the decision ({len(ids)} tokens)")
        assert decision.rest.finished and decision.rest.chain == whole

        # accounted on the whole prompt, not the head's estimate
        app.router.report(decision, Outcome(replica=decision.replica, status=200))
        await asyncio.sleep(0.01)
        samples = await scrape(app.url)
        assert total(samples, "kvroute_prompt_tokens_total", model=MODEL) == len(ids)


async def test_a_failover_moves_the_whole_chains_prediction_to_the_new_replica():
    async with emulated_replicas(2) as reps, running_router([r.url for r in reps]) as app:
        messages = chat(document(2), "and now?")
        parsed = parse_request("chat", json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode())
        first = await app.router.route(parsed, request_id="r2", session_header=None, api_key=None)
        second = app.router.reroute(first)  # the first replica failed before its first byte
        assert second is not None and second.replica != first.replica and second.rest is first.rest
        done = asyncio.Event()
        second.rest.then(done.set)
        async with asyncio.timeout(10):
            await done.wait()
        whole = second.rest.chain
        assert app.index.lookup_now(whole) == {second.replica: len(whole), first.replica: len(first.chains[0])}
        app.router.report(second, Outcome(replica=second.replica, status=200))


@pytest.mark.parametrize("index", ["memory", "redis"])
async def test_a_second_request_sharing_the_new_text_goes_to_the_same_replica(index, request):
    overrides = {}
    if index == "redis":
        overrides = {"redis_url": request.getfixturevalue("redis_url"),
                     "redis_key_prefix": request.getfixturevalue("redis_prefix")}
    async with emulated_replicas(4) as reps, running_router([r.url for r in reps], **overrides) as app:
        client = openai_client(app)
        served, cached = [], []
        for seed in range(3):
            doc = document(100 + seed)
            for question in ("first?", "second?", "third?"):  # each sent as soon as the last was answered
                body = await client.chat.completions.create(model=MODEL, messages=chat(doc, question), max_tokens=1)
                details = body.usage.prompt_tokens_details
                cached.append(details.cached_tokens if details else 0)
            samples = await scrape(app.url)
            served.append([total(samples, "kvroute_requests_total", replica=r.url, status="200") for r in reps])
        # each document's three requests on one replica; the later two reuse nearly all of it
        for before, after in zip([[0.0] * 4, *served], served):
            assert sorted(b - a for a, b in zip(before, after)) == [0, 0, 0, 3], served
        assert all(c == 0 for c in cached[0::3]) and all(c > 3000 for i, c in enumerate(cached) if i % 3), cached
