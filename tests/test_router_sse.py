"""SSE relaying: events reframed across arbitrary chunk boundaries, usage read from the last
chunk, the usage-only chunk withheld from clients that did not ask, upstream errors reshaped."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from kvroute.router.forwarding.proxy import _nodelay
from kvroute.router.forwarding.replica_errors import normalize_error_body
from kvroute.router.forwarding.sse import SseRelay


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CONTENT = [
    _event({"id": "c", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}], "usage": None}) for i in range(3)
]
USAGE = _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                                     "prompt_tokens_details": {"cached_tokens": 32}}})
DONE = b"data: [DONE]\n\n"
STREAM = b"".join(CONTENT) + USAGE + DONE


def _relay_in_pieces(relay: SseRelay, data: bytes, size: int) -> bytes:
    out = b"".join(relay.feed(data[i : i + size]) for i in range(0, len(data), size))
    return out + relay.tail()


@pytest.mark.parametrize("size", [1, 7, 64, len(STREAM)])
def test_usage_chunk_withheld_from_client_that_did_not_ask(size):
    relay = SseRelay(strip_usage=True)
    out = _relay_in_pieces(relay, STREAM, size)
    assert out == b"".join(CONTENT) + DONE
    assert relay.usage is not None and relay.usage.cached_tokens == 32 and relay.usage.prompt_tokens == 40
    assert relay.done


@pytest.mark.parametrize("size", [3, len(STREAM)])
def test_everything_passes_when_client_asked_for_usage(size):
    relay = SseRelay(strip_usage=False)
    assert _relay_in_pieces(relay, STREAM, size) == STREAM
    assert relay.usage is not None and relay.usage.cached_tokens == 32


def test_complete_events_are_released_at_once_partial_ones_wait():
    relay = SseRelay(strip_usage=True)
    first = CONTENT[0]
    assert relay.feed(first[:10]) == b""
    assert relay.feed(first[10:] + CONTENT[1][:5]) == first  # released without waiting for more
    assert relay.feed(CONTENT[1][5:]) == CONTENT[1]


def test_usage_inside_a_content_chunk_is_removed_not_the_content():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {"prompt_tokens": 5}}
    relay = SseRelay(strip_usage=True)
    out = relay.feed(_event(chunk))
    sent = json.loads(out[len(b"data: ") :])
    assert sent["choices"] == chunk["choices"] and "usage" not in sent
    assert relay.usage is not None and relay.usage.prompt_tokens == 5 and relay.usage.cached_tokens is None


def test_crlf_framing_and_missing_final_blank_line():
    data = b"data: {\"a\": 1}\r\n\r\ndata: [DONE]"
    relay = SseRelay(strip_usage=True)
    assert relay.feed(data) == b"data: {\"a\": 1}\r\n\r\n"
    assert not relay.done
    assert relay.tail() == b"data: [DONE]\n\n" and relay.done


def test_stream_without_done_is_not_done():
    relay = SseRelay(strip_usage=True)
    _relay_in_pieces(relay, b"".join(CONTENT), 16)
    assert not relay.done


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}', "bad"),
        (b'{"object": "error", "message": "old vllm", "type": "BadRequestError", "param": "x", "code": 400}', "old vllm"),
        (b"Internal Server Error", "Internal Server Error"),
        (b"", "replica answered 503"),
    ],
)
def test_upstream_errors_come_out_in_openai_shape(body, message):
    out = json.loads(normalize_error_body(503, body))
    assert set(out["error"]) >= {"message", "type", "param", "code"}
    assert out["error"]["message"] == message


async def test_nodelay_is_set_on_a_connection_that_lacked_it():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    try:
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", server.sockets[0].getsockname()[1])
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)  # asyncio sets it: undo, to see _nodelay work
        _nodelay(transport)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        transport.close()
    finally:
        server.close()
