"""/v1/responses through the router with the official client, in front of real emulated replicas
that serve it as vLLM does (instructions, input items, previous_response_id from their own store)."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from kvroute.common.requests import ParsedRequest
from kvroute.router.request.response_memory import ResponseMemory
from kvroute.common.responses import parse_responses
from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, sample, scrape

LONG = "Tell me about the history of prefix caching in inference engines, in detail. " * 12


def _holder(reps, response_id: str):
    """The replica that stored ``response_id`` (each replica keeps its own, as vLLM does)."""
    held = [r for r in reps if response_id in r.handlers.stored_responses]
    assert len(held) == 1, response_id
    return held[0]


async def test_plain_and_streamed_responses():
    async with emulated_replicas(2) as reps, running_router([r.url for r in reps]) as app:
        client = openai_client(app)
        whole = await client.responses.create(model=MODEL, input="Say something.", max_output_tokens=4)
        assert whole.id.startswith("resp_") and whole.output_text and whole.usage.output_tokens == 4
        assert whole.usage.input_tokens > 0 and whole.usage.input_tokens_details.cached_tokens == 0

        stream = await client.responses.create(
            model=MODEL, instructions="Be brief.", max_output_tokens=5, stream=True,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
        )
        events = [e async for e in stream]  # the SDK raises on an error event: none was appended
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas and deltas == events[-1].response.output_text and events[-1].response.usage.output_tokens == 5

        # on the wire: the replica's events as they were, nothing added after response.completed
        async with aiohttp.ClientSession() as s, s.post(
            app.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 2}
        ) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = [e for e in (await r.read()).decode().split("\n\n") if e.strip()]
        assert events[-1].startswith("event: response.completed\n") and "[DONE]" not in events[-1]


@pytest.mark.parametrize("stream", [False, True])
async def test_previous_response_id_sticks_to_the_replica_that_stored_it(stream):
    # round_robin would send every turn elsewhere, where the previous response is unknown (404):
    # only the pin keeps a conversation on its replica
    async with emulated_replicas(3) as reps, running_router([r.url for r in reps], policy="round_robin") as app:
        client = openai_client(app)
        for conversation in range(3):
            previous = None
            holder = None
            for turn in range(3):
                kw = dict(model=MODEL, input=f"Conversation {conversation}, turn {turn}: go on.", max_output_tokens=3,
                          instructions="Be brief." if turn == 0 else None, previous_response_id=previous)
                if stream:
                    events = [e async for e in await client.responses.create(**kw, stream=True)]
                    previous = events[-1].response.id
                else:
                    previous = (await client.responses.create(**kw)).id
                here = _holder(reps, previous)
                assert holder in (None, here)
                holder = here
        assert len(app.responses) == 9


async def test_the_router_hashes_the_prefix_the_replica_caches():
    """Predicted reuse (the router's rendering of instructions + stored history + input) equals
    what the engines report as cached, turn after turn, streamed or not."""
    async with emulated_replicas(2) as reps, running_router([r.url for r in reps]) as app:
        client = openai_client(app)
        previous, cached = None, []
        for turn in range(4):
            kw = dict(model=MODEL, input=LONG if turn == 0 else f"Follow-up {turn}?", max_output_tokens=6,
                      previous_response_id=previous, instructions="You are terse." if turn == 0 else None)
            if turn % 2:
                events = [e async for e in await client.responses.create(**kw, stream=True)]
                answer = events[-1].response
            else:
                answer = await client.responses.create(**kw)
            previous = answer.id
            cached.append(answer.usage.input_tokens_details.cached_tokens)
        assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
        samples = await scrape(app.url)
        predicted = sample(samples, "kvroute_reuse_predicted_tokens_total", model=MODEL)
        delivered = sample(samples, "kvroute_reuse_delivered_tokens_total", model=MODEL)
        assert delivered == sum(cached) and predicted == delivered


BAD = [
    ({"input": "x"}, "missing_required_parameter", "model"),
    ({"model": MODEL}, "missing_required_parameter", "input"),
    ({"model": MODEL, "input": ""}, "invalid_type", "input"),
    ({"model": MODEL, "input": []}, "invalid_type", "input"),
    ({"model": MODEL, "input": 3}, "invalid_type", "input"),
    ({"model": MODEL, "input": [{"content": "no role"}]}, "missing_required_parameter", "input.0.role"),
    ({"model": MODEL, "input": [{"role": "user", "content": 5}]}, "invalid_type", "input.0.content"),
    ({"model": MODEL, "input": "x", "instructions": 5}, "invalid_type", "instructions"),
    ({"model": MODEL, "input": "x", "previous_response_id": ""}, "invalid_type", "previous_response_id"),
    ({"model": MODEL, "input": "x", "stream": "yes"}, "invalid_type", "stream"),
    ({"model": MODEL, "input": "x", "max_output_tokens": -1}, "invalid_type", "max_output_tokens"),
]


@pytest.mark.parametrize("body, code, param", BAD)
async def test_bad_bodies_are_400_in_openai_shape(body, code, param):
    async with emulated_replicas(1) as reps, running_router([reps[0].url]) as app:
        async with aiohttp.ClientSession() as s, s.post(app.url + "/v1/responses", data=json.dumps(body)) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and set(err) == {"message", "type", "param", "code"}
            assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")


async def test_unknown_previous_response_is_the_replicas_404_and_an_unknown_model_the_routers():
    async with emulated_replicas(1) as reps, running_router([reps[0].url]) as app:
        client = openai_client(app)
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
        assert "resp_nope" in info.value.body["message"]
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model="nope", input="x")
        assert info.value.body["code"] == "model_not_found"


def _turn(memory: ResponseMemory, rid: str, previous: str | None, text: str) -> ParsedRequest:
    body = {"model": MODEL, "input": text, "previous_response_id": previous}
    parsed = parse_responses(json.dumps(body).encode())
    session, _ = memory.prepare(parsed)
    memory.remember(parsed, "r1", {"id": rid, "output": [{"type": "message", "content": [
        {"type": "output_text", "text": f"answer to {text}"}]}]}, session)
    return parsed


def test_memory_renders_the_chain_and_forgets_oldest_first_within_its_budget():
    memory = ResponseMemory(max_chars=2_000)
    _turn(memory, "a", None, "first")
    _turn(memory, "b", "a", "second")
    assert memory.history("b") == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "answer to first"},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "answer to second"},
    ]
    parsed = parse_responses(json.dumps({"model": MODEL, "input": "third", "previous_response_id": "b"}).encode())
    assert memory.prepare(parsed) == ("a", "r1")  # the conversation's first id is its session
    assert parsed.render_body["messages"][-1] == {"role": "user", "content": "third"}
    for i in range(20):  # each turn costs its body and outputs (+200): the budget keeps a few
        _turn(memory, f"x{i}", None, "filler " * 10)
    assert memory.chars <= 2_000 and "a" not in memory._turns and memory.history("x19") is not None
    assert memory.prepare(parsed) == ("b", None)  # forgotten: the unknown id becomes the session key


async def test_the_emulated_replica_stores_only_what_it_is_asked_to():
    async with emulated_replicas(1) as (rep,):
        async with openai.AsyncOpenAI(base_url=rep.url + "/v1", api_key="x", max_retries=0) as client:
            kept = await client.responses.create(model=MODEL, input="Keep this.", max_output_tokens=2)
            dropped = await client.responses.create(model=MODEL, input="Not this.", max_output_tokens=2, store=False)
            follow = await client.responses.create(model=MODEL, input="And?", max_output_tokens=2,
                                                   previous_response_id=kept.id)
            assert follow.usage.input_tokens > kept.usage.input_tokens
            with pytest.raises(openai.NotFoundError):
                await client.responses.create(model=MODEL, input="And?", previous_response_id=dropped.id)


async def test_the_emulated_replica_retrieves_and_refuses_to_cancel_as_vllm_does():
    async with emulated_replicas(1) as (rep,):
        async with openai.AsyncOpenAI(base_url=rep.url + "/v1", api_key="x", max_retries=0) as client:
            made = await client.responses.create(model=MODEL, input="Keep this.", max_output_tokens=2)
            got = await client.responses.retrieve(made.id)
            assert got.id == made.id and got.output_text == made.output_text and got.status == "completed"
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
                await client.responses.cancel(made.id)  # vLLM cancels only background responses in progress
            for call in (client.responses.retrieve, client.responses.cancel):
                with pytest.raises(openai.NotFoundError, match="resp_nope"):
                    await call("resp_nope")


async def test_a_response_is_retrieved_cancelled_and_continued_through_another_router(redis_url, redis_prefix):
    """Router A relays the responses; router B, sharing only Redis with A, finds the replica of each
    id for a GET, a cancel and a previous_response_id.  round_robin sends a request without a pin
    to each replica in turn, where the id is unknown (404): three conversations all landing right
    by chance would be 1 in 27."""
    async with emulated_replicas(3) as reps:
        urls = [r.url for r in reps]
        shared = {"redis_url": redis_url, "redis_key_prefix": redis_prefix, "policy": "round_robin"}
        async with running_router(urls, **shared) as a, running_router(urls, **shared) as b:
            via_a, via_b = openai_client(a), openai_client(b)
            for conversation in range(3):
                made = await via_a.responses.create(model=MODEL, input=f"Conversation {conversation}.",
                                                    max_output_tokens=3)
                holder = _holder(reps, made.id)
                got = await via_b.responses.retrieve(made.id)
                assert got.id == made.id and got.output_text == made.output_text
                with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
                    await via_b.responses.cancel(made.id)  # reached the holder: any other replica says 404
                follow = await via_b.responses.create(model=MODEL, input="Go on.", max_output_tokens=3,
                                                      previous_response_id=made.id)
                assert _holder(reps, follow.id) is holder
                assert (await via_a.responses.retrieve(follow.id)).output_text == follow.output_text

            with pytest.raises(openai.NotFoundError) as unknown:
                await via_b.responses.retrieve("resp_never_made")
            assert unknown.value.body == {"message": "Response with id 'resp_never_made' not found.",
                                          "type": "not_found_error", "param": "response_id",
                                          "code": "response_not_found"}

            await holder.stop()  # the storing replica is down (still in the fleet): a 502 saying so
            with pytest.raises(openai.InternalServerError) as down:
                await via_b.responses.retrieve(follow.id)
            assert down.value.status_code == 502 and down.value.body["code"] == "upstream_unavailable"


async def test_without_redis_another_router_does_not_know_the_id():
    async with emulated_replicas(2) as reps:
        urls = [r.url for r in reps]
        async with running_router(urls) as a, running_router(urls) as b:
            made = await openai_client(a).responses.create(model=MODEL, input="Hello.", max_output_tokens=2)
            assert (await openai_client(a).responses.retrieve(made.id)).id == made.id
            with pytest.raises(openai.NotFoundError):
                await openai_client(b).responses.retrieve(made.id)


async def test_an_unreachable_redis_costs_only_the_lookup_across_routers(caplog):
    from tests.conftest import free_port

    async with emulated_replicas(2) as reps:
        dead = f"redis://127.0.0.1:{free_port()}/0"
        async with running_router([r.url for r in reps], redis_url=dead, index_timeout_s=0.2) as app:
            client = openai_client(app)
            made = await client.responses.create(model=MODEL, input="Hello.", max_output_tokens=2)
            follow = await client.responses.create(model=MODEL, input="More.", max_output_tokens=2,
                                                   previous_response_id=made.id)
            assert _holder(reps, follow.id) is _holder(reps, made.id)
            assert (await client.responses.retrieve(made.id)).id == made.id  # this router's own memory
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve("resp_unknown")
    assert any(f"response {made.id!r}: its replica not written to Redis" in r.getMessage() for r in caplog.records)


async def test_a_response_whose_replica_is_not_in_the_fleet_is_a_404_saying_so(redis_url, redis_prefix):
    """Router B's fleet lacks the replica that stored a response router A relayed (it left, as B
    sees it): B answers 404, naming that replica, and still serves the ids its own replica holds."""
    async with emulated_replicas(2) as reps:
        shared = {"redis_url": redis_url, "redis_key_prefix": redis_prefix, "policy": "round_robin"}
        async with running_router([r.url for r in reps], **shared) as a, running_router([reps[0].url], **shared) as b:
            made = [await openai_client(a).responses.create(model=MODEL, input=f"Hi {i}.", max_output_tokens=2)
                    for i in range(2)]  # round robin: one on each replica
            kept, gone = sorted(made, key=lambda m: _holder(reps, m.id) is not reps[0])
            assert _holder(reps, kept.id) is reps[0] and _holder(reps, gone.id) is reps[1]
            assert (await openai_client(b).responses.retrieve(kept.id)).id == kept.id
            with pytest.raises(openai.NotFoundError) as missing:
                await openai_client(b).responses.retrieve(gone.id)
            assert missing.value.body["code"] == "response_not_found"
            assert f"replica {a.responses.replica_of(gone.id)} stored it and is not in the fleet" in missing.value.body["message"]
