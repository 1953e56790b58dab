"""Who may come in, and how many at once: API keys (401), the admin token, and admission: a request
runs when there is room (in flight below the limit), else waits in the admission queue, in fair
order across tenants and priority classes, at most ``max_queue_wait_s`` before a 429 with
Retry-After (router/edge/overload/: the queue, the fair order, the saturation that lowers the limit;
design.md §7.6).  With ``queue_when_saturated`` off, short of CPU rather than of slots (saturation.py:
the loop lags, the tokenizer pool or the accept queue is backed up, a stale request was seen) a
request that finds no room is refused at once, and with ``stale_request_s`` one whose bytes waited
that long in the kernel always is: a wait would hold its connection and bring another, serving it
would be late.  With ``max_queue_wait_s`` 0 there is no queue: a 429 at ``max_in_flight``.  A
request's body is read before it is admitted (``body.py``): a slow body holds no slot.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping

from aiohttp import web

from kvroute.common.errors import ApiError
from kvroute.common.tokens.tokenizer import pool_backlog

from kvroute.router.edge.forwarded import ClientAddress
from kvroute.router.edge.overload.door import Door
from kvroute.router.edge.overload.queue import AdmissionQueue, overloaded
from kvroute.router.edge.overload.saturation import Saturation, accept_backlog, kernel_wait_s
from kvroute.router.edge.overload.reserve import RESERVE_FRACTION, SlotShares
from kvroute.router.edge.overload.shares import TenantShares
from kvroute.router.edge.overload.tenants import NO_FIELDS, PRIORITY_HEADER, Priority, body_fields, header_priority, priority_of, tenant_of
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
        max_queue_wait_s: float = 0.0,
        max_queue_length: int = 1024,
        saturated_loop_lag_s: float = 0.0,
        queue_when_saturated: bool = True,
        stale_request_s: float = 0.0,
        fair_share_when_short: bool = True,
        fair_slot_reserve: float = RESERVE_FRACTION,
        tenant_weights: Mapping[str, float] | None = None,
        client_address: ClientAddress | None = None,
    ):
        self.client_keys = list(client_keys)
        self.admin_token = admin_token
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.in_flight = 0
        self.draining = False  # /ready answers 503: not taking new work (``RouterApp.drain``)
        self._idle = asyncio.Event()
        self.client_address = client_address or ClientAddress()
        self.queueing = max_queue_wait_s > 0
        self.queue_when_saturated = queue_when_saturated
        self.stale_request_s = stale_request_s
        # fair shares of a router short of CPU, enforced at the door (overload/shares.py, door.py)
        self.shares = TenantShares(tenant_weights) if self.queueing and fair_share_when_short else None
        self.saturation = Saturation(
            max_in_flight=max_in_flight, max_loop_lag_s=saturated_loop_lag_s if self.queueing else 0.0,
            in_flight=lambda: self.in_flight, queued=lambda: len(self.queue), pool_backlog=pool_backlog,
            pool_threads=os.cpu_count() or 2, on_tick=self._on_tick, drain_window_s=max_queue_wait_s,
            backlog_saturates=not queue_when_saturated, shares=self.shares,
        )
        self.door = None if self.shares is None else Door(
            self.shares, self.client_address, retry_after_s, on_refused=self._refused_at_door,
            saw_wait=self.saturation.saw_wait, late_s=max_queue_wait_s,
        )
        self.queue = AdmissionQueue(
            max_wait_s=max_queue_wait_s, max_length=max_queue_length, weights=tenant_weights or {},
            retry_after_s=retry_after_s, drain_rate=lambda: self.saturation.drain_rate, take=self._take,
            give_back=self.release, metrics=metrics.overload,
        )
        self.slots = SlotShares(tenant_weights, fair_slot_reserve)  # who holds how many, for the room kept for the others
        self.queue.add_condition(self._room_for)
        metrics.overload.limit.set(max_in_flight)

    def start(self, listeners: list[socket.socket] | None = None) -> None:
        """Watch the loop's lag, the tokenizer pool and the accept queue of the ``listeners`` (with a
        queue: without one nothing waits for them)."""
        sockets = list(listeners or [])
        if self.queueing:
            self.saturation.accept_backlog = lambda: accept_backlog(sockets)
            self.saturation.start()

    def stop(self) -> None:
        self.saturation.stop()

    def limit(self) -> int:
        """Requests admitted at once: ``max_in_flight``, lowered while the router is saturated."""
        return min(self.max_in_flight, int(self.saturation.limit)) if self.queueing else self.max_in_flight

    def _room_for(self, tenant: str) -> bool:
        """Below the limit, and (reserve.py) not into the slots kept for tenants under their share."""
        return self.slots.may_take(tenant, self.in_flight, self.limit(), time.monotonic())

    def _refused_at_door(self, reason: str, priority: Priority) -> None:
        self.metrics.overload.shed(reason, priority)
        self.metrics.requests.labels("unknown", "none", "429").inc()

    def _on_tick(self) -> None:
        self.metrics.overload.limit.set(self.limit())
        self.metrics.overload.share_rate.set(self.shares.rate if self.shares is not None else 0.0)
        self.metrics.overload.loop_lag.set(self.saturation.lag_s)
        self.queue.poke()  # the limit may have gone up

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

    async def admit(self, request: web.Request | None = None, body: bytes = b"", api_key: str | None = None) -> str:
        """One more request in flight: at once when there is room and nobody waits, else after its
        turn in the queue; a 429 ``router_overloaded`` when its wait would pass the budget, when it
        is stale, or when it finds no room on a router short of CPU (the module's rule).  Returns
        its tenant, to hand back to :meth:`release`."""
        header = header_priority(request.headers.get(PRIORITY_HEADER)) if request is not None else None
        if self.queueing and request is not None and request.transport is not None:
            protocol = request.protocol  # server.py's ClientHandler: when it read, when it was ready to
            waited = kernel_wait_s(request.transport.get_extra_info("socket"), getattr(protocol, "heard_at", 0.0),
                                   getattr(protocol, "ready_at", 0.0))
            self.saturation.saw_wait(waited)  # the standing wait: short of CPU (saturation.py)
            if 0 < self.stale_request_s < waited:  # it waited in the kernel for the router to read it
                self.saturation.saw_stale()
                self.metrics.overload.shed("stale", header or Priority.NORMAL)
                raise overloaded(f"the router is saturated: this request waited {waited:.2f} s before it was read; "
                                 "retry shortly", self.retry_after_s)
        tenant, fields = "", NO_FIELDS
        if self.queueing:  # whose it is: the queue's order and the room kept for the others
            fields = body_fields(body)
            address = self.client_address.of(request) if request is not None else None
            tenant = tenant_of(api_key, fields, address)
            self.slots.saw(tenant, time.monotonic())
        if not len(self.queue) and self.queue.has_room(tenant):
            self._take(tenant)
            self.metrics.overload.queue_wait.observe(0.0)  # the histogram counts every admitted request
            return tenant
        if not self.queueing:
            self.metrics.overload.shed("no_queue", header or Priority.NORMAL)
            raise overloaded(f"the router has {self.in_flight} requests in flight, its limit; retry shortly",
                             self.retry_after_s)
        if not self.queue_when_saturated and self.saturation.saturated():
            # short of CPU, not of slots: a wait would hold this connection and bring another (the rule above)
            self.metrics.overload.shed("saturated", header or Priority.NORMAL)
            raise overloaded("the router is saturated (its CPU: the event loop lags, or the tokenizer pool is "
                             f"backed up) with {self.in_flight} requests in flight; retry shortly", self.retry_after_s)
        await self.queue.wait(tenant, priority_of(header, fields))
        return tenant

    def _take(self, tenant: str) -> None:
        self.in_flight += 1
        self.slots.took(tenant)
        self.metrics.in_flight.inc()

    def release(self, tenant: str = "") -> None:
        """A request admitted for ``tenant`` (what :meth:`admit` returned) is done."""
        self.in_flight -= 1
        self.slots.gave_back(tenant)
        self.metrics.in_flight.dec()
        self.saturation.finished += 1
        if self.in_flight == 0:
            self._idle.set()
        if len(self.queue):
            self.queue.poke()

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
