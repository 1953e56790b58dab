"""OpenAI-shaped errors, and the middleware that guarantees every non-2xx answer has that shape.

Clients (the OpenAI SDK first) parse ``{"error": {"message", "type", "param", "code"}}``; a plain
text 404 from the framework or a 500 traceback breaks them.  So every failure, including aiohttp's
own 404/405/413 raised before or inside a handler and any unexpected exception, leaves the router
as that JSON object.  Unexpected exceptions are logged and answered 500 ``internal_error``: bad
input is validated before it can raise, so a 500 always means a router bug.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

log = logging.getLogger("kvroute.router")

# status -> OpenAI error "type" (the SDK keys its exception classes on the status, the type is for humans)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}

_json = msgspec.json.Encoder()


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    message: str, status: int, *, type: str | None = None, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = _json.encode(error_body(message, status, type=type, param=param, code=code))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def sse_error_event(message: str, *, status: int = 502, code: str | None = "upstream_error") -> bytes:
    """The in-stream error vLLM itself sends, then the terminator clients wait for."""
    return b"data: " + _json.encode(error_body(message, status, code=code)) + b"\n\ndata: [DONE]\n\n"


class ApiError(Exception):
    """Raised anywhere in request handling; the middleware renders it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code, headers=self.headers
        )


# codes for the framework's own errors, so clients can tell them apart without parsing messages
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}
# headers of an aiohttp HTTPException worth keeping (405's Allow, 429's Retry-After ...)
_KEEP_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    if status == 404:
        message = f"no route for {request.method} {request.path}"
    elif status == 405:
        message = f"method {request.method} not allowed on {request.path}"
    elif status == 413:
        max_size = request.app._client_max_size  # noqa: SLF001 - the limit aiohttp enforced
        message = f"request body larger than {max_size} bytes"
    else:
        message = exc.text if exc.text and not exc.text.startswith(f"{status}:") else (exc.reason or "error")
    headers = {h: exc.headers[h] for h in _KEEP_HEADERS if h in exc.headers}
    return error_response(status, message, code=_HTTP_CODES.get(status), headers=headers)


def _is_openai_error(resp: web.StreamResponse) -> bool:
    return isinstance(resp, web.Response) and resp.content_type == "application/json"


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        resp = await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and friends are not errors
            raise
        return _from_http_exception(exc, request)
    except ConnectionResetError as exc:
        # the client went away while we wrote to it: nothing can be answered
        log.debug("client connection lost on %s: %s", request.path, exc)
        raise
    except Exception:  # noqa: BLE001 - the last line of defence: never a traceback to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal router error", code="internal_error")
    if resp.status >= 400 and not resp.prepared and not _is_openai_error(resp):
        # a non-2xx someone returned as text (a library, a pass-through): wrap it
        text = resp.text if isinstance(resp, web.Response) and resp.text else (resp.reason or "error")
        return error_response(resp.status, text)
    return resp
