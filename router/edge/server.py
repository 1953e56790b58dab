"""The router's HTTP server: aiohttp's, with the client-side limits a public proxy needs
(docs/design.md §7.5).

aiohttp's server has a keep-alive timeout but none on reading a request's head or body, so a
client that sends its headers (slowloris) or its body a byte at a time holds a connection, and a
handler, for as long as it likes.  ``ClientHandler`` (a subclass of aiohttp's per-connection
protocol) adds, as nginx and Envoy do:

- a header timeout: from the connection's accept, or the first byte of a later request, to the
  end of its head.  A client that sent part of a head gets a 408 (OpenAI's error shape), one that
  sent nothing is closed silently (nginx's ``client_header_timeout``);
- a body timeout: from the end of the head to the end of the body, in total (a per-read timeout
  would let a client trickle a byte every few seconds forever).  The handler reading the body gets
  a 408 and the connection closes;
- the keep-alive timeout between requests (aiohttp's own, set from the settings); it ends, as
  nginx's does, when the next request's first byte arrives.

It also answers the HTTP parser's errors (oversized request line or headers, Content-Length with
Transfer-Encoding, bad chunking, a non-HTTP client) in OpenAI's error shape with their proper
status, instead of aiohttp's text/plain 400, and a body the parser rejects half-way fails the
handler reading it (a 400) rather than leaving it waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_server import Server
from prometheus_client import CollectorRegistry, Counter

from kvroute.common.errors import ApiError, error_body, error_response

from kvroute.router.edge.connections import ConnectionBook, ConnectionMetrics
from kvroute.router.edge.overload.door import Door
from kvroute.router.edge.overload.saturation import kernel_wait_s

log = logging.getLogger("kvroute.router")

# A lingering close reads and drops what the client still sends until it has been quiet this long,
# at most _LINGER_MAX_S and _LINGER_MAX_BYTES in all (nginx: lingering_timeout, lingering_time).
_LINGER_S = 2.0
_LINGER_MAX_S = 30.0
_LINGER_MAX_BYTES = 64 * 1024 * 1024
# A timeout acts one loop turn after it expires: a loop running late (timers run before the turn's
# I/O) must not cut a client whose bytes are already waiting in its socket.
_ONE_MORE_TURN_S = 0.001


class _LingeringTransport:
    """A connection's transport once it is to close while its client may still be sending (a slow
    head or body cut, a body refused unread): ``close()`` sends FIN after what was written, then
    reads and drops what still arrives, and closes the socket once the client has been quiet for
    ``_LINGER_S`` (at most ``_LINGER_MAX_S`` or ``_LINGER_MAX_BYTES`` in all).  Closing with the
    client's bytes unread or still arriving makes the kernel send a reset, which destroys the
    408/413 before the client reads it: a client that writes its whole body before reading the
    answer (Python's http.client and requests do) saw a broken pipe instead of the 413 of a 20 MB
    body, because reading had stopped (paused by the unread body's buffer) and the socket closed
    2 s later with the rest unread (nginx's lingering close)."""

    def __init__(self, protocol: ClientHandler, transport: asyncio.Transport):
        self._protocol = protocol
        self._transport = transport
        self._closing = False
        self._heard = 0  # bytes dropped since close()
        self._heard_at_check = 0
        self._deadline = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._protocol._close = True  # noqa: SLF001 - what the client still sends is ignored
        t = self._transport
        if t.is_closing():
            return
        if t.can_write_eof():
            t.write_eof()
        t.resume_reading()  # reading may be paused (an unread body filled its buffer): drain it
        loop = self._protocol._loop  # noqa: SLF001
        self._deadline = loop.time() + _LINGER_MAX_S
        loop.call_later(_LINGER_S, self._check)

    def heard(self, nbytes: int) -> None:
        """The client sent ``nbytes`` more after close(): dropped."""
        self._heard += nbytes
        if self._heard > _LINGER_MAX_BYTES:
            self._transport.close()

    def _check(self) -> None:
        t = self._transport
        if t.is_closing():
            return
        loop = self._protocol._loop  # noqa: SLF001
        if self._heard == self._heard_at_check or loop.time() >= self._deadline:
            t.close()  # quiet for _LINGER_S (or lingered long enough)
            return
        self._heard_at_check = self._heard
        loop.call_later(_LINGER_S, self._check)


@dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    # called with "header" or "body" each time a client is cut for being slow (a metric)
    on_timeout: Callable[[str], None] | None = None
    # client connections held open at most (0: no cap), see connections.py; counted there
    max_connections: int = 0
    connection_metrics: ConnectionMetrics | None = None
    # refuses a tenant's requests over its fair share while the router is short of CPU (overload/door.py)
    door: Door | None = None


def count_timeouts(registry: CollectorRegistry) -> Callable[[str], None]:
    """``ClientLimits.on_timeout`` that counts ``kvroute_client_timeouts_total{stage}``."""
    counter = Counter(
        "kvroute_client_timeouts", "client connections cut for sending their head or body too slowly", ["stage"],
        registry=registry,
    )
    for stage in ("header", "body"):
        counter.labels(stage)  # both series exist from the start, at 0
    return lambda stage: counter.labels(stage).inc()


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response, for when no request object exists yet (a head timed out)."""
    body = msgspec.json.encode(error_body(message, status, code=code))
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def parser_error(exc: BaseException | None, message: str | None) -> tuple[int, str, str]:
    """(status, code, message) for an error of aiohttp's HTTP parser."""
    text = message or (exc.message if isinstance(exc, BadHttpMessage) else "")
    if isinstance(exc, LineTooLong):
        # the request line is the only thing aiohttp buffers in a bytearray; header fields are bytes
        if isinstance(exc.args[0], bytearray):
            return 414, "uri_too_long", "request line too long"
        return 431, "request_header_fields_too_large", "request header field too large"
    if "Too many headers" in text:
        return 431, "request_header_fields_too_large", "too many request header fields"
    return 400, "invalid_http_request", f"malformed HTTP request: {_first_line(text)}"


class ClientHandler(RequestHandler):
    """One client connection: aiohttp's protocol plus header/body timeouts and JSON parser errors."""

    __slots__ = (
        "_limits", "_head_timer", "_head_bytes", "_heads_before", "_body", "_body_timer", "_last_body", "_book",
        "_lingering", "heard_at", "ready_at", "_answered",
    )

    def __init__(self, manager: Server, *, limits: ClientLimits, **kwargs: Any):
        super().__init__(manager, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self._limits = limits
        # the server's open connections (the connection cap), None when served by aiohttp's own Server
        self._book: ConnectionBook | None = manager.book if isinstance(manager, _ClientServer) else None
        self._lingering: _LingeringTransport | None = None  # set by linger()
        # when the router last read bytes of this connection (monotonic): with TCP_INFO's time since
        # the kernel received them, how long they waited in the kernel (overload/saturation.py)
        self.heard_at = 0.0
        # when it finished answering its last request (aiohttp reads no further request before): a
        # pipelined request waits in the kernel for the one before it, not for a busy router
        self.ready_at = 0.0
        self._answered = 0  # requests answered: with _request_count, whether one is still unanswered
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # bytes of a head not yet complete have arrived
        self._heads_before = 0  # requests parsed when the header timer was armed
        self._body: StreamReader | None = None  # the body being received
        self._body_timer: asyncio.TimerHandle | None = None
        # the body of the request after whose answer the connection closes (see close_after)
        self._last_body: StreamReader | None = None

    # -- timers -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # from the accept, as nginx does: a client that says nothing is cut too (the header timeout
        # replaces aiohttp's keep-alive timer until the first request, so only one of them fires)
        if self._limits.header_timeout_s > 0 and self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        self._arm_head()
        if self._book is not None and not self._book.opened(self):
            self._refuse()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head()
        self._cancel_body()
        if self._book is not None:
            self._book.closed(self)
            self._book = None
        super().connection_lost(exc)

    # -- the connection cap (connections.py) ------------------------------------------------
    def _refuse(self) -> None:
        """Over the cap with no idle connection to evict: a 503 and close, before any request.
        Closed at once, not lingering: a lingering close would hold the descriptor the cap saves."""
        assert self._book is not None
        self._cancel_head()
        if self.transport is not None:
            self.transport.write(_raw_error(
                503, "Service Unavailable",
                f"the router holds {self._book.limit} client connections, its limit, none of them idle; retry shortly",
                "server_busy",
            ))
        self.force_close()

    def evict(self) -> None:
        """Close this idle connection for a new one (the cap): as the keep-alive timeout would."""
        self._cancel_head()
        self.force_close()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's, then the connection is idle (evictable) if it waits for its next request:
        nothing of it queued or arriving, its request's body read, not closing."""
        result = await super().finish_response(request, resp, start_time)
        self.ready_at = time.monotonic()
        self._answered += 1
        if (
            self._book is not None and not self._messages and not self._head_bytes and request.content.is_eof()
            and not self._close and not self._force_close
        ):
            self._book.idle(self)
        return result

    def _arm_head(self) -> None:
        if self._head_timer is None and self._limits.header_timeout_s > 0:
            self._heads_before = self._request_count
            self._head_timer = self._loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = False

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body = None

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        if self._force_close or self._close:
            if self._lingering is not None:
                self._lingering.heard(len(data))
            return
        door = self._limits.door
        if door is not None and door.shares.active and self._at_boundary():
            data = self._through_door(door, data)
            if not data:
                return
        if self._body is None and data:
            self._arm_head()  # the first bytes of a new request (or more of its head)
            self._head_bytes = True
            if self._book is not None:
                self._book.busy(self)  # not evicted while its request is read and answered
            if self._keepalive_handle is not None:  # no longer idle: the header timeout applies
                self._keepalive_handle.cancel()
                self._keepalive_handle = None
        before = self._request_count
        super().data_received(data)
        body = self._body
        if body is not None and body.is_eof():
            self._cancel_body()
            body = None
        elif body is not None and body.exception() is not None:
            self._cancel_body()
            self.close_after(body)
            return
        if self._request_count == before:
            return
        # heads completed (or the parser failed): the last one decides what comes next
        self._cancel_head()
        msg, payload = self._messages[-1]
        if isinstance(msg, _ErrInfo):
            if body is not None:  # the parser failed inside this body: fail its reader, serve nothing after
                self._fail_body(body, ApiError(400, f"malformed request body: {_first_line(msg.message)}",
                                               code="invalid_request_body"))
            return
        if payload.exception() is not None:
            self.close_after(payload)
        elif not payload.is_eof():
            self._body = payload
            if self._limits.body_timeout_s > 0:
                self._body_timer = self._loop.call_later(self._limits.body_timeout_s, self._body_timed_out)

    def _at_boundary(self) -> bool:
        """The next bytes start a request and every request before it is answered (so that an
        answer written now is in order): nothing of a head or body pending, nothing queued."""
        return (
            self._body is None and not self._head_bytes and not self._messages and self._answered == self._request_count
            and self._payload_parser is None and not self._upgraded
        )

    def _through_door(self, door: Door, data: bytes) -> bytes:
        """The door's refusals of the requests at the start of ``data``; what is left for aiohttp."""
        assert self.transport is not None
        sock, peer = self.transport.get_extra_info("socket"), self._peer()
        while data:
            refusal = door.judge(data, peer, kernel_wait_s(sock, self.heard_at, self.ready_at))
            if refusal is None:
                return data
            self.transport.write(refusal.answer)
            self.ready_at = time.monotonic()
            if not refusal.consumed:  # its body is still arriving: close once the client is done
                self._cancel_head()
                self._close_lingering()
                return b""
            data = data[refusal.consumed:]
            # answered: quiet from here, the connection is as a new one (the header timeout, not the keep-alive)
            if self._keepalive_handle is not None:
                self._keepalive_handle.cancel()
                self._keepalive_handle = None
            self._cancel_head()
            self._arm_head()
        return data

    def _peer(self) -> str | None:
        peername = self.transport.get_extra_info("peername") if self.transport is not None else None
        return peername[0] if isinstance(peername, tuple) else None

    def close_after(self, body: StreamReader) -> None:
        """Close the connection once the request with this ``body`` is answered (its answer says
        ``Connection: close``, see :func:`announce_close`), without reading the rest of the body
        to discard it.  Not ``self.close()``: called while aiohttp's loop may be between two
        requests, that would drop a request already queued without an answer."""
        self._lingering_time = 0.0
        self._last_body = body

    def _head_timed_out(self, checked: bool = False) -> None:
        if not checked:  # see _ONE_MORE_TURN_S
            self._head_timer = self._loop.call_later(_ONE_MORE_TURN_S, self._head_timed_out, True)
            return
        self._head_timer = None
        if self._force_close or self._close or self.transport is None:
            return
        if self._request_count != self._heads_before:  # the head completed where we did not see it
            self._head_bytes = False  # (aiohttp parsing what followed a declined Upgrade): idle now
            return
        if self._waiter is None or self._waiter.done():  # a request is being answered: look again after
            self._arm_head()
            return
        if self._limits.on_timeout is not None:
            self._limits.on_timeout("header")
        if not self._head_bytes:
            self.force_close()  # said nothing: nothing to answer
            return
        t = self._limits.header_timeout_s
        self.transport.write(
            _raw_error(408, "Request Timeout", f"request headers not received within {t:g} s", "request_timeout")
        )
        self._close_lingering()  # idle (checked above): ends aiohttp's wait for a request

    def _close_lingering(self) -> None:
        """Close after an answer written at this level (no request object): the client's bytes still
        arriving are read and dropped first, so that the answer is not destroyed by a reset."""
        self.close()
        self.linger()
        assert self.transport is not None
        self.transport.close()

    def linger(self) -> None:
        """From now on, closing this connection is a lingering close (:class:`_LingeringTransport`)."""
        if self.transport is not None and not isinstance(self.transport, _LingeringTransport):
            self._lingering = _LingeringTransport(self, self.transport)
            self.transport = self._lingering  # type: ignore[assignment]

    def _body_timed_out(self, checked: bool = False) -> None:
        if not checked:  # see _ONE_MORE_TURN_S
            self._body_timer = self._loop.call_later(_ONE_MORE_TURN_S, self._body_timed_out, True)
            return
        body, self._body_timer = self._body, None
        if body is None or body.is_eof() or self._force_close or self.transport is None:
            return
        if self._limits.on_timeout is not None:
            self._limits.on_timeout("body")
        t = self._limits.body_timeout_s
        self._fail_body(body, ApiError(408, f"request body not received within {t:g} s", code="request_timeout"))

    def _fail_body(self, body: StreamReader, exc: ApiError) -> None:
        """The handler reading ``body`` (now or once it starts) gets ``exc``, answered by the error
        middleware; then the connection closes: the rest of that body is never read."""
        self._cancel_body()
        self.close_after(body)
        self.linger()  # the client may still be sending this body
        body.set_exception(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp reading the rest of an answered request's body meets the error set above: expected
        if isinstance(kw.get("exc_info"), ApiError):
            log.debug("client connection closed: %s", kw["exc_info"].message)
            return
        super().log_exception(*args, **kw)

    # -- parser errors ------------------------------------------------------------------------
    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's parser errors (and anything escaping a handler) in OpenAI's error shape."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started: cannot send an error response")
        if status >= 500:
            log.error("error handling request from %s", request.remote, exc_info=exc)
            resp = error_response(status, "internal router error", code="internal_error")
        else:
            log.debug("malformed request from %s: %s", request.remote, exc)
            status, code, text = parser_error(exc, message)
            resp = error_response(status, text, code=code)
        resp.force_close()
        return resp


async def announce_close(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an answer on a connection about to close says ``Connection: close``,
    so that a client's pool does not send its next request into a closing socket."""
    protocol = request.protocol
    if isinstance(protocol, ClientHandler) and protocol._last_body is request.content:  # noqa: SLF001
        response.force_close()
        response.headers["Connection"] = "close"


def close_after_answer(request: web.BaseRequest) -> None:
    """This request's body will not be read (refused early): close the connection after the
    answer instead of letting aiohttp read up to the whole declared body to discard it."""
    protocol = request.protocol
    if isinstance(protocol, ClientHandler):
        protocol.close_after(request.content)
        protocol.linger()


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:200] if lines else "the HTTP parser rejected it"


class _ClientServer(Server):
    def __init__(self, *args: Any, limits: ClientLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self.book = ConnectionBook(limits.max_connections, limits.connection_metrics)

    def __call__(self) -> RequestHandler:
        return ClientHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)


class ClientAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are :class:`ClientHandler`\\ s."""

    __slots__ = ("_limits",)

    def __init__(self, app: web.Application, *, limits: ClientLimits, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        return _ClientServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,  # noqa: SLF001 - the loop aiohttp chose
            limits=self._limits,
            **server._kwargs,  # noqa: SLF001 - the handler options aiohttp assembled
        )


class ClientSite(web.TCPSite):
    """aiohttp's TCP site, with the TLS handshake bounded by ``handshake_timeout_s`` (the header
    timeout): asyncio gives a handshake 60 s, and :class:`ClientHandler`'s header timeout starts only
    once it is done (the protocol sees the connection then), so a client that opens TLS connections
    and never finishes a handshake would hold each socket for a minute.  Plain HTTP: TCPSite's own."""

    __slots__ = ("handshake_timeout_s",)

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, handshake_timeout_s: float | None,
                 **kwargs: Any):
        super().__init__(runner, host, port, **kwargs)
        self.handshake_timeout_s = handshake_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None or self.handshake_timeout_s is None:
            await super().start()
            return
        await web.BaseSite.start(self)  # as TCPSite.start, with the handshake's bound
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            ssl_handshake_timeout=self.handshake_timeout_s,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
