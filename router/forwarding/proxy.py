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
connection), so no event waits on Nagle.  The only parsing is what the router needs: each chunk is
scanned for a usage object (a regex search, in C) and only events that carry one are decoded, to
read ``cached_tokens`` and to withhold the usage-only chunk from a client that did not ask for it.

Timeouts: connect (TCP), first byte (request sent to first response event; for a non-streamed
answer that is the whole generation), idle (longest silence between two stream chunks).  A client
that disconnects cancels the handler (the app runs with ``handler_cancellation``), which closes
the upstream connection, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvroute.common.errors import ApiError, sse_error_event

from kvroute.router.aio import set_nodelay
from kvroute.router.forwarding.replica_errors import error_payload, normalize_error_body
from kvroute.router.forwarding.upstream import UpstreamConnectError, UpstreamDisconnected, UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger("kvroute.router")

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DONE = b"[DONE]"
# a usage object (not the "usage": null every OpenAI-style chunk carries), an error event in a
# shape that may need rewriting (replica_errors.py), or a Responses stream's last event: only
# then decode.  Text inside a JSON string
# cannot match (its quotes are escaped).
_LOOK = re.compile(  # one leading quote: the search stops only at quotes (~1 us on a 200-byte chunk)
    rb'"(?:usage"\s*:\s*\{|error"\s*:|object"\s*:\s*"error"|detail"\s*:'
    rb'|type"\s*:\s*"response\.(?:completed|incomplete|failed)")'
)
# upstream failures that leave nothing to read; retryable while nothing was written to the client
# (UpstreamError is an OSError; TimeoutError is asyncio.timeout's)
_UPSTREAM_ERRORS = (OSError, TimeoutError)
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# the last event of a Responses API stream
_RESPONSE_END = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float


@dataclass
class Usage:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        """Chat/completions usage, or the Responses API's (input/output tokens)."""
        if not isinstance(usage, dict):
            return None
        if "prompt_tokens" not in usage and "input_tokens" in usage:
            prompt, details, completion = usage.get("input_tokens"), usage.get("input_tokens_details"), usage.get("output_tokens")
        else:
            prompt, details, completion = usage.get("prompt_tokens"), usage.get("prompt_tokens_details"), usage.get("completion_tokens")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=_int_or_none(prompt),
            cached_tokens=_int_or_none(cached),
            completion_tokens=_int_or_none(completion),
        )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class Outcome:
    """What happened to a proxied request, for metrics and the load tracker."""

    replica: str | None = None
    status: int = 0
    usage: Usage | None = None
    ttft_s: float | None = None
    attempts: int = 0
    sent_at: float | None = None  # perf_counter when the first upstream request was sent
    error: str | bytes | None = None  # why the last attempt failed before the first byte (bytes: its answer)
    extra: dict[str, Any] = field(default_factory=dict)
    # called with the answer's JSON object (a whole 2xx body, or the response in a Responses stream's
    # last event: decoded anyway for the usage) before the client has it
    on_answer: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True, slots=True)
class Opened:
    """A replica's answer past its first byte: the request is committed to it."""

    replica: str
    upstream: UpstreamResponse
    data: bytes  # the whole body (non-streamed or an error), else the stream's first chunk
    ttft_s: float | None  # a stream's time to its first event; None for a whole answer


def make_upstream_session(timeouts: Timeouts) -> aiohttp.ClientSession:
    """One pooled session for the fleet's probes and scrapes (requests go through ``make_upstream_pool``)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0, ttl_dns_cache=60)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
        # replicas speak identity; never pay for decompression, and pass bytes through as they are
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        auto_decompress=False,
    )


def make_upstream_pool(timeouts: Timeouts) -> UpstreamPool:
    """The keep-alive connections every proxied request goes through."""
    return UpstreamPool(timeouts.connect_s, keepalive_s=30.0)


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


class SseRelay:
    """Frames SSE events across chunk boundaries, reads usage, withholds the usage-only chunk."""

    __slots__ = ("strip_usage", "usage", "done", "on_response", "_pending")

    def __init__(self, strip_usage: bool, on_response: Callable[[dict[str, Any]], None] | None = None):
        self.strip_usage = strip_usage
        self.usage: Usage | None = None
        self.done = False
        self.on_response = on_response  # called with a Responses stream's final response object
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send the client now: every complete event so far, minus withheld ones."""
        data = self._pending + chunk if self._pending else chunk
        cut = _last_event_end(data)
        if cut == 0:
            self._pending = data
            return b""
        complete, self._pending = data[:cut], data[cut:]
        if _DONE in complete:
            self.done = True
        if _LOOK.search(complete) is None:
            return complete  # the common case: forwarded untouched, nothing decoded
        return b"".join(self._filter(ev) for ev in _split_events(complete))

    def _filter(self, event: bytes) -> bytes:
        if _LOOK.search(event) is None:
            return event
        payload = _event_json(event)
        if not isinstance(payload, dict):
            return event
        if payload.get("type") in _RESPONSE_END and isinstance(payload.get("response"), dict):
            # the Responses API ends its stream with this event (no [DONE]); it carries the usage
            self.done = True
            response = payload["response"]
            self.usage = Usage.from_json(response.get("usage")) or self.usage
            if self.on_response is not None:
                self.on_response(response)
            return event
        if not isinstance(payload.get("usage"), dict):
            rewritten = error_payload(payload, 500)  # a replica's in-stream error, in OpenAI's shape
            return event if rewritten is None else b"data: " + _encode.encode(rewritten) + b"\n\n"
        self.usage = Usage.from_json(payload["usage"]) or self.usage
        if not self.strip_usage:
            return event
        if not payload.get("choices"):
            return b""  # the usage-only chunk the router asked for on the client's behalf
        payload.pop("usage")
        return b"data: " + _encode.encode(payload) + b"\n\n"

    def tail(self) -> bytes:
        """An unterminated last event, if the stream ended without its blank line."""
        rest, self._pending = self._pending, b""
        if rest.strip():
            if _DONE in rest:
                self.done = True
            return self._filter(rest) + b"\n\n"
        return b""


def _last_event_end(data: bytes) -> int:
    """Offset just past the last complete event (0 if none): a blank line ends an event."""
    if b"\r" not in data:  # what every engine sends: one C-speed search from the end
        i = data.rfind(b"\n\n")
        return i + 2 if i >= 0 else 0
    end = 0
    for m in _EVENT_END.finditer(data):
        end = m.end()
    return end


def _split_events(data: bytes) -> list[bytes]:
    events, start = [], 0
    for m in _EVENT_END.finditer(data):
        events.append(data[start : m.end()])
        start = m.end()
    return events


def _event_json(event: bytes) -> Any:
    lines = [ln[5:].lstrip() for ln in event.splitlines() if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        return _decode.decode(b"\n".join(lines))
    except msgspec.DecodeError:
        return None


class Proxy:
    def __init__(
        self,
        pool: UpstreamPool,
        timeouts: Timeouts,
        *,
        replica_url: Callable[[str], str | None],
        upstream_headers: Mapping[str, str],
        on_failure: Callable[[str, str], None],
        on_success: Callable[[str], None],
    ):
        """``on_failure(replica, stage)`` with stage connect|first_byte|mid_stream; ``on_success(replica)``."""
        self.pool = pool
        self.timeouts = timeouts  # connect is the pool's; first byte and idle are open() and respond()'s own
        self.replica_url = replica_url
        # what every upstream request carries (the replicas' own API key), merged once
        self._fixed_headers = {**upstream_headers, "Content-Type": "application/json"}
        self.on_failure = on_failure
        self.on_success = on_success

    def _headers(self, request_id: str) -> dict[str, str]:
        return {**self._fixed_headers, "X-Request-Id": request_id}

    async def _send(self, replica: str, path: str, body: bytes, request_id: str) -> UpstreamResponse:
        base = self.replica_url(replica)
        if base is None:  # left the fleet between the decision and now
            raise UpstreamError(f"replica {replica} is gone")
        return await self.pool.request(base, path, self._headers(request_id), body)

    async def open(
        self, replica: str, path: str, body: bytes, *, request_id: str, stream: bool, outcome: Outcome
    ) -> Opened | None:
        """Send ``body`` to ``replica`` and wait for its first byte (a stream's first event, or a
        whole non-streamed answer).  None when it failed before that: retryable elsewhere, the
        reason kept in ``outcome`` for :meth:`unanswered`."""
        outcome.attempts += 1
        outcome.replica = replica
        sent = time.perf_counter()
        if outcome.sent_at is None:
            outcome.sent_at = sent
        upstream: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                upstream = await self._send(replica, path, body, request_id)
                if upstream.status in _RETRY_STATUSES:
                    data = await upstream.read()
                    upstream.release()
                    outcome.status, outcome.error = upstream.status, normalize_error_body(upstream.status, data)
                    log.warning("request %s: replica %s answered %d", request_id, replica, upstream.status)
                    # a 429 is a busy replica, not a broken one: retry elsewhere, keep its breaker
                    if upstream.status != 429:
                        self.on_failure(replica, "first_byte")
                    return None
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
            outcome.status = 504 if isinstance(exc, TimeoutError) else 502
            outcome.error = f"replica {replica} failed before answering ({stage}): {_describe(exc)}"
            log.warning("request %s: %s", request_id, outcome.error)
            self.on_failure(replica, stage)
            return None
        outcome.ttft_s = time.perf_counter() - sent
        return Opened(replica, upstream, first, outcome.ttft_s)

    async def respond(
        self, request: web.Request, opened: Opened, *, request_id: str, strip_usage: bool = False, outcome: Outcome
    ) -> web.StreamResponse:
        """Committed: the client gets ``opened``'s answer (a stream relayed as it comes)."""
        headers = {"X-Request-Id": request_id}
        upstream = opened.upstream
        if opened.ttft_s is None:
            self.on_success(opened.replica)
            return self._whole_response(upstream, opened.data, headers, outcome)
        return await self._relay_stream(request, upstream, opened.data, opened.replica, headers, strip_usage, outcome)

    @staticmethod
    def unanswered(outcome: Outcome, request_id: str) -> web.Response:
        """Every attempt failed before the first byte: the last replica's own error answer, else
        a 502/504 saying why (raised as an :class:`ApiError`)."""
        headers = {"X-Request-Id": request_id}
        if not outcome.attempts:
            outcome.status = 503
        if isinstance(outcome.error, bytes):
            return web.Response(status=outcome.status, body=outcome.error, content_type="application/json", headers=headers)
        code = "upstream_timeout" if outcome.status == 504 else "upstream_unavailable"
        reason = outcome.error or "no replica available"
        raise ApiError(outcome.status, f"no replica could serve the request: {reason}", code=code, headers=headers)

    async def forward_plain(
        self,
        request: web.Request,
        replicas: list[str],
        path: str,
        body: bytes,
        *,
        request_id: str,
        outcome: Outcome,
    ) -> web.StreamResponse:
        """Pass-through endpoints (/tokenize, /v1/embeddings ...): no routing, tried in order."""
        for replica in replicas:
            opened = await self.open(replica, path, body, request_id=request_id, stream=False, outcome=outcome)
            if opened is not None:
                return await self.respond(request, opened, request_id=request_id, outcome=outcome)
        return self.unanswered(outcome, request_id)

    @staticmethod
    def _whole_response(
        upstream: UpstreamResponse, data: bytes, headers: dict[str, str], outcome: Outcome
    ) -> web.Response:
        status = upstream.status
        outcome.status = status
        if status >= 400:
            body = normalize_error_body(status, data)
            return web.Response(status=status, body=body, content_type="application/json", headers=headers)
        if b'"usage"' in data:
            try:
                payload = _decode.decode(data)
            except msgspec.DecodeError:
                payload = None
            if isinstance(payload, dict):
                outcome.usage = Usage.from_json(payload.get("usage"))
                if outcome.on_answer is not None:
                    outcome.on_answer(payload)
        resp = web.Response(status=status, body=data, headers=headers)
        resp.headers["Content-Type"] = upstream.headers.get("content-type", "application/json")
        return resp

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        first: bytes,
        replica: str,
        headers: dict[str, str],
        strip_usage: bool,
        outcome: Outcome,
    ) -> web.StreamResponse:
        relay = SseRelay(strip_usage, outcome.on_answer)
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        outcome.status = upstream.status
        failed: str | None = None
        drained = False
        try:
            _nodelay(request.transport)
            await resp.prepare(request)
            chunk = first
            idle = self.timeouts.idle_s
            readany = upstream.readany
            while chunk:
                out = relay.feed(chunk)
                if out:
                    await resp.write(out)  # a client that left raises here: nothing to tell it
                if relay.done:
                    break  # [DONE]: the client has its answer; the upstream's end is read after
                try:
                    async with asyncio.timeout(idle):
                        chunk = await readany()
                except TimeoutError:
                    failed = f"replica {replica} sent nothing for {idle:g} s"
                    break
                except _UPSTREAM_ERRORS as exc:
                    failed = f"replica {replica} failed mid-stream: {_describe(exc)}"
                    break
            out = relay.tail()
            if out:
                await resp.write(out)
            if failed is None and not relay.done:
                failed = f"replica {replica} ended the stream without [DONE]"
            if failed is None:
                self.on_success(replica)
            else:
                log.warning("request %s: %s", headers.get("X-Request-Id"), failed)
                self.on_failure(replica, "mid_stream")
                outcome.extra["mid_stream_error"] = failed
                await resp.write(sse_error_event(failed))
            try:
                await resp.write_eof()
            except ConnectionResetError:
                if failed is not None or not relay.done:
                    raise
                # the client had the whole answer and hung up before the response's last chunk
            if relay.done and failed is None:
                # the client is answered: the body's end is read off its path (a client that
                # leaves now would cancel this handler), so the connection goes back to the pool
                _in_background(_drain(upstream))
                drained = True
        finally:
            outcome.usage = relay.usage
            if drained:
                pass
            elif relay.done and failed is None:
                upstream.release()
            else:
                upstream.close()  # aborts the request on the engine if it is still running
        return resp


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
    "SseRelay",
    "Timeouts",
    "Usage",
    "make_upstream_pool",
    "make_upstream_session",
    "normalize_error_body",
]
