"""How many client connections the router holds open, below its open-file limit (docs/design.md §7.5).

Every connection is a file descriptor.  At the process's open-file limit the kernel refuses the
next ``accept()`` (EMFILE); libuv then accepts and closes each waiting connection at once, so every
new client (a valid chat, a ``/metrics`` scrape) is dropped unanswered and nothing is logged, until
idle keep-alive connections time out.  A thousand idle connections (one ``GET /health`` each,
then silence) stopped a router with the common container limit of 1,024 for its keep-alive
timeout.  So, as nginx's ``worker_connections`` and Envoy's overload manager do:

- at start the soft open-file limit is raised to the hard one (``raise_open_file_limit``), which
  is what a process may do unprivileged; both are logged;
- client connections are capped below it (:func:`connection_cap`: the limit less what the router
  itself needs, its upstream connections included), and at the cap a new connection first evicts
  the client connection idle the longest (between two requests, or accepted and silent); only when
  none is idle is the new one answered 503 and closed.  A request in progress is never cut.
  Evictions and refusals are logged (at most once a minute) and counted.

The cap leaves room below the limit for the descriptors a request needs besides its client's:
one upstream connection per request in flight (the upstream pool keeps no more than were in use),
the fleet's probes, the KV-event sockets, Redis, logs and the tokenizer's files.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("kvroute.router")

# Descriptors the router keeps for itself besides client and upstream connections: its listening
# socket, the event loop's, the fleet's probe and scrape connections (one per replica, each kind),
# two KV-event sockets per replica and ZeroMQ's own, Redis, log files, the tokenizer's files.
RESERVED_FILES = 256
SHED_ACTIONS = ("evicted", "refused")
_LOG_EVERY_S = 60.0


def raise_open_file_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit: (soft before, soft now, hard).  A hard limit
    of "unlimited" raises the soft one to 1 Mi (what the kernel's ``nr_open`` allows by default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # nr_open below the hard limit: keep what we have
        return soft, soft, hard
    return soft, target, hard


def open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(open_files: int, max_in_flight: int) -> int:
    """Client connections the router may hold with ``open_files`` descriptors: the limit less
    :data:`RESERVED_FILES`, less one upstream connection per request that may be in flight (at
    most half of what remains: no more requests are in flight than client connections are open)."""
    room = max(open_files - RESERVED_FILES, 2)
    return max(1, room - min(max_in_flight, room // 2))


class Evictable(Protocol):
    def evict(self) -> None: ...


class ConnectionMetrics:
    """``kvroute_client_connections`` (open now), ``kvroute_client_connections_limit`` (the cap) and
    ``kvroute_client_connections_shed_total{action="evicted"|"refused"}``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.open = Gauge(
            "kvroute_client_connections", "client connections open", multiprocess_mode="livesum", registry=registry
        )
        self.limit = Gauge(
            "kvroute_client_connections_limit", "client connections the router holds at most (the open-file "
            "limit less what it needs itself)", multiprocess_mode="livesum", registry=registry,
        )
        self.shed = Counter(
            "kvroute_client_connections_shed", "client connections closed at the connection limit: the idle one "
            "evicted for a new one, or the new one refused (503) when none was idle", ["action"], registry=registry,
        )
        for action in SHED_ACTIONS:
            self.shed.labels(action)  # both series exist from the start, at 0


class ConnectionBook:
    """The open client connections, and which are idle, longest first (a dict keeps insertion
    order: a connection going idle is moved to its end).  ``limit`` 0: no cap."""

    def __init__(self, limit: int, metrics: ConnectionMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.open = 0
        self.evicted = 0
        self.refused = 0
        self._idle: dict[Any, None] = {}
        self._metrics = metrics
        self._clock = clock
        self._logged_at: float | None = None
        self._logged = (0, 0)  # evicted, refused when last logged
        if metrics is not None:
            metrics.limit.set(limit)

    def opened(self, conn: Evictable) -> bool:
        """A connection was accepted: True to serve it (idle until its first byte), False to refuse
        it (the cap is reached and no connection is idle: answer 503 and close)."""
        self.open += 1
        if self._metrics is not None:
            self._metrics.open.inc()
        if self.limit and self.open > self.limit:
            victim = next(iter(self._idle), None)
            if victim is None:
                self.refused += 1
                self._shed("refused")
                return False
            del self._idle[victim]
            self.evicted += 1
            self._shed("evicted")
            victim.evict()  # its connection_lost, later, counts it closed
        self._idle[conn] = None
        return True

    def busy(self, conn: object) -> None:
        """Bytes of a request arrived on ``conn``: it is not evicted while it is answered."""
        self._idle.pop(conn, None)

    def idle(self, conn: object) -> None:
        """``conn`` answered its request and waits for the next one."""
        self._idle.pop(conn, None)
        self._idle[conn] = None

    def closed(self, conn: object) -> None:
        self._idle.pop(conn, None)
        self.open -= 1
        if self._metrics is not None:
            self._metrics.open.dec()

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def _shed(self, action: str) -> None:
        if self._metrics is not None:
            self._metrics.shed.labels(action).inc()
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < _LOG_EVERY_S:
            return
        evicted, refused = self.evicted - self._logged[0], self.refused - self._logged[1]
        since = "" if self._logged_at is None else " since the last report"
        self._logged_at, self._logged = now, (self.evicted, self.refused)
        log.warning(
            "client connections at the limit (%d open, limit %d): %d idle connection(s) evicted and %d new "
            "one(s) refused (503)%s; raise the open-file limit or add routers", self.open, self.limit, evicted,
            refused, since,
        )
