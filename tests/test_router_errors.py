"""Every non-2xx answer is OpenAI's error shape with the right status, the framework's own
404/405/413 included; bad input never gives a 500."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.conftest import free_port
from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape, total


@pytest.fixture
async def router():
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url], max_body_bytes=64 * 1024, max_prompt_tokens=2000) as app:
            yield app


async def _post(url: str, path: str, data: bytes, **kw) -> tuple[int, dict, aiohttp.typedefs.LooseHeaders]:
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data, **kw) as r:
        return r.status, json.loads(await r.read()), r.headers


def _assert_shape(body: dict) -> dict:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


CHAT = "/v1/chat/completions"
BAD_BODIES = [
    (b"{not json", 400, "invalid_json", None),
    (b"", 400, "invalid_json", None),
    (b"[]", 400, "invalid_json", None),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_required_parameter", "model"),
    (b'{"model": "tiny"}', 400, "missing_required_parameter", "messages"),
    (b'{"model": ["tiny"], "messages": []}', 400, "invalid_type", "model"),
    (b'{"model": "tiny", "messages": {"role": "user"}}', 400, "invalid_type", "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 1}]}', 400, "invalid_type", "messages.0.content"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": 1}', 400, "invalid_type", "stream"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "invalid_type", "max_tokens"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("raw, status, code, param", BAD_BODIES)
async def test_bad_chat_bodies(router, raw, status, code, param):
    got, body, headers = await _post(router.url, CHAT, raw, headers={"Content-Type": "application/json"})
    err = _assert_shape(body)
    assert (got, err["code"], err["param"]) == (status, code, param)
    assert headers["X-Request-Id"]


async def test_bad_completion_prompts(router):
    for prompt in (None, 3, [], [-1], [[1], "x"], {"a": 1}, [1.5]):
        got, body, _ = await _post(router.url, "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt}).encode())
        err = _assert_shape(body)
        assert (got, err["param"]) == (400, "prompt"), (prompt, body)


async def test_framework_errors_in_error_shape(router):
    got, body, _ = await _post(router.url, "/v1/nothing-here", b"{}")
    assert got == 404 and _assert_shape(body)["code"] == "not_found"
    async with aiohttp.ClientSession() as s, s.get(router.url + CHAT) as r:
        assert r.status == 405 and _assert_shape(await r.json())["code"] == "method_not_allowed"
        assert "POST" in r.headers["Allow"]
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    got, body, _ = await _post(router.url, CHAT, big)
    assert got == 413 and _assert_shape(body)["code"] == "request_too_large"


async def test_prompt_token_limit(router):
    long = " ".join(f"word{i}" for i in range(3000))
    got, body, _ = await _post(router.url, "/v1/completions", json.dumps({"model": MODEL, "prompt": long}).encode())
    assert got == 400 and _assert_shape(body)["code"] == "context_length_exceeded"


async def test_replica_errors_pass_through_in_shape(router):
    # the replica, not the router, rejects this one (its context is shorter than the request)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 10_000_000}
    got, out, _ = await _post(router.url, "/v1/completions", json.dumps(body).encode())
    assert got == 400 and "context length" in _assert_shape(out)["message"]


async def test_openai_client_sees_typed_errors(router):
    client = openai_client(router, "x")
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens="x")  # type: ignore[arg-type]


async def test_no_500_and_error_metrics(router):
    weird = [b"\x00\xff", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
             b'{"model": "tiny", "messages": [null]}', b'{"model": "tiny", "prompt": "x"}', b"1e999999"]
    for raw in weird:
        got, body, _ = await _post(router.url, CHAT, raw)
        assert got < 500, (raw, got, body)
        if got >= 400:
            _assert_shape(body)
    samples = await scrape(router.url)
    assert total(samples, "kvroute_requests_total", status="500") == 0
    assert total(samples, "kvroute_requests_total", replica="none", status="400") >= 3


async def test_no_healthy_replica_is_503_and_not_ready():
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_router([dead]) as app:
        async with aiohttp.ClientSession() as s:
            async with s.get(app.url + "/ready") as r:
                assert r.status == 503 and _assert_shape(await r.json())["code"] == "no_replica_available"
            async with s.get(app.url + "/health") as r:
                assert r.status == 200
