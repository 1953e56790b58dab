"""Who may come in, and how many at once: API keys (401), the admin token, and the in-flight limit
(429 + Retry-After).  A request's body is read before it is admitted (``body.py``): a slow body
holds no slot.  A request queue or per-tenant fairness would live here, in front of ``admit``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Iterable

from aiohttp import web

from kvroute.common.errors import ApiError

from kvroute.router.metrics import RouterMetrics

log = logging.getLogger("kvroute.router")


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def matches_any(token: str | None, secrets: Iterable[str]) -> bool:
    if token is None:
        return False
    found = False
    for secret in secrets:  # compare with every key, in constant time each: no early exit to time
        found |= hmac.compare_digest(token.encode(), secret.encode())
    return found


class Admission:
    """The guards every API request passes, and the count of those admitted and not finished."""

    def __init__(
        self,
        *,
        client_keys: Iterable[str],
        admin_token: str | None,
        max_in_flight: int,
        retry_after_s: int,
        metrics: RouterMetrics,
    ):
        self.client_keys = list(client_keys)
        self.admin_token = admin_token
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.in_flight = 0
        self.draining = False  # /ready answers 503: not taking new work (``RouterApp.drain``)
        self._idle = asyncio.Event()

    def check_client(self, request: web.Request) -> str | None:
        """The client's bearer token; 401 when keys are configured and it is not one of them."""
        token = bearer(request)
        if self.client_keys and not matches_any(token, self.client_keys):
            raise ApiError(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return token

    def check_admin(self, request: web.Request) -> None:
        if self.admin_token is None:
            raise ApiError(403, "the admin API is disabled: set admin_token to enable it", code="admin_disabled")
        if not matches_any(bearer(request), [self.admin_token]):
            raise ApiError(
                401, "missing or invalid admin token", code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}
            )

    def admit(self) -> None:
        """One more request in flight, or a 429 at the limit."""
        if self.in_flight >= self.max_in_flight:
            raise ApiError(
                429,
                f"the router has {self.in_flight} requests in flight, its limit; retry shortly",
                code="too_many_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0:
            self._idle.set()

    async def idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for no request in flight.  True if none is left."""
        if self.in_flight == 0:
            return True
        self._idle.clear()
        try:
            async with asyncio.timeout(timeout_s):
                while self.in_flight:
                    await self._idle.wait()
                    self._idle.clear()
            return True
        except TimeoutError:
            log.warning("drain timed out with %d requests in flight", self.in_flight)
            return False
