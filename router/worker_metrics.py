"""One /metrics for a router run as several worker processes (``--workers N``; docs/design.md §11).

prometheus-client's multiprocess mode: every value a worker writes lives in a memory-mapped file
under ``PROMETHEUS_MULTIPROC_DIR`` (set by router/workers.py), and whichever worker a scrape
reaches reads them all: counters and histograms add up, and each gauge's ``multiprocess_mode``,
chosen where it is defined, says how the workers' values make one.  What the mode cannot do is
covered here: values computed at scrape time never reach the files, so each worker writes them
every ``PUBLISH_S`` and before it answers a scrape (``RouterMetrics.publish``); a label set cannot
be removed from the files, so a departed replica's series (``REPLICA_SCOPED``) are hidden when
rendering.  Without ``PROMETHEUS_MULTIPROC_DIR`` (``--workers 1``) none of this is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvroute.router.aio import cancel_and_wait

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus-client picks where values live when it is imported: files iff the variable was set
MULTIPROCESS: bool = bool(getattr(values.ValueClass, "_multiprocess", False))
PUBLISH_S = 1.0

# Metric families holding series per replica that single-process mode drops when the replica
# leaves (RouterMetrics.forget_replica, EngineCacheCounters.forget) or reads live at each scrape.
REPLICA_SCOPED = frozenset({
    "kvroute_requests", "kvroute_upstream_failures", "kvroute_index_entries",
    "kvroute_replica_prefix_cache_queries_tokens", "kvroute_replica_prefix_cache_hits_tokens",
    "kvroute_replica_in_flight", "kvroute_replica_healthy", "kvroute_replica_breaker_state",
    "kvroute_replica_queued_prefill_tokens", "kvroute_replica_prefill_tokens_per_second", "kvroute_replica_kv_events_state",
    "kvroute_replica_info",
})  # fmt: skip
UNROUTED = "none"  # the replica label of requests answered before any replica was chosen


class PublishedCollector:
    """A collector's gauges written to the files (``publish()``): in multiprocess mode a collector
    registered anywhere reaches no scrape.  ``modes``: each family's rule across workers."""

    def __init__(self, collector: Collector, modes: Mapping[str, str]):
        self._collector = collector
        self._modes = modes
        self._gauges: dict[str, Gauge] = {}

    def publish(self) -> None:
        for family in self._collector.collect():
            gauge = self._gauges.get(family.name)
            for sample in family.samples:
                if gauge is None:
                    gauge = self._gauges[family.name] = Gauge(
                        family.name, family.documentation, list(sample.labels),
                        multiprocess_mode=self._modes[family.name], registry=None,
                    )  # fmt: skip
                gauge.labels(**sample.labels).set(sample.value)


def remove_series(metric: Any, *labels: str) -> None:
    """``metric.remove(*labels)``; in multiprocess mode nothing (the files cannot forget a label
    set; rendering hides a departed replica's series instead)."""
    if not MULTIPROCESS:
        with contextlib.suppress(KeyError):
            metric.remove(*labels)


class _WorkersCollector(Collector):
    """Every worker's values, without the replica-scoped series of replicas not in ``keep``."""

    def __init__(self, path: str, keep: Collection[str]):
        self._path = path
        self._keep = keep

    def collect(self) -> Iterable[Any]:
        keep = self._keep
        for family in MultiProcessCollector(None, self._path).collect():
            if family.name in REPLICA_SCOPED:
                family.samples = [s for s in family.samples if s.labels.get("replica") in keep]
            yield family


def render_workers(replicas: Collection[str], *also: Collector) -> bytes:
    """The exposition of all the workers' metrics and of ``also``; ``replicas``: the fleet's current ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WorkersCollector(os.environ[MULTIPROC_ENV], {*replicas, UNROUTED}))
    for collector in also:
        registry.register(collector)
    return generate_latest(registry)


class WorkerMetrics:
    """One worker's own series, and the loop that writes its scrape-time values to the files."""

    def __init__(self, publish: Callable[[], None], *, restarted: bool):
        self._publish = publish
        self._task: asyncio.Task[None] | None = None
        # livesum: every live worker adds its 1; a dead one's file is deleted by the supervisor
        Gauge(
            "kvroute_router_workers", "router worker processes running (--workers)", multiprocess_mode="livesum",
            registry=None,
        ).set(1)
        restarts = Counter(
            "kvroute_router_worker_restarts", "router worker processes started again after one died", registry=None
        )
        if restarted:
            restarts.inc()  # counted by the replacement: the dead worker's count stays in its file

    def start(self) -> None:
        self._publish()
        self._task = asyncio.create_task(self._loop(), name="worker-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_S)
            self._publish()
