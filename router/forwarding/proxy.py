"""Forwarding to replicas: timeouts, retries before the first byte, SSE relayed chunk by chunk.

A request is *committed* once the router has written its first byte to the client: before that a
failure is retried on the next-best replica, after it a stream ends with an OpenAI error event and
``[DONE]`` (docs/design.md §7.1-7.2).  So for a stream the router waits for the first upstream
event before sending headers, which makes a replica that accepts the connection and then dies
retryable.

Requests to replicas go through ``UpstreamPool`` (``upstream.py``), a lean keep-alive HTTP/1.1
client for this one kind of call (aiohttp's client cost several times more CPU per request).
Streams are relayed as they arrive (``readany``: whatever bytes the socket delivered; each complete
event is written at once, a partial one waits only for its own end), with TCP_NODELAY on both
sockets (the pool sets it on each connection it makes; ``_nodelay`` on the client's, once per
connection), so no event waits on Nagle.  ``sse.py`` frames the events and reads the few it must.

Every step answers with a value and calls nothing back: ``open`` gives :class:`Opened` (committed
to that replica) or :class:`Unanswered` (retryable elsewhere, and whether the replica is to blame),
``respond`` a :class:`Relayed` (the response, its status, usage, answer, and a mid-stream failure
if any), ``finish`` sends a stream's last bytes.  The caller (the edge) tells the fleet's breakers
and the request's accounting what they say.

Timeouts: connect (TCP), first byte (request sent to first response event; for a non-streamed
answer that is the whole generation), idle (longest silence between two stream chunks).  A client
that disconnects cancels the handler (the app runs with ``handler_cancellation``), which closes
the upstream connection, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec
from aiohttp import web

from kvroute.common.errors import ApiError, sse_error_event

from kvroute.router.aio import set_nodelay
from kvroute.router.forwarding.replica_errors import normalize_error_body
from kvroute.router.forwarding.sse import SseRelay, Usage
from kvroute.router.forwarding.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)

log = logging.getLogger("kvroute.router")

_decode = msgspec.json.Decoder()
# upstream failures that leave nothing to read; retryable while nothing was written to the client
# (UpstreamError is an OSError; TimeoutError is asyncio.timeout's)
_UPSTREAM_ERRORS = (OSError, TimeoutError)
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# the replica refuses the router's own API key: the router's fault, never the client's to see as its
# own 401 (retried elsewhere: another replica may hold the key the router sends)
_AUTH_STATUSES = frozenset({401, 403})

Stage = Literal["connect", "first_byte", "mid_stream", "auth"]


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float


@dataclass(frozen=True, slots=True)
class Opened:
    """A replica's answer past its first byte: the request is committed to it."""

    replica: str
    upstream: UpstreamResponse
    data: bytes  # the whole body (non-streamed or an error), else the stream's first chunk
    ttft_s: float | None  # a stream's time to its first event; None for a whole answer


@dataclass(frozen=True, slots=True)
class Unanswered:
    """An attempt that failed before the first byte: retryable on another replica."""

    replica: str
    status: int  # the replica's (429, 5xx), or 502 (it failed) / 504 (it timed out)
    error: str | bytes  # why (bytes: the replica's own error answer, in OpenAI's shape)
    stage: Stage | None  # the replica failed (its breaker counts it; "auth": it refused the router's key); None: busy (429)
    replica_status: int = 0  # what the replica answered, when it answered (a 401 behind a 502 "auth")


@dataclass(frozen=True, slots=True)
class Relayed:
    """A committed answer as the client is getting it."""

    response: web.StreamResponse
    status: int
    usage: Usage | None
    # the answer's JSON object (a whole 2xx body, or a Responses stream's final response), read
    # before the client has it: :meth:`Proxy.finish` sends the bytes that hold it
    answer: dict[str, Any] | None = None
    failure: str | None = None  # the stream failed after its first byte (the replica's fault)
    rest: bytes = b""  # what the client still gets from :meth:`Proxy.finish`
    complete: bool = True  # the client has (or, after finish, will have) the whole answer
    events: int = 0  # a stream's data events before [DONE] (output tokens when no usage is reported)
    decode_s: float | None = None  # a stream's first event to its last: the output after the first token


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a forwarded request: the caller's fold of the values above."""

    replica: str | None = None
    status: int = 0
    usage: Usage | None = None
    ttft_s: float | None = None
    attempts: int = 0
    mid_stream_error: str | None = None
    duration_s: float | None = None  # end to end: arrival to the answer's last byte
    events: int = 0  # Relayed.events
    decode_s: float | None = None  # Relayed.decode_s


def make_upstream_session(timeouts: Timeouts, tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """One pooled session for the fleet's probes and scrapes (requests go through ``make_upstream_pool``);
    ``tls``: how https replicas are verified and what certificate the router shows them (the same
    context as the pool's, so a probe succeeds exactly when a request can)."""
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, keepalive_timeout=30.0, ttl_dns_cache=60, ssl=tls if tls is not None else True
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
        # replicas speak identity; never pay for decompression, and pass bytes through as they are
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        auto_decompress=False,
    )


def make_upstream_pool(
    timeouts: Timeouts, tls: ssl.SSLContext | None = None, server_name: str | None = None
) -> UpstreamPool:
    """The keep-alive connections every proxied request goes through (``tls``, ``server_name``: for
    https replicas)."""
    return UpstreamPool(timeouts.connect_s, keepalive_s=30.0, ssl_context=tls, server_name=server_name)


_nodelay_done: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()


def _nodelay(transport: asyncio.BaseTransport | None) -> None:
    """TCP_NODELAY on a connection's socket, once per connection (a syscall is not free)."""
    if transport is None or transport in _nodelay_done:
        return
    set_nodelay(transport)
    try:
        _nodelay_done.add(transport)
    except TypeError:  # a transport without weak references: set it every time
        pass


class Proxy:
    """Sends requests to replicas over the pool and relays their answers; it never calls back."""

    def __init__(self, pool: UpstreamPool, timeouts: Timeouts, *, upstream_headers: Mapping[str, str]):
        self.pool = pool
        self.timeouts = timeouts  # connect is the pool's; first byte and idle are open() and respond()'s own
        # what every upstream request carries (the replicas' own API key), merged once
        self._fixed_headers = {**upstream_headers, "Content-Type": "application/json"}

    def _headers(self, request_id: str, trace_headers: Mapping[str, str]) -> dict[str, str]:
        return {**self._fixed_headers, **trace_headers, "X-Request-Id": request_id}

    async def open(
        self, replica: str, url: str | None, path: str, body: bytes, *, request_id: str, stream: bool,
        method: str = "POST", trace_headers: Mapping[str, str] = {},  # noqa: B006 - read only
    ) -> Opened | Unanswered:
        """Send ``body`` to ``replica`` (at ``url``; None: it left the fleet) and wait for its first
        byte (a stream's first event, or a whole non-streamed answer).  ``trace_headers``: the W3C
        trace context the replica gets (router/tracing.py)."""
        sent = time.perf_counter()
        upstream: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                if url is None:  # left the fleet between the decision and now
                    raise UpstreamError(f"replica {replica} is gone")
                upstream = await self.pool.request(url, path, self._headers(request_id, trace_headers), body, method)
                if upstream.status in _AUTH_STATUSES:
                    await upstream.read()
                    upstream.release()
                    error = (f"replica {replica} refuses the router's API key ({upstream.status}); the router's "
                             "operator must set fleet.replica_api_key")
                    log.warning("request %s: %s", request_id, error)
                    return Unanswered(replica, 502, error, "auth", upstream.status)
                if upstream.status in _RETRY_STATUSES:
                    data = await upstream.read()
                    upstream.release()
                    log.warning("request %s: replica %s answered %d", request_id, replica, upstream.status)
                    # a 429 is a busy replica, not a broken one: retry elsewhere, keep its breaker
                    stage: Stage | None = None if upstream.status == 429 else "first_byte"
                    return Unanswered(replica, upstream.status, normalize_error_body(upstream.status, data), stage)
                if upstream.status >= 400 or not stream:
                    data = await upstream.read()  # whole: within the first-byte timeout
                    upstream.release()
                    return Opened(replica, upstream, data, None)
                first = await upstream.readany()
                if not first:
                    raise UpstreamDisconnected("stream ended before its first event")
        except asyncio.CancelledError:
            if upstream is not None:
                upstream.close()  # the client left before the first byte: abort upstream too
            raise
        except _UPSTREAM_ERRORS as exc:
            if upstream is not None:
                upstream.close()
            stage = "connect" if isinstance(exc, UpstreamConnectError) else "first_byte"
            error = f"replica {replica} failed before answering ({stage}): {_describe(exc)}"
            log.warning("request %s: %s", request_id, error)
            return Unanswered(replica, 504 if isinstance(exc, TimeoutError) else 502, error, stage)
        return Opened(replica, upstream, first, time.perf_counter() - sent)

    async def respond(
        self, request: web.Request, opened: Opened, *, request_id: str, strip_usage: bool = False
    ) -> Relayed:
        """Committed: the client gets ``opened``'s answer (a stream relayed as it comes), all but
        what :meth:`finish` sends: a whole answer is sent once the handler returns it, a stream's
        answer-bearing last events and its end by ``finish``."""
        headers = {"X-Request-Id": request_id}
        if opened.ttft_s is None:
            return self._whole_response(opened.upstream, opened.data, headers)
        return await self._relay_stream(request, opened.upstream, opened.data, opened.replica, headers, strip_usage)

    @staticmethod
    async def finish(relayed: Relayed) -> None:
        """A stream's last bytes (the answer's event, an error event) and its end; nothing for a
        whole answer, which the handler returns."""
        resp = relayed.response
        if not resp.prepared:
            return
        if relayed.rest:
            await resp.write(relayed.rest)
        try:
            await resp.write_eof()
        except ConnectionResetError:
            if not relayed.complete:
                raise
            # the client had the whole answer and hung up before the response's last chunk

    @staticmethod
    def unanswered(failure: Unanswered | None, request_id: str) -> web.Response:
        """Every attempt failed before the first byte: the last replica's own error answer, else
        a 502/504 saying why (raised as an :class:`ApiError`); a 503 if no attempt was made."""
        headers = {"X-Request-Id": request_id}
        if failure is None:
            raise ApiError(503, "no replica could serve the request: no replica available",
                           code="upstream_unavailable", headers=headers)
        if isinstance(failure.error, bytes):
            return web.Response(status=failure.status, body=failure.error, content_type="application/json", headers=headers)
        code = "upstream_timeout" if failure.status == 504 else "upstream_unavailable"
        if failure.stage == "auth":
            code = "upstream_auth_failed"
        raise ApiError(failure.status, f"no replica could serve the request: {failure.error}", code=code, headers=headers)

    @staticmethod
    def _whole_response(upstream: UpstreamResponse, data: bytes, headers: dict[str, str]) -> Relayed:
        status = upstream.status
        if status >= 400:
            body = normalize_error_body(status, data)
            resp = web.Response(status=status, body=body, content_type="application/json", headers=headers)
            return Relayed(resp, status, None)
        usage = answer = None
        if b'"usage"' in data:
            try:
                payload = _decode.decode(data)
            except msgspec.DecodeError:
                payload = None
            if isinstance(payload, dict):
                usage, answer = Usage.from_json(payload.get("usage")), payload
        resp = web.Response(status=status, body=data, headers=headers)
        resp.headers["Content-Type"] = upstream.headers.get("content-type", "application/json")
        return Relayed(resp, status, usage, answer)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        first: bytes,
        replica: str,
        headers: dict[str, str],
        strip_usage: bool,
    ) -> Relayed:
        relay = SseRelay(strip_usage)
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        failed: str | None = None
        held = b""  # from the answer's event on: sent by finish(), once the caller has read the answer
        began = last_at = time.perf_counter()  # the first event came just now (open() read it)
        try:
            _nodelay(request.transport)
            await resp.prepare(request)
            chunk = first
            idle = self.timeouts.idle_s
            readany = upstream.readany
            while chunk:
                out = relay.feed(chunk)
                if relay.answer is not None:
                    held = out
                    break  # the Responses stream's last event: its end is read after
                if out:
                    await resp.write(out)  # a client that left raises here: nothing to tell it
                if relay.done:
                    break  # [DONE]: the client has its answer; the upstream's end is read after
                try:
                    async with asyncio.timeout(idle):
                        chunk = await readany()
                    last_at = time.perf_counter()
                except TimeoutError:
                    failed = f"replica {replica} sent nothing for {idle:g} s"
                    break
                except _UPSTREAM_ERRORS as exc:
                    failed = f"replica {replica} failed mid-stream: {_describe(exc)}"
                    break
            out = relay.tail()
            if relay.answer is not None:
                held += out
            elif out:
                await resp.write(out)
            if failed is None and not relay.done:
                failed = f"replica {replica} ended the stream without [DONE]"
            if failed is not None:
                log.warning("request %s: %s", headers.get("X-Request-Id"), failed)
                held += sse_error_event(failed)
        finally:
            if relay.done and failed is None:
                # the client is answered: the body's end is read off its path (a client that
                # leaves now would cancel this handler), so the connection goes back to the pool
                _in_background(_drain(upstream))
            else:
                upstream.close()  # aborts the request on the engine if it is still running
        return Relayed(
            resp, upstream.status, relay.usage, relay.answer, failed, held, relay.done and failed is None,
            relay.events, last_at - began,
        )  # fmt: skip


_background: set[asyncio.Task[None]] = set()


def _in_background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_background.discard)


async def _drain(upstream: UpstreamResponse, timeout_s: float = 1.0) -> None:
    """Read what follows [DONE] (the body's end, usually already here), so that the connection
    goes back to the pool; a replica slow to end it loses the connection instead."""
    try:
        async with asyncio.timeout(timeout_s):
            while await upstream.readany():
                pass
    except (TimeoutError, *_UPSTREAM_ERRORS):
        upstream.close()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = [
    "Opened",
    "Outcome",
    "Proxy",
    "Relayed",
    "Timeouts",
    "Unanswered",
    "make_upstream_pool",
    "make_upstream_session",
]
