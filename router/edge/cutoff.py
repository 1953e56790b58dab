"""The end of a drain: requests still running when ``drain_timeout_s`` has passed are ended, so
the process exits on time instead of when its longest stream does.

Each request's handler task is known while it runs (``middleware``).  ``cut()`` cancels them all;
a cancelled handler closes its upstream connection as on a client disconnect (the engine aborts
the generation), and the middleware answers the client: a stream already started gets an OpenAI
error event and ``data: [DONE]`` (what vLLM sends when it fails mid-stream), a request not yet
answered a 503 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvroute.common.errors import error_response, sse_error_event

from kvroute.router.edge.access_log import answered, carried, cut_short

log = logging.getLogger("kvroute.router")

_RESPONSE = web.RequestKey("cutoff_response", web.StreamResponse)
_MESSAGE = "the router is shutting down: its drain timeout passed before this request finished"


class RequestCutoff:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[object]] = set()
        self.cutting = False

    def attach(self, app: web.Application) -> None:
        app.on_response_prepare.append(self._remember)

    async def _remember(self, request: web.Request, response: web.StreamResponse) -> None:
        request[_RESPONSE] = response  # the stream to end, if the cut finds it started

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await handler(request)
        except asyncio.CancelledError as exc:
            if not self.cutting:
                raise  # the client left
            task.uncancel()
            exchange = carried(exc)  # what the handler learned, for the access log
            try:
                resp = await self._end(request)
            except asyncio.CancelledError as cut:
                raise cut if exchange is None else cut_short(cut, exchange)
            return resp if exchange is None else answered(resp, exchange)
        finally:
            self._running.discard(task)

    async def _end(self, request: web.Request) -> web.StreamResponse:
        resp = request.get(_RESPONSE)
        if resp is None or not resp.prepared:
            return error_response(503, _MESSAGE, code="router_shutting_down")
        if resp.content_type != "text/event-stream":
            raise asyncio.CancelledError  # a whole answer half-written: nothing valid can follow it
        try:
            await resp.write(sse_error_event(_MESSAGE, status=503, code="router_shutting_down"))
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left meanwhile
        return resp

    async def cut(self, grace_s: float = 2.0) -> int:
        """End every request still running; wait up to ``grace_s`` for their last words.  The count."""
        self.cutting = True
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
            log.warning("drain timeout: ended %d requests still running", len(tasks))
        return len(tasks)
