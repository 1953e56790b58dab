"""What router/edge/server.py takes from aiohttp's private server internals is still there.

aiohttp has no public hook for header or body timeouts, so the router's slow-client protection
(``ClientHandler``) subclasses aiohttp's per-connection protocol ``RequestHandler`` and reads and
sets its private state; ``_ClientServer`` and ``ClientAppRunner`` extend ``Server`` and
``AppRunner._make_server``.  Private names move between aiohttp releases without notice, so
pyproject.toml bounds aiohttp to the range tested (the floor by `make test-lowest`, the newest by
`make test`), and this file fails when a name the router uses is gone or changed shape:

- every private member router/edge/server.py reads from aiohttp's objects (found by parsing it, so a
  new use is checked without editing this file) exists on a real ``RequestHandler``, ``Server``
  and ``AppRunner`` built here, with the type the router expects;
- the methods ``ClientHandler`` overrides (``finish_response`` too: the connection cap marks a
  connection idle after it) and the constructors it calls keep their parameters;
- ``_ErrInfo``, what the parser queues in ``_messages`` for a malformed request, keeps its fields;
- a real connection fed a request and a malformed one queues ``(message, payload)`` pairs and
  counts them in ``_request_count``, as ``ClientHandler.data_received`` reads them.

Widening the aiohttp range: install the new release, run this file and tests/test_router_clients.py
(the behaviour: 408s, 413s, lingering close, parser errors), then move the bound.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections import deque
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_server import Server

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "router" / "edge" / "server.py"


def used_members() -> dict[str, set[str]]:
    """The members of aiohttp's objects that router/edge/server.py uses, by the object they are used on:
    ``handler`` (RequestHandler: ``self.X`` in ClientHandler, ``self._protocol.X`` in the
    lingering transport), ``server`` (Server: ``self.X`` in _ClientServer, ``server.X`` in the
    runner) and ``runner`` (``super().X`` in ClientAppRunner).  Members the router's own classes
    define are left out."""
    tree = ast.parse(SERVER.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def own(cls: ast.ClassDef) -> set[str]:
        """Its methods, its __slots__ and what its __init__ sets on self (not what other methods
        set: ClientHandler sets aiohttp's transport and _lingering_time)."""
        methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        names = {n.name for n in methods}
        for n in ast.walk(cls):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                names |= {e.value for e in n.value.elts}  # type: ignore[attr-defined]
        for init in (m for m in methods if m.name == "__init__"):
            for n in ast.walk(init):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
        return names

    def attributes(cls: ast.ClassDef, base: str) -> set[str]:
        """``base.X`` where base is ``self``, ``self._protocol``, ``server`` or ``super()``."""
        out = set()
        for n in ast.walk(cls):
            if not isinstance(n, ast.Attribute):
                continue
            if ast.unparse(n.value) == base:
                out.add(n.attr)
        return out

    handler_own = own(classes["ClientHandler"])
    handler = {a for a in attributes(classes["ClientHandler"], "self") if a not in handler_own}
    handler |= attributes(classes["_LingeringTransport"], "self._protocol")
    handler |= attributes(classes["ClientHandler"], "super()")
    server = {a for a in attributes(classes["_ClientServer"], "self") if a not in own(classes["_ClientServer"])}
    server |= attributes(classes["ClientAppRunner"], "server")
    runner = attributes(classes["ClientAppRunner"], "super()")
    site = {a for a in attributes(classes["ClientSite"], "self") if a not in own(classes["ClientSite"])}
    return {"handler": handler, "server": server, "runner": runner, "site": site}


def missing_members(obj: object, names: set[str]) -> set[str]:
    return {name for name in names if not hasattr(obj, name)}


def test_the_members_the_router_uses_are_found():
    """The parse above sees what server.py uses (or the checks below would pass on nothing)."""
    used = used_members()
    assert {"_messages", "_request_count", "_keepalive_handle", "_waiter", "_force_close", "_close",
            "_lingering_time", "_loop", "transport", "close", "force_close", "data_received",
            "connection_made", "connection_lost", "log_exception", "finish_response"} <= used["handler"]
    assert {"_limits", "_head_timer", "_body", "close_after", "linger", "_book", "evict"}.isdisjoint(used["handler"])
    assert {"_loop", "_kwargs", "request_handler", "request_factory", "handler_cancellation"} <= used["server"]
    assert used["runner"] == {"__init__", "_make_server"}
    assert {"_ssl_context", "_runner", "_host", "_port", "_backlog", "_reuse_address", "_reuse_port", "_server",
            "_bound_port"} <= used["site"]


async def test_a_real_tcp_site_has_every_member_the_router_uses():
    """``ClientSite.start`` does what ``TCPSite.start`` does, with the TLS handshake's bound: the
    members it reads, and ``loop.create_server``'s parameters it passes, are still there."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=None, backlog=16, reuse_port=None)
        assert missing_members(site, used_members()["site"]) == set(), f"aiohttp {aiohttp.__version__}: TCPSite moved"
        assert (site._host, site._port, site._backlog, site._server) == ("127.0.0.1", 0, 16, None)  # noqa: SLF001
        assert [n for n, _ in parameters(web.TCPSite.__init__)][:4] == ["self", "runner", "host", "port"]
    finally:
        await runner.cleanup()
    assert "ssl_handshake_timeout" in inspect.signature(asyncio.get_running_loop().create_server).parameters


def test_the_check_reports_a_member_that_is_gone():
    class Moved:
        __slots__ = ("_request_count",)

        def __init__(self) -> None:
            self._request_count = 0

    assert missing_members(Moved(), {"_request_count", "_messages"}) == {"_messages"}


async def _handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


async def test_a_real_request_handler_and_server_have_every_member_the_router_uses():
    loop = asyncio.get_running_loop()
    server = Server(_handler, loop=loop, keepalive_timeout=5.0)
    handler = server()
    used = used_members()
    assert isinstance(handler, RequestHandler)
    assert missing_members(handler, used["handler"]) == set(), f"aiohttp {aiohttp.__version__}: RequestHandler moved"
    assert missing_members(server, used["server"]) == set(), f"aiohttp {aiohttp.__version__}: Server moved"
    assert missing_members(web.AppRunner, used["runner"]) == set()
    # the state the router reads, with the types it expects before a connection is made
    assert isinstance(handler._messages, deque) and not handler._messages  # noqa: SLF001
    assert handler._request_count == 0 and handler._waiter is None  # noqa: SLF001
    assert handler._keepalive_handle is None and handler.transport is None  # noqa: SLF001
    assert handler._force_close is False and handler._close is False  # noqa: SLF001
    assert isinstance(handler._lingering_time, float) and handler._loop is loop  # noqa: SLF001
    assert server._loop is loop and server._kwargs == {"keepalive_timeout": 5.0}  # noqa: SLF001
    assert server.request_handler is _handler and server.handler_cancellation is False


def parameters(function) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(function).parameters.values()]


def test_the_signatures_the_router_overrides_and_calls_are_unchanged():
    assert parameters(RequestHandler.connection_made) == [("self", "POSITIONAL_OR_KEYWORD"), ("transport", "POSITIONAL_OR_KEYWORD")]
    assert parameters(RequestHandler.connection_lost) == [("self", "POSITIONAL_OR_KEYWORD"), ("exc", "POSITIONAL_OR_KEYWORD")]
    assert parameters(RequestHandler.data_received) == [("self", "POSITIONAL_OR_KEYWORD"), ("data", "POSITIONAL_OR_KEYWORD")]
    assert [n for n, _ in parameters(RequestHandler.handle_error)] == ["self", "request", "status", "exc", "message"]
    assert parameters(RequestHandler.log_exception)[1:] == [("args", "VAR_POSITIONAL"), ("kw", "VAR_KEYWORD")]
    assert parameters(RequestHandler.close) == parameters(RequestHandler.force_close) == [("self", "POSITIONAL_OR_KEYWORD")]
    # the connection cap marks a connection idle after aiohttp's finish_response (router/edge/connections.py)
    assert inspect.iscoroutinefunction(RequestHandler.finish_response)
    assert [n for n, _ in parameters(RequestHandler.finish_response)] == ["self", "request", "resp", "start_time"]
    init = dict(parameters(RequestHandler.__init__))
    assert init["manager"] == "POSITIONAL_OR_KEYWORD" and init["loop"] == init["keepalive_timeout"] == "KEYWORD_ONLY"
    server = dict(parameters(Server.__init__))
    assert server["handler"] == "POSITIONAL_OR_KEYWORD" and server["kwargs"] == "VAR_KEYWORD"
    assert {server[k] for k in ("request_factory", "handler_cancellation", "loop")} == {"KEYWORD_ONLY"}
    assert inspect.iscoroutinefunction(web.AppRunner._make_server)  # noqa: SLF001
    assert parameters(web.AppRunner._make_server) == [("self", "POSITIONAL_OR_KEYWORD")]  # noqa: SLF001
    assert list(inspect.signature(_ErrInfo).parameters) == ["status", "exc", "message"]


class _Transport(asyncio.Transport):
    """A transport that keeps what is written (the protocol's side of a socket, nothing else)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_parsed_requests_are_queued_as_the_router_reads_them():
    """data_received queues (message, payload) per request head and counts it; a malformed head
    queues an _ErrInfo with its message (ClientHandler.data_received reads exactly that)."""
    loop = asyncio.get_running_loop()
    handler = Server(_handler, loop=loop)()
    transport = _Transport()
    handler.connection_made(transport)
    try:
        handler.data_received(b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n12345")
        assert handler._request_count == 1  # noqa: SLF001
        msg, payload = handler._messages[-1]  # noqa: SLF001
        assert msg.method == "POST" and msg.path == "/v1/x" and not payload.is_eof()
        handler.data_received(b"67890")
        assert payload.is_eof() and payload.exception() is None
    finally:
        handler.connection_lost(None)

    handler = Server(_handler, loop=loop)()
    handler.connection_made(_Transport())
    try:
        handler.data_received(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert handler._request_count == 1  # noqa: SLF001
        msg, _payload = handler._messages[-1]  # noqa: SLF001
        assert isinstance(msg, _ErrInfo) and msg.status == 400 and isinstance(msg.message, str)
    finally:
        handler.connection_lost(None)


@pytest.mark.parametrize("name", ["BadHttpMessage", "LineTooLong"])
def test_the_parser_errors_the_router_maps_exist(name):
    from aiohttp import http_exceptions

    assert issubclass(getattr(http_exceptions, name), Exception)
    assert "message" in inspect.signature(http_exceptions.BadHttpMessage).parameters
