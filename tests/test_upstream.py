"""The pooled upstream client against real loopback servers: an aiohttp app (what the emulated
replica runs) and raw asyncio servers for what aiohttp would never send (splits at every byte,
malformed heads, connections that die at chosen moments)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from multidict import CIMultiDict

from kvroute.router.forwarding.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
)
from tests.conftest import free_port

EVENTS = [b'data: {"choices": [{"index": 0, "delta": {"content": "%d"}}]}\n\n' % i for i in range(3)] + [
    b"data: [DONE]\n\n"
]


class AioServer:
    """An aiohttp app like a replica: a JSON answer, an SSE stream paced by the test."""

    def __init__(self, keepalive_timeout: float = 75.0, host: str = "127.0.0.1"):
        self.host = host
        self.transports: set[object] = set()  # one per connection the server accepted
        self.requests: list[tuple[str, CIMultiDict[str], bytes]] = []
        self.next_event = asyncio.Event()  # the stream waits for it between events
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout, shutdown_timeout=0.1)
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.transports.add(request.transport)
        body = await request.read()
        self.requests.append((request.path, request.headers.copy(), body))  # case-insensitive
        if request.path.endswith("/sse"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in EVENTS:
                await self.next_event.wait()
                self.next_event.clear()
                await resp.write(event)
            return resp
        if request.path.endswith("/error"):
            return web.json_response({"error": {"message": "no"}}, status=503)
        return web.json_response({"bytes": len(body), "path": request.path})

    async def __aenter__(self) -> AioServer:
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, 0).start()
        port = self.runner.addresses[0][1]
        self.url = f"http://[{self.host}]:{port}" if ":" in self.host else f"http://{self.host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A bare TCP server; ``handler(reader, writer, n)`` runs for the n-th connection (from 0)."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(accepted)
        accepted.append(n)
        try:
            await handler(reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


JSON = b'{"ok": true}'
JSON_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(JSON), JSON)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=2.0)
    yield p
    await p.close()


# -- against aiohttp -----------------------------------------------------------------------------


async def test_json_answer_and_headers_reach_the_server(pool):
    async with AioServer() as srv:
        body = json.dumps({"prompt": "x" * 20000}).encode()
        headers = {"X-Request-Id": "r-1", "Authorization": "Bearer k"}
        resp = await pool.request(srv.url, "/v1/completions", headers, body)
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("application/json")
        assert json.loads(await resp.read()) == {"bytes": len(body), "path": "/v1/completions"}
        path, headers, got = srv.requests[0]
        assert got == body
        assert headers["X-Request-Id"] == "r-1" and headers["Authorization"] == "Bearer k"
        assert headers["Host"] == srv.url.removeprefix("http://")


async def test_sse_events_arrive_one_by_one_and_the_connection_is_reused(pool):
    async with AioServer() as srv:
        for _ in range(2):
            resp = await pool.request(srv.url, "/sse", {}, b"{}")
            assert resp.status == 200 and resp.headers["transfer-encoding"] == "chunked"
            got = b""
            for event in EVENTS:
                srv.next_event.set()  # the server sends the next event only now
                while not got.endswith(event):
                    chunk = await asyncio.wait_for(resp.readany(), 5)
                    assert chunk, "the body ended early"
                    got += chunk
            assert await asyncio.wait_for(resp.readany(), 5) == b""
            assert got == b"".join(EVENTS)
        assert len(srv.transports) == 1  # the server saw one connection: the pool made one


async def test_sequential_requests_share_one_connection_and_concurrent_ones_are_pooled(pool):
    async with AioServer() as srv:
        for _ in range(5):
            assert (await (await pool.request(srv.url, "/a", {}, b"x")).read()).startswith(b"{")
        assert len(srv.transports) == 1
        async def one() -> bytes:
            return await (await pool.request(srv.url, "/b", {}, b"y")).read()

        bodies = await asyncio.gather(*(one() for _ in range(8)))
        assert all(b.startswith(b"{") for b in bodies)
        made = len(srv.transports)
        for _ in range(20):
            await (await pool.request(srv.url, "/c", {}, b"z")).read()
        assert len(srv.transports) == made  # no new connection while idle ones are there


async def test_server_closing_an_idle_connection_does_not_fail_the_next_request(pool):
    async with AioServer(keepalive_timeout=0.1) as srv:
        assert (await pool.request(srv.url, "/a", {}, b"1")).status == 200
        await asyncio.sleep(0.4)  # the server closes the idle connection meanwhile
        resp = await pool.request(srv.url, "/a", {}, b"2")
        assert resp.status == 200 and json.loads(await resp.read())["bytes"] == 1
        assert len(srv.transports) == 2


async def test_error_status_body_is_read_and_ipv6_base_url_with_a_prefix(pool):
    async with AioServer(host="::1") as srv:
        resp = await pool.request(srv.url + "/prefix/", "/error", {}, b"{}")
        assert resp.status == 503
        assert json.loads(await resp.read()) == {"error": {"message": "no"}}
        assert srv.requests[0][0] == "/prefix/error"
        assert srv.requests[0][1]["Host"] == srv.url.removeprefix("http://")


async def test_refused_port_is_a_connect_error(pool):
    with pytest.raises(UpstreamConnectError):
        await pool.request(f"http://127.0.0.1:{free_port()}", "/x", {}, b"")


async def test_header_values_with_line_breaks_are_refused(pool):
    async with AioServer() as srv:
        with pytest.raises(ValueError):
            await pool.request(srv.url, "/x", {"X-Request-Id": "a\r\nEvil: 1"}, b"")
        assert srv.requests == []


async def test_pool_close_closes_idle_connections():
    pool = UpstreamPool(connect_timeout_s=2.0)
    closed = asyncio.Event()

    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(JSON_RESPONSE)
        assert await reader.read() == b""  # until the client closes
        closed.set()

    async with raw_server(serve) as (url, _):
        await (await pool.request(url, "/x", {}, b"")).read()
        assert pool.idle_connections() == 1
        await pool.close()
        await asyncio.wait_for(closed.wait(), 5)
        with pytest.raises(UpstreamConnectError):
            await pool.request(url, "/x", {}, b"")


async def test_connections_idle_longer_than_keepalive_are_not_reused():
    pool = UpstreamPool(connect_timeout_s=2.0, keepalive_s=0.05)
    try:
        async with AioServer() as srv:
            await (await pool.request(srv.url, "/a", {}, b"")).read()
            await asyncio.sleep(0.15)
            await (await pool.request(srv.url, "/a", {}, b"")).read()
            assert len(srv.transports) == 2
    finally:
        await pool.close()


# -- against raw servers -------------------------------------------------------------------------


CHUNKED_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"8;ext=1\r\ndata: a\n\r\n"
    b"b \r\n\ndata: bc\n\n\r\n"
    b"0\r\nX-Trailer: yes\r\n\r\n"
)
CHUNKED_BODY = b"data: a\n\ndata: bc\n\n"


async def test_chunked_body_split_at_every_byte_boundary(pool):
    """One keep-alive connection; response i arrives in two writes cut at byte i."""
    splits = list(range(1, len(CHUNKED_RESPONSE)))

    async def serve(reader, writer, n):
        for cut in splits:
            await read_request(reader)
            writer.write(CHUNKED_RESPONSE[:cut])
            await writer.drain()
            await asyncio.sleep(0.002)  # the client reads the first part on its own
            writer.write(CHUNKED_RESPONSE[cut:])
            await writer.drain()
        await reader.read()

    async with raw_server(serve) as (url, accepted):
        for _ in splits:
            resp = await asyncio.wait_for(pool.request(url, "/x", {}, b"q"), 5)
            assert resp.status == 200
            assert await asyncio.wait_for(resp.read(), 5) == CHUNKED_BODY
        assert accepted == [0]  # every body was delimited exactly: the connection stayed usable


async def test_chunked_body_one_byte_at_a_time(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        for i in range(len(CHUNKED_RESPONSE)):
            writer.write(CHUNKED_RESPONSE[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.001)
        await reader.read()

    async with raw_server(serve) as (url, _):
        resp = await pool.request(url, "/x", {}, b"")
        parts = []
        while chunk := await asyncio.wait_for(resp.readany(), 5):
            parts.append(chunk)
        assert b"".join(parts) == CHUNKED_BODY and len(parts) > 1


async def test_request_is_written_as_expected(pool):
    seen: list[bytes] = []

    async def serve(reader, writer, n):
        head, body = await read_request(reader)
        seen.append(head + body)
        writer.write(JSON_RESPONSE)
        await reader.read()

    async with raw_server(serve) as (url, _):
        await (await pool.request(url, "/v1/chat/completions", {"Content-Type": "application/json"}, b"{}")).read()
    port = url.rsplit(":", 1)[1]
    assert seen == [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"Connection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ]


async def test_connection_close_answer_is_not_reused(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await reader.read()

    async with raw_server(serve) as (url, accepted):
        for _ in range(2):
            assert await (await pool.request(url, "/x", {}, b"")).read() == b"ok"
        assert accepted == [0, 1]


async def test_body_delimited_by_close(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"data: [DONE]\n\n")
        # closed by raw_server on return

    async with raw_server(serve) as (url, accepted):
        for _ in range(2):
            resp = await pool.request(url, "/x", {}, b"")
            assert await asyncio.wait_for(resp.read(), 5) == b"data: 1\n\ndata: [DONE]\n\n"
        assert accepted == [0, 1]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_server_dying_mid_body_is_a_disconnect(pool, answer):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_server(serve) as (url, _):
        resp = await pool.request(url, "/x", {}, b"")
        with pytest.raises(UpstreamDisconnected):
            await asyncio.wait_for(resp.read(), 5)


async def test_fresh_connection_closed_before_any_answer_is_not_retried(pool):
    async def serve(reader, writer, n):
        await read_request(reader)  # and close without a word

    async with raw_server(serve) as (url, accepted):
        with pytest.raises(UpstreamDisconnected):
            await pool.request(url, "/x", {}, b"")
        assert accepted == [0]


async def test_reused_connection_closed_before_any_answer_is_retried_once_on_a_new_one(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        if n == 0:  # answer once, then drop the connection on the next request, unanswered
            writer.write(JSON_RESPONSE)
            await read_request(reader)
            return
        writer.write(JSON_RESPONSE)
        await reader.read()

    async with raw_server(serve) as (url, accepted):
        assert await (await pool.request(url, "/x", {}, b"1")).read() == JSON
        assert await (await pool.request(url, "/x", {}, b"2")).read() == JSON
        assert accepted == [0, 1]


async def test_reused_connection_that_dies_after_answering_in_part_is_not_retried(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(JSON_RESPONSE)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")  # part of a head, then gone

    async with raw_server(serve) as (url, accepted):
        await (await pool.request(url, "/x", {}, b"")).read()
        with pytest.raises(UpstreamDisconnected):
            await pool.request(url, "/x", {}, b"")
        assert accepted == [0]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTPT/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"y" * (70 * 1024) + b"\r\n\r\n",
    ],
    ids=["version", "status", "length", "header", "chunk-size", "chunk-end", "head-too-large"],
)
async def test_malformed_answers_are_upstream_errors(pool, answer):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(answer)
        await reader.read()

    async with raw_server(serve) as (url, _):
        with pytest.raises(UpstreamProtocolError) as info:
            resp = await asyncio.wait_for(pool.request(url, "/x", {}, b""), 5)
            await asyncio.wait_for(resp.read(), 5)
        assert isinstance(info.value, UpstreamError) and isinstance(info.value, OSError)
        assert pool.idle_connections() == 0


async def test_interim_answer_is_skipped_and_empty_bodies_end_at_once(pool):
    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await reader.read()

    async with raw_server(serve) as (url, accepted):
        resp = await pool.request(url, "/x", {}, b"")
        assert resp.status == 204 and await resp.read() == b""
        resp = await pool.request(url, "/x", {}, b"")
        assert resp.status == 200 and await resp.readany() == b""
        assert accepted == [0]


async def test_cancel_while_waiting_for_the_answer_closes_the_connection(pool):
    gone = asyncio.Event()

    async def serve(reader, writer, n):
        await read_request(reader)
        assert await reader.read() == b""  # the client hung up: the engine would abort
        gone.set()

    async with raw_server(serve) as (url, _):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await pool.request(url, "/x", {}, b"")
        await asyncio.wait_for(gone.wait(), 5)
        assert pool.idle_connections() == 0


async def test_cancel_while_reading_the_body_and_close_abort_the_request(pool):
    gone = asyncio.Event()

    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert await reader.read() == b""
        gone.set()

    async with raw_server(serve) as (url, _):
        resp = await pool.request(url, "/x", {}, b"")
        assert await resp.readany() == b"hello"
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await resp.readany()
        await asyncio.wait_for(gone.wait(), 5)
        with pytest.raises(UpstreamDisconnected):
            await resp.readany()
        resp.release()  # after close: nothing happens
        assert pool.idle_connections() == 0


async def test_unread_body_pauses_reading_until_consumed(pool):
    size = 8 << 20
    body = bytes(range(256)) * (size // 256)

    async def serve(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(0, size, 1 << 16):
            writer.write(body[i : i + (1 << 16)])
            await writer.drain()
        await reader.read()

    async with raw_server(serve) as (url, _):
        resp = await pool.request(url, "/x", {}, b"")
        async with asyncio.timeout(5):  # nobody reads: the client stops reading the socket
            while resp.transport.is_reading():
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not resp.transport.is_reading()
        assert await asyncio.wait_for(resp.read(), 10) == body
        assert pool.idle_connections() == 1 and resp.transport.is_reading()
