"""Hostile and broken clients, over raw sockets: the HTTP parser's errors, broken and oversized
bodies, over-deep JSON and odd request ids answered in OpenAI's error shape (never a 500 or a
text/plain 400); slow heads, slow bodies and idle connections cut at their timeouts; a slow body
holds no in-flight slot."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import time
import zlib

import pytest

from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, sample, scrape

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
async def router():
    async with emulated_replicas(1) as reps:
        async with running_router(
            [reps[0].url], max_body_bytes=64 * 1024, header_timeout_s=0.5, body_timeout_s=5.0, keepalive_timeout_s=0.5
        ) as app:
            yield app


async def exchange(port: int, *parts: bytes, pause_s: float = 0.05, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Send ``parts`` (pausing between them), read until the router closes; (answer, seconds)."""
    started = time.monotonic()  # before connecting: the router's clock starts at its accept, later
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(pause_s)
            writer.write(part)
        answer = await asyncio.wait_for(reader.read(), wait_s)
        return answer, time.monotonic() - started
    finally:
        writer.close()


def parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


def openai_error(answer: bytes) -> tuple[int, str]:
    """(status, error code) of an answer that must be OpenAI's error shape."""
    status, headers, body = parse(answer)
    assert headers["content-type"].startswith("application/json"), answer[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return status, err["code"]


def post(body: bytes, *extra: str, path: str = CHAT) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


PARSER_ERRORS = [
    ("content-length and chunked", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "invalid_http_request"),
    ("header too large", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n", 431,
     "request_header_fields_too_large"),
    ("too many headers", b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n",
     431, "request_header_fields_too_large"),
    ("request line too long", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    ("bad method", b"G@T / HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),
    ("tls on the http port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400, "invalid_http_request"),
    ("bad chunk size", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"5\r\nabcde\r\nZZ\r\n", 400, "invalid_http_request"),
]


@pytest.mark.parametrize("raw, status, code", [p[1:] for p in PARSER_ERRORS], ids=[p[0] for p in PARSER_ERRORS])
async def test_parser_errors_in_openai_shape(router, raw, status, code):
    answer, _ = await exchange(router.port, raw)
    assert openai_error(answer) == (status, code)


async def test_chunked_body_broken_half_way_is_a_400(router):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer, took = await exchange(router.port, head + b"5\r\n{\"mod\r\n", b"ZZ\r\n")
    assert openai_error(answer) == (400, "invalid_request_body")
    assert took < 3.0  # answered at once, not when the body timeout (5 s) passes


async def test_compressed_bodies(router):
    def gz(encoding: str, data: bytes) -> bytes:
        return post(data, f"Content-Encoding: {encoding}", "Connection: close")

    answer, _ = await exchange(router.port, gz("gzip", gzip.compress(BODY)))
    assert parse(answer)[0] == 200
    for encoding, data in [("gzip", b"0123456789"), ("deflate", b"\x78\x9c garbage"), ("gzip", b"\x1f\x8b" + BODY)]:
        answer, _ = await exchange(router.port, gz(encoding, data))
        assert openai_error(answer) == (400, "invalid_request_body"), (encoding, data)
    bomb = gzip.compress(b" " * (8 * 1024 * 1024))  # 8 MiB of spaces in ~8 KB: over the 64 KiB limit
    answer, _ = await exchange(router.port, gz("gzip", bomb))
    assert openai_error(answer) == (413, "request_too_large")
    answer, _ = await exchange(router.port, gz("deflate", zlib.compress(b" " * (8 * 1024 * 1024))))
    assert openai_error(answer) == (413, "request_too_large")


async def test_declared_length_over_the_limit_is_refused_before_the_body(router):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
    answer, took = await exchange(router.port, head + b"{")
    assert openai_error(answer) == (413, "request_too_large") and took < 3.0  # not at the body timeout


def _post_whole_then_read(port: int, body: bytes) -> tuple[int, bytes]:
    """Python's http.client (what ``requests`` uses): the whole body is written, then the answer read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


async def test_an_oversized_body_written_whole_before_reading_gets_its_413(router):
    """32 MB (more than the sockets' buffers hold) refused by its Content-Length: the router reads and
    drops the rest before it closes, so a client that reads only after writing everything gets the
    413, not a broken pipe (reading had stopped, and the close 2 s later reset the connection)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 32_000_000}]}).encode()
    for _ in range(2):
        status, answer = await asyncio.to_thread(_post_whole_then_read, router.port, body)
        assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"


def nested(depth: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()[
        :-1
    ] + b', "vllm_xargs": ' + b"[" * depth + b"]" * depth + b"}"


async def test_json_nesting_depth_is_limited(router):
    for depth in (129, 1_000, 30_000):
        answer, _ = await exchange(router.port, post(nested(depth), "Connection: close"))
        status, code = openai_error(answer)
        assert (status, code) == (400, "invalid_json")
        assert b"deeper than 128" in answer
    # at the limit, and brackets inside strings, are fine (the body's own depth is 2 more)
    ok = [nested(120), json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "[{" * 5000}],
                                   "max_tokens": 2}).encode()]
    for body in ok:
        answer, _ = await exchange(router.port, post(body, "Connection: close"))
        assert parse(answer)[0] == 200, answer[:300]


async def test_only_ascii_request_ids_are_echoed(router):
    for rid, kept in [(b"abc-123.x:y@z/+=", True), ("\u00e9t\u00e9".encode(), False), (b"a" * 129, False),
                      ("\u0661\u0662".encode(), False)]:
        raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + rid + b"\r\nConnection: close\r\n\r\n"
        answer, _ = await exchange(router.port, raw)
        echoed = parse(answer)[1]["x-request-id"].encode("latin-1")
        assert (echoed == rid) is kept and echoed.isascii()


async def test_slow_head_gets_408_and_a_silent_client_is_closed(router):
    answer, took = await exchange(router.port, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n", pause_s=0.2)
    assert openai_error(answer) == (408, "request_timeout")
    assert 0.4 < took < 4.5
    answer, took = await exchange(router.port)  # connects, says nothing
    assert answer == b"" and 0.4 < took < 4.5
    assert sample(await scrape(router.url), "kvroute_client_timeouts_total", stage="header") == 2


async def test_idle_keepalive_connection_is_closed(router):
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answer, took = await exchange(router.port, ok)
    assert parse(answer)[0] == 200 and answer.count(b"HTTP/1.1") == 1
    assert 0.4 < took < 4.5


async def test_slow_body_gets_408_and_holds_no_in_flight_slot():
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url], max_in_flight=2, body_timeout_s=1.5) as app:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
            slow = [asyncio.create_task(exchange(app.port, head + BODY[:10], BODY[10:20], pause_s=0.3))
                    for _ in range(6)]
            await asyncio.sleep(0.3)
            assert app.bodies.partial == 6 and app.in_flight == 0
            client = openai_client(app)
            for _ in range(10):  # before: 429, the slow bodies held both in-flight slots
                answer = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
                assert answer.choices
            for answer, took in await asyncio.gather(*slow):
                assert openai_error(answer) == (408, "request_timeout")
                assert 1.4 < took < 8.0
            assert app.bodies.partial == 0 and app.in_flight == 0
            assert sample(await scrape(app.url), "kvroute_client_timeouts_total", stage="body") == 6


@pytest.mark.parametrize("bound", [{"max_body_reads": 2}, {"max_body_read_bytes": 2 * len(BODY) + 10}])
async def test_bodies_being_received_are_bounded_but_a_whole_body_is_served(bound):
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url], body_timeout_s=2.0, **bound) as app:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
            slow = [asyncio.create_task(exchange(app.port, head + BODY[:10], BODY[10:20], pause_s=0.3)) for _ in range(2)]
            await asyncio.sleep(0.3)
            answer, _ = await exchange(app.port, head + BODY[:10], BODY[10:], pause_s=0.2)  # a third partial body
            assert openai_error(answer) == (503, "server_busy")
            answer, _ = await exchange(app.port, post(BODY, "Connection: close"))  # whole: no slot needed
            assert parse(answer)[0] == 200
            for answer, _ in await asyncio.gather(*slow):
                assert openai_error(answer) == (408, "request_timeout")
