"""The access log: one line per API request once it is answered (logger ``kvroute.access``).

A middleware times the request and reads the final status (a stream's handler returns once the
stream is relayed, so the line follows the whole answer); the handler leaves what it learned on
the request's :class:`Trail` (the model, the final route decision after any failover, the
proxy's outcome with the usage it already parsed).  The line is built one loop turn later, after
the answer's bytes are handed to the socket, and written by the logging thread (common/logs.py).

Fields: request_id, method, path, model, replica, status, prompt_tokens (the engine's count, else
the router's), cached_tokens (``usage.prompt_tokens_details.cached_tokens``, as the hit-rate
metrics read it), completion_tokens, ttft_ms (streams), duration_ms, client (peer address),
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

from kvroute.router.forwarding.proxy import Outcome
from kvroute.router.request.route import RouteDecision

log = logging.getLogger("kvroute.access")

_PROBES = frozenset({"/health", "/ready", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Trail:
    """What a handler learned about its request, for the access line."""

    model: str | None = None
    decision: RouteDecision | None = None
    outcome: Outcome | None = None


TRAIL_KEY = web.RequestKey("kvroute_trail", Trail)


def trail_of(request: web.Request) -> Trail | None:
    """The request's trail, or None when the access log is off."""
    return request.get(TRAIL_KEY)


class AccessLog:
    def __init__(self, request_id: Callable[[web.Request], str], cached_tokens: Callable[[Outcome], int | None]):
        self._request_id = request_id
        self._cached_tokens = cached_tokens  # the router's reading of usage (null details = 0 once seen)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _PROBES or not log.isEnabledFor(logging.INFO):  # no line to write: gather nothing
            return await handler(request)
        started = time.perf_counter()
        trail = request[TRAIL_KEY] = Trail()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client left (nginx's code); a drain cutoff is answered 503 inside
            raise
        finally:
            duration = time.perf_counter() - started
            asyncio.get_running_loop().call_soon(self._write, request, trail, status, duration)

    def _write(self, request: web.Request, trail: Trail, status: int, duration_s: float) -> None:
        decision, outcome = trail.decision, trail.outcome
        fields: dict[str, Any] = {
            "request_id": self._request_id(request),
            "method": request.method,
            "path": request.path,
            "model": trail.model,
            "replica": (outcome.replica if outcome is not None else None) or (decision.replica if decision else None),
            "status": status,
        }
        usage = outcome.usage if outcome is not None else None
        prompt = usage.prompt_tokens if usage is not None else None
        fields["prompt_tokens"] = prompt if prompt is not None else (decision.prompt.tokens if decision else None)
        fields["cached_tokens"] = self._cached_tokens(outcome) if outcome is not None else None
        fields["completion_tokens"] = usage.completion_tokens if usage is not None else None
        ttft = outcome.ttft_s if outcome is not None else None
        fields["ttft_ms"] = round(ttft * 1000, 2) if ttft is not None else None
        fields["duration_ms"] = round(duration_s * 1000, 2)
        fields["client"] = request.remote
        fields["reason"] = decision.reason if decision is not None else None
        if outcome is not None:
            fields["attempts"] = outcome.attempts
            if "mid_stream_error" in outcome.extra:
                fields["error"] = outcome.extra["mid_stream_error"]
        log.info("%s %s %d", request.method, request.path, status, extra=fields)
