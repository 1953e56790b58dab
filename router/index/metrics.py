"""Metrics of the index client: calls, their latency and failures, the write queue, rebuilds."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_INDEX_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)
# ops whose error series exist from the first scrape (dashboards and alerts sum them by op)
INDEX_OPS = ("lookup", "record_prediction", "confirm", "remove", "add_replica", "entry_count", "refresh")
# why a call failed: no answer in time, no connection, an error answer, or not even tried: the
# write queue was full, or the index was known to be down (writes and lookups skip it until the
# next refresh gets an answer)
ERROR_KINDS = ("timeout", "connection", "error", "dropped", "unavailable")


class IndexMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.errors = Counter(
            "kvroute_index_errors",
            "index calls that failed, timed out or were dropped, by op and kind (" + ", ".join(ERROR_KINDS) + ")",
            ["op", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "kvroute_index_latency_seconds",
            "shared (Redis) index call latency, answered calls only; in-process calls are not timed",
            ["op"],
            buckets=_INDEX_BUCKETS,
            registry=r,
        )
        self.rebuilds = Counter(
            "kvroute_index_rebuilds",
            "times the shared index was found emptied (Redis restarted or flushed) and this router's replicas "
            "registered again",
            registry=r,
        )
        # --workers N (router/worker_metrics.py): the workers' queues add up; the index counts as
        # available while every worker's calls reach it (dashboards: min over routers)
        self.write_queue = Gauge(
            "kvroute_index_write_queue", "index writes waiting to be sent (bounded; dropped when full)",
            multiprocess_mode="livesum", registry=r,
        )
        self._write_queue_size: Callable[[], int] | None = None
        self.available = Gauge(
            "kvroute_index_available",
            "1 while the index answers; 0 while calls skip it after failures in a row",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.available.set(1)
        for op in INDEX_OPS:
            self.errors.labels(op, "timeout")

    def watch_write_queue(self, size: Callable[[], int]) -> None:
        """``kvroute_index_write_queue`` reads ``size()`` at each scrape (or each ``publish``)."""
        self._write_queue_size = size
        self.write_queue.set_function(size)

    def publish(self) -> None:
        """Multiprocess mode: the queue's size now, written where every worker's scrape reads it."""
        if self._write_queue_size is not None:
            self.write_queue.set(self._write_queue_size())
