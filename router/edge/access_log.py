"""The access log: one line per API request once it is answered (logger ``kvroute.access``).

A middleware times the request and reads the final status (a stream's handler returns once the
stream is relayed, so the line follows the whole answer).  What the handler learned comes back
with its answer, as a value: an :class:`Exchange` (the model, the final route after any
failover, the forwarding's outcome, the cached tokens the engine reported) held by the response
it returns, or by the exception that cut it short (the client left, the drain cut it).  The line
is built one loop turn later, after the answer's bytes are handed to the socket, and written by
the logging thread (common/logs.py).

Fields: request_id, method, path, model, replica, status, prompt_tokens (the engine's count, else
the router's), cached_tokens (``usage.prompt_tokens_details.cached_tokens``, as the hit-rate
metrics read it), completion_tokens, ttft_ms (streams), duration_ms, client (the peer's address, or
behind a trusted proxy the one its X-Forwarded-For names: forwarded.py),
reason (the policy's), attempts, and error for a stream that failed after its first byte.
Probes (/health, /ready, /metrics) are not logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvroute.router.edge.forwarded import ClientAddress
from kvroute.router.forwarding.proxy import Outcome
from kvroute.router.request.route import Route

log = logging.getLogger("kvroute.access")

_PROBES = frozenset({"/health", "/ready", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Exchange:
    """What a handler learned about its request, for the access line."""

    model: str | None = None
    route: Route | None = None
    outcome: Outcome | None = None
    cached_tokens: int | None = None  # as the engine reported them (None: it does not say)


EXCHANGE = web.ResponseKey("kvroute_exchange", Exchange)
_NOTHING = Exchange()


def answered(response: web.StreamResponse, exchange: Exchange) -> web.StreamResponse:
    """``response``, holding ``exchange`` for the access log."""
    response[EXCHANGE] = exchange
    return response


def cut_short(exc: BaseException, exchange: Exchange) -> BaseException:
    """``exc`` (a cancellation, a client's reset), holding ``exchange`` for the access log."""
    exc.kvroute_exchange = exchange  # type: ignore[attr-defined]
    return exc


def carried(exc: BaseException) -> Exchange | None:
    """The exchange ``exc`` holds (:func:`cut_short`), if any."""
    return getattr(exc, "kvroute_exchange", None)


class AccessLog:
    def __init__(self, request_id: Callable[[web.Request], str], client_address: ClientAddress | None = None):
        self._request_id = request_id
        self._client_address = client_address or ClientAddress()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _PROBES or not log.isEnabledFor(logging.INFO):  # no line to write: gather nothing
            return await handler(request)
        started = time.perf_counter()
        exchange: Exchange | None = None
        status = 500
        try:
            resp = await handler(request)
            status, exchange = resp.status, resp.get(EXCHANGE)
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            status = 499  # the client left (nginx's code); a drain cutoff is answered 503 inside
            exchange = carried(exc)
            raise
        finally:
            duration = time.perf_counter() - started
            asyncio.get_running_loop().call_soon(self._write, request, exchange or _NOTHING, status, duration)

    def _write(self, request: web.Request, exchange: Exchange, status: int, duration_s: float) -> None:
        decision, outcome = exchange.route, exchange.outcome
        fields: dict[str, Any] = {
            "request_id": self._request_id(request),
            "method": request.method,
            "path": request.path,
            "model": exchange.model,
            "replica": (outcome.replica if outcome is not None else None) or (decision.replica if decision else None),
            "status": status,
        }
        usage = outcome.usage if outcome is not None else None
        prompt = usage.prompt_tokens if usage is not None else None
        fields["prompt_tokens"] = prompt if prompt is not None else (decision.prompt.tokens if decision else None)
        fields["cached_tokens"] = exchange.cached_tokens
        fields["completion_tokens"] = usage.completion_tokens if usage is not None else None
        ttft = outcome.ttft_s if outcome is not None else None
        fields["ttft_ms"] = round(ttft * 1000, 2) if ttft is not None else None
        fields["duration_ms"] = round(duration_s * 1000, 2)
        fields["client"] = self._client_address.of(request)
        fields["reason"] = decision.reason if decision is not None else None
        if outcome is not None:
            fields["attempts"] = outcome.attempts
            if outcome.mid_stream_error is not None:
                fields["error"] = outcome.mid_stream_error
        log.info("%s %s %d", request.method, request.path, status, extra=fields)
