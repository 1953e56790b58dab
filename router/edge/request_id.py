"""X-Request-Id: the client's (if sane), else a new one; passed upstream and returned."""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

REQUEST_ID = web.RequestKey("request_id", str)
# ASCII only: \w would pass any Unicode letter, echoed back raw in a header
_REQUEST_ID_OK = re.compile(r"[\w.:@/+=-]{1,128}", re.ASCII)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A new request id is this process's random prefix and a counter: unique as a uuid4 per request
# would be, without a getrandom syscall and a UUID object on every request.
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def request_id_of(request: web.Request) -> str:
    return request[REQUEST_ID]


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's id, set before any other middleware runs; returned on an unprepared answer."""
    rid = request.headers.get("X-Request-Id", "")
    if not _REQUEST_ID_OK.fullmatch(rid):
        rid = new_request_id()
    request[REQUEST_ID] = rid
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    return resp
