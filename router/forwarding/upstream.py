"""A lean pooled HTTP/1.1 client for the router's one kind of upstream call.

Why not aiohttp's client: every proxied request went through ``ClientSession.post`` — a
``ClientRequest`` and a ``ClientResponse``, multidicts for both header sets, yarl URL joins,
timer and tracing contexts, a ``StreamReader`` and a payload writer.  Measured side by side by
``python -m kvroute.bench.upstream_bench`` against an aiohttp server, this client spends well
under half of aiohttp's client CPU per request, for whole answers and SSE streams alike
(docs/benchmarks.md quotes the figures).

The peer is always a vLLM-compatible replica (uvicorn/h11, or aiohttp in the emulated one): one
POST with a JSON body, answered with a whole body (``Content-Length``), an SSE stream (chunked, or
delimited by the server closing).  So this client does exactly that and no more: keep-alive
connections per (host, port) on an ``asyncio.Protocol``, the request written in one
``transport.write``, the status line and headers parsed with ``bytes.find``/``split``, the body
de-chunked in ``data_received`` into a list that ``readany`` hands out, one future per wait.

Reusing an idle connection races with the server closing it (uvicorn drops idle ones after 5 s):
when a *reused* connection ends before any response byte, the request is sent once more on a new
connection, as the server most likely closed it without reading the request.  (aiohttp 3.14 does
this for idempotent methods only; a generation has no side effect besides its cost, and the
alternative is failing over a request the replica never saw.)  A new connection is never retried.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Mapping
from urllib.parse import quote, urlsplit

from kvroute.router.aio import set_nodelay

MAX_HEAD_BYTES = 64 * 1024  # status line + headers; a larger head is malformed
MAX_CHUNK_LINE = 4096  # a chunk-size line (with extensions) or a trailer line
PAUSE_ABOVE = 1 << 20  # unread body bytes at which the socket stops being read (until a read)

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

# what a connection is doing
_IDLE, _HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _COMPLETE = range(6)
# where a chunked body is: a size line, chunk data, the CRLF after the data, trailers
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class UpstreamError(OSError):
    """A replica could not be reached or answered something this client cannot read."""


class UpstreamConnectError(UpstreamError):
    """No connection: refused, unreachable, name unknown, or the connect timeout passed."""


class UpstreamDisconnected(UpstreamError):
    """The connection ended before the response (or its body) was complete."""


class UpstreamProtocolError(UpstreamError):
    """A malformed response: bad status line, headers, framing or chunk size."""


class UpstreamResponse:
    """Status and headers of an answer; its body is read with ``read`` or ``readany``.

    ``headers`` is a plain dict with lower-cased names.  The body must end with ``release``
    (reads to the end release by themselves) or ``close`` (which aborts the request upstream);
    after either, ``release`` and ``close`` do nothing.
    """

    __slots__ = ("status", "headers", "transport", "_conn", "_closed")

    def __init__(self, status: int, headers: dict[str, str], conn: _Connection):
        self.status = status
        self.headers = headers
        self.transport = conn.transport
        self._conn: _Connection | None = conn
        self._closed = False

    async def readany(self) -> bytes:
        """The next body bytes received (de-chunked), or b"" once the body is complete."""
        conn = self._conn
        if conn is None:
            if self._closed:
                raise UpstreamDisconnected("response was closed")
            return b""
        while True:
            chunks = conn.chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                conn.buffered = 0
                if conn.paused:
                    conn.resume()
                return data
            if conn.mode == _COMPLETE:
                self.release()
                return b""
            if conn.error is not None:
                self.close()
                raise conn.error
            waiter = conn.waiter = conn.loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self.close()  # a timeout or a client that left: the body's end will never be read
                raise
            finally:
                conn.waiter = None

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        conn = self._conn
        if conn is not None and conn.mode == _COMPLETE:  # the usual case: it came with the headers
            chunks = conn.chunks
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self.release()
            return data
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: a complete body leaves the connection pooled, else it is closed."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if conn.mode == _COMPLETE and conn.keep_alive and not conn.closed:
            conn.pool._put_idle(conn)
        else:
            self._closed = conn.mode != _COMPLETE
            conn.close()

    def close(self) -> None:
        """Close the connection (a replica aborts a request whose connection closes)."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        self._closed = True
        conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses the response to the request in flight."""

    __slots__ = (
        "pool", "key", "loop", "transport", "closed", "idle_since", "head_waiter", "head_buf",
        "got_bytes", "no_body", "mode", "left", "cstate", "cbuf", "chunks", "buffered", "paused",
        "error", "waiter", "keep_alive",
    )  # fmt: skip

    def __init__(self, pool: UpstreamPool, key: tuple[str, int], loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.closed = False
        self.idle_since = 0.0
        self.head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self.head_buf = b""
        self.got_bytes = False
        self.no_body = False
        self.mode = _IDLE
        self.left = 0
        self.cstate = _SIZE
        self.cbuf = b""
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.keep_alive = True

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)  # once per connection: no request waits on Nagle

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._lost(self)
        mode = self.mode
        if mode == _UNTIL_CLOSE and exc is None:
            self.mode = _COMPLETE  # a close-delimited body ends here
            self._wake()
        elif mode in (_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE) and self.error is None:
            where = "the response" if mode == _HEAD else "the end of the body"
            err = UpstreamDisconnected(
                f"replica closed the connection before {where}" + (f" ({exc})" if exc else "")
            )
            err.__cause__ = exc
            self._fail(err)

    def data_received(self, data: bytes) -> None:
        mode = self.mode
        if mode == _CHUNKED:
            self._feed_chunked(data)
        elif mode == _LENGTH:
            self._feed_length(data)
        elif mode == _HEAD:
            self.got_bytes = True
            self._feed_head(data)
        elif mode == _UNTIL_CLOSE:
            self._append(data)
        else:  # bytes nobody asked for (while idle, or after the body): the stream is out of step
            self.keep_alive = False
            if mode == _IDLE:
                self.close()

    # -- the request ----------------------------------------------------------------------------
    async def send(self, data: bytes, no_body: bool) -> UpstreamResponse:
        """Write a request; the response once its status line and headers have arrived."""
        if self.closed or self.transport.is_closing():
            raise UpstreamDisconnected("connection already closed")
        self.mode = _HEAD
        self.got_bytes = False
        self.no_body = no_body
        self.keep_alive = True
        self.error = None
        self.cstate = _SIZE
        self.cbuf = b""
        waiter = self.head_waiter = self.loop.create_future()
        try:
            self.transport.write(data)
            return await waiter
        except BaseException:  # failed, or cancelled (a timeout, a client that left): never reuse
            self.close()
            raise
        finally:
            self.head_waiter = None

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def resume(self) -> None:
        self.paused = False
        if not self.closed:
            self.transport.resume_reading()

    # -- parsing --------------------------------------------------------------------------------
    def _feed_head(self, data: bytes) -> None:
        if self.head_buf:
            data = self.head_buf + data
            self.head_buf = b""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > MAX_HEAD_BYTES:
            if len(data) > MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError(f"response headers exceed {MAX_HEAD_BYTES // 1024} KiB"))
            else:
                self.head_buf = data
            return
        try:
            status, headers, http10 = _parse_head(data[:end])
        except ValueError as exc:
            self._fail(UpstreamProtocolError(f"malformed response head: {exc}"))
            return
        rest = data[end + 4 :]
        if status < 200:  # 1xx interim answers (103 Early Hints...): the real one follows
            if rest:
                self._feed_head(rest)
            return
        conn_opts = headers.get("connection", "").lower()
        self.keep_alive = "keep-alive" in conn_opts if http10 else "close" not in conn_opts
        te = headers.get("transfer-encoding")
        if self.no_body or status in (204, 304):
            self.mode = _COMPLETE
        elif te is not None:
            if te.lower().rstrip().endswith("chunked"):
                self.mode = _CHUNKED
            else:  # a body coded some other way ends when the server closes
                self.mode = _UNTIL_CLOSE
                self.keep_alive = False
        elif (length := headers.get("content-length")) is not None:
            if not (length.isascii() and length.isdigit()):
                self._fail(UpstreamProtocolError(f"bad Content-Length {length!r}"))
                return
            self.left = int(length)
            self.mode = _LENGTH if self.left else _COMPLETE
        else:
            self.mode = _UNTIL_CLOSE
            self.keep_alive = False
        waiter = self.head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(UpstreamResponse(status, headers, self))
        if rest:
            self.data_received(rest)

    def _feed_length(self, data: bytes) -> None:
        left = self.left
        n = len(data)
        if n < left:
            self.left = left - n
            self._append(data)
            return
        if n > left:  # more than the body: the connection is out of step
            data = data[:left]
            self.keep_alive = False
        self.left = 0
        self.mode = _COMPLETE
        self._append(data)

    def _feed_chunked(self, data: bytes) -> None:
        if self.cbuf:
            data = self.cbuf + data
            self.cbuf = b""
        pos, n = 0, len(data)
        state = self.cstate
        out = self.chunks
        added = 0
        while pos < n:
            if state == _DATA:
                take = self.left
                if n - pos <= take:
                    piece = data if pos == 0 else data[pos:]
                    take = n - pos
                else:
                    piece = data[pos : pos + take]
                out.append(piece)
                added += take
                pos += take
                self.left -= take
                if self.left == 0:
                    state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    self.cbuf = data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    self._fail(UpstreamProtocolError("chunk data not followed by CRLF"))
                    return
                pos += 2
                state = _SIZE
            else:  # a line: a chunk size (with extensions) or a trailer
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        self._fail(UpstreamProtocolError("chunk size or trailer line too long"))
                        return
                    self.cbuf = data[pos:]
                    break
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:  # the blank line that ends the body
                        self.mode = _COMPLETE
                        if pos < n:
                            self.keep_alive = False
                        break
                    continue
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if _HEX.fullmatch(size_text) is None:
                    self._fail(UpstreamProtocolError(f"bad chunk size {line[:40]!r}"))
                    return
                self.left = int(size_text, 16)
                state = _DATA if self.left else _TRAILER
        self.cstate = state
        self.buffered += added
        if self.buffered > PAUSE_ABOVE and not self.paused:
            self._pause()
        self._wake()

    def _append(self, data: bytes) -> None:
        if data:
            self.chunks.append(data)
            self.buffered += len(data)
            if self.buffered > PAUSE_ABOVE and not self.paused:
                self._pause()
        self._wake()

    def _pause(self) -> None:
        self.paused = True
        self.transport.pause_reading()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        self.error = err
        self.keep_alive = False
        head = self.head_waiter
        if head is not None and not head.done():
            head.set_exception(err)
        self._wake()
        self.close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, headers (lower-cased names; repeated ones joined by ", "), and whether HTTP/1.0."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise ValueError(f"status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name[-1] in " \t" or name[0] in " \t":
            raise ValueError(f"header line {line[:80]!r}")
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(parts[1]), headers, parts[0] == "HTTP/1.0"


class _Target:
    """What is computed once per base URL: address, TLS, path prefix, the fixed request headers."""

    __slots__ = ("key", "host", "port", "ssl", "server_name", "prefix", "fixed", "where")

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None, server_name: str | None = None):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.key = (self.host, self.port)
        self.ssl = ssl_context if parts.scheme == "https" else None
        self.server_name = server_name or self.host  # what its certificate must name (and SNI)
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.where = f"{host}:{self.port}"
        self.fixed = f" HTTP/1.1\r\nHost: {self.where}\r\nConnection: keep-alive\r\n"

    def encode(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        if not path.isascii() or " " in path:
            path = quote(path, safe="/?=&%:@!$'()*+,;~-._")
        extra = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if extra.count("\n") != len(headers) or extra.count("\r") != len(headers):
            raise ValueError("a header name or value contains CR or LF")
        head = f"{method} {self.prefix}{path}{self.fixed}{extra}Content-Length: {len(body)}\r\n\r\n"
        return head.encode() + body


class UpstreamPool:
    """Keep-alive connections per (host, port), shared by every request to the replicas."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float = 30.0, max_idle_per_host: int = 256,
                 ssl_context: ssl.SSLContext | None = None, server_name: str | None = None):
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl = ssl_context  # https replicas (None: the system's CAs, made when first needed)
        self._server_name = server_name  # the name https replicas' certificates hold (None: each URL's host)
        self._sweep_timer: asyncio.TimerHandle | None = None
        self.closed = False

    async def request(
        self, base_url: str, path: str, headers: Mapping[str, str], body: bytes, method: str = "POST"
    ) -> UpstreamResponse:
        """``method`` ``base_url`` + ``path`` with ``body``; the response once its headers arrived.

        ``base_url`` is a replica's URL ("http://host:port", "http://[::1]:port", maybe with a
        path prefix); ``headers`` are sent besides Host, Connection and Content-Length.
        """
        target = self._targets.get(base_url)
        if target is None:
            target = self._target(base_url)
        data = target.encode(method, path, headers, body)
        no_body = method == "HEAD"
        conn = self._acquire(target.key)
        if conn is not None:
            try:
                return await conn.send(data, no_body)
            except UpstreamDisconnected:
                if conn.got_bytes:
                    raise
                # the server closed it while idle and never read the request: once more, anew
        conn = await self._connect(target)
        return await conn.send(data, no_body)

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        self.closed = True
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        self._idle.clear()
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports finish closing

    def idle_connections(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    # -- internals ------------------------------------------------------------------------------
    def _target(self, base_url: str) -> _Target:
        if base_url.startswith("https:") and self._ssl is None:
            self._ssl = ssl.create_default_context()
        target = _Target(base_url, self._ssl, self._server_name)
        if len(self._targets) > 4096:  # replicas come and go: forget old URLs, not every request
            self._targets.clear()
        self._targets[base_url] = target
        return target

    def _acquire(self, key: tuple[str, int]) -> _Connection | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        now = None
        while stack:
            conn = stack.pop()  # the most recently used: the least likely to have been closed
            if conn.closed:
                continue
            if now is None:
                now = conn.loop.time()
            if now - conn.idle_since > self.keepalive_s:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, target: _Target) -> _Connection:
        if self.closed:
            raise UpstreamConnectError("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        conn = _Connection(self, target.key, loop)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn, target.host, target.port, ssl=target.ssl,
                    server_hostname=target.server_name if target.ssl else None,
                )  # fmt: skip
        except TimeoutError as exc:
            raise UpstreamConnectError(
                f"connecting to {target.where} timed out after {self.connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {target.where}: {exc}") from exc
        if self.closed:
            conn.close()
            raise UpstreamConnectError("the upstream pool is closed")
        self._open.add(conn)
        return conn

    def _put_idle(self, conn: _Connection) -> None:
        conn.mode = _IDLE
        conn.chunks.clear()
        conn.buffered = 0
        if conn.paused:
            conn.resume()  # an idle connection must still see the server close it
        stack = self._idle.get(conn.key)
        if stack is None:
            stack = self._idle[conn.key] = []
        if self.closed or len(stack) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        stack.append(conn)
        if self._sweep_timer is None:
            self._sweep_timer = conn.loop.call_later(self.keepalive_s, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle longer than keepalive_s (one timer for the pool, not per request)."""
        self._sweep_timer = None
        loop = None
        for key, stack in list(self._idle.items()):
            keep = []
            for conn in stack:
                loop = conn.loop
                if conn.closed:
                    continue
                if loop.time() - conn.idle_since > self.keepalive_s:
                    conn.close()
                else:
                    keep.append(conn)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle and loop is not None and not self.closed:
            self._sweep_timer = loop.call_later(self.keepalive_s / 2, self._sweep)

    def _lost(self, conn: _Connection) -> None:
        self._open.discard(conn)


__all__ = [
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
]
