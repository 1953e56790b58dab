"""A replica's errors reach the client in OpenAI's shape, whatever shape the replica used: a real
aiohttp server on loopback plays the broken replica, the official client reads the router."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from aiohttp import web

from kvroute.router.forwarding.replica_errors import normalize_error_body
from tests.router_support import MODEL, ScriptedReplica, openai_client, running_router

MSGS = [{"role": "user", "content": "hello"}]
NGINX_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway"
             b"</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")

# (status, content type, body, the message the client must see, param, code)
SHAPES = [
    (400, "application/json",
     b'{"error": {"message": "bad temperature", "type": "BadRequestError", "param": "temperature", "code": 400}}',
     "bad temperature", "temperature", 400),
    (400, "application/json",
     b'{"object": "error", "message": "old vllm says no", "type": "BadRequestError", "param": null, "code": 400}',
     "old vllm says no", None, 400),
    (404, "application/json", b'{"detail": "Not Found"}', "Not Found", None, "upstream_error"),
    (422, "application/json",
     b'{"detail": [{"loc": ["body", "messages", 0, "role"], "msg": "field required", "type": "missing"}]}',
     "messages.0.role: field required", "messages.0.role", "upstream_error"),
    (413, "text/plain", b"payload too large for this engine", "payload too large for this engine", None,
     "upstream_error"),
    (502, "text/html", NGINX_502, "502 Bad Gateway", None, "upstream_error"),
    (503, "application/json", b'{"error": "model is loading", "error_type": "overloaded"}', "model is loading", None,
     "upstream_error"),
]


class ErrorReplica(ScriptedReplica):
    def __init__(self, status: int, content_type: str, body: bytes):
        super().__init__()
        self.answer = (status, content_type, body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        status, content_type, body = self.answer
        return web.Response(status=status, body=body, content_type=content_type)


@pytest.mark.parametrize("status, content_type, body, message, param, code", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
async def test_replica_error_shapes_reach_the_sdk_in_openai_shape(status, content_type, body, message, param, code,
                                                                  stream):
    async with ErrorReplica(status, content_type, body) as rep, running_router([rep.url], retry_attempts=0) as app:
        client = openai_client(app)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=stream)
        err = info.value
        assert err.status_code == status  # the replica's status, kept
        assert set(err.body) == {"message", "type", "param", "code"}
        assert (err.body["message"], err.body["param"], err.body["code"]) == (message, param, code)
        assert isinstance(err.body["type"], str) and err.body["type"]
        assert err.response.headers["Content-Type"].startswith("application/json")


class MidStreamErrorReplica(ScriptedReplica):
    """Starts a stream, then reports an error in a non-OpenAI shape inside it."""

    def __init__(self, event: bytes):
        super().__init__()
        self.event = event

    async def chat(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: " + self.event + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("event, message", [
    (b'{"object": "error", "message": "engine ran out of KV blocks", "type": "InternalServerError", "code": 500}',
     "engine ran out of KV blocks"),
    (b'{"error": "CUDA error: device-side assert"}', "CUDA error: device-side assert"),
    (b'{"detail": "stream aborted"}', "stream aborted"),
])
async def test_an_error_inside_a_stream_is_rewritten(event, message):
    async with MidStreamErrorReplica(event) as rep, running_router([rep.url]) as app:
        client = openai_client(app)
        stream = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=True)
        got = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)
        assert got == ["Hi"]
        assert info.value.message == message and info.value.body["message"] == message
        assert set(info.value.body) == {"message", "type", "param", "code"}
        # the raw wire: the rewritten event, then the terminator
        async with aiohttp.ClientSession() as s, s.post(
            app.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "stream": True}
        ) as r:
            events = [e for e in (await r.read()).decode().split("\n\n") if e]
        assert json.loads(events[1][len("data: "):])["error"]["message"] == message and events[-1] == "data: [DONE]"


def test_openai_shaped_bodies_pass_through_byte_for_byte():
    body = b'{"error": {"message": "m", "type": "t", "param": null, "code": "c"}}'
    assert normalize_error_body(400, body) is body


def test_an_empty_or_huge_body_still_gives_a_readable_message():
    assert json.loads(normalize_error_body(503, b""))["error"]["message"] == "replica answered 503"
    out = json.loads(normalize_error_body(500, b"x" * 100_000))["error"]
    assert len(out["message"]) == 2000 and out["type"] == "server_error"
