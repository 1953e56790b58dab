"""The delivered side of the hit-rate breakdown, as the engines themselves count it (docs/design.md §6).

The router counts what each answer's ``usage.prompt_tokens_details.cached_tokens`` says
(``kvroute_reuse_delivered_tokens_total``).  Every vLLM replica also counts, on its own
``/metrics``, the prompt tokens it looked up in its prefix cache (``vllm:prefix_cache_queries``)
and those it found there (``vllm:prefix_cache_hits``).  This module re-exports how much those two
counters grew while the router watched each replica::

    kvroute_replica_prefix_cache_queries_tokens_total{replica}
    kvroute_replica_prefix_cache_hits_tokens_total{replica}

so that one dashboard sets the router's three figures (available, predicted, delivered) against the
engines' own account: ``sum(rate(kvroute_replica_prefix_cache_hits_tokens_total[5m]))`` next to
``sum(rate(kvroute_reuse_delivered_tokens_total[5m]))``.  They differ when something else sends
the replicas traffic, when a replica does not report ``cached_tokens``, or when preempted requests
are re-admitted (vLLM counts those apart, ``cached_tokens`` keeps the first admission's hit).

Deltas rather than copies of the engines' counters: the first scrape of a replica is only a
baseline (what it counted before is not part of this router's window), and a counter that goes
down, or a new ``process_start_time_seconds``, means the replica restarted, so the new process's
whole count is the growth.  The figures are as fresh as the fleet's last scrape
(``fleet.metrics_interval_s``).  Every router sharing a fleet exports the same engine figures:
aggregate them across routers with ``max``, not ``sum``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvroute.common.scrape import ScrapeResult

from kvroute.router.fleet.membership import Fleet
from kvroute.router.fleet.replica import FleetEvent, Replica
from kvroute.router.worker_metrics import remove_series

QUERIES = "vllm:prefix_cache_queries"  # as ScrapeResult.counters names them (no _total)
HITS = "vllm:prefix_cache_hits"


@dataclass
class _Seen:
    process_start_time: float | None
    queries: float
    hits: float


class EngineCacheCounters:
    """Per replica, the growth of the engine's prefix-cache counters, fed by the fleet's scrapes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(
            "kvroute_replica_prefix_cache_queries_tokens",
            "prompt tokens the replica looked up in its prefix cache (vllm:prefix_cache_queries), "
            "counted while this router watched it",
            ["replica"],
            registry=registry,
        )
        self.hits = Counter(
            "kvroute_replica_prefix_cache_hits_tokens",
            "prompt tokens the replica found in its prefix cache (vllm:prefix_cache_hits), "
            "counted while this router watched it",
            ["replica"],
            registry=registry,
        )
        self._seen: dict[str, _Seen] = {}

    def attach(self, fleet: Fleet) -> None:
        fleet.on_scrape(self.observe)
        fleet.subscribe(self.on_fleet_event)

    def observe(self, replica: Replica, scraped: ScrapeResult) -> None:
        """One successful scrape of ``replica``'s /metrics."""
        counters = scraped.counters
        if QUERIES not in counters or HITS not in counters:
            return  # not a vLLM replica, or one too old to count its prefix cache
        now = _Seen(scraped.process_start_time, counters[QUERIES], counters[HITS])
        before = self._seen.get(replica.name)
        self._seen[replica.name] = now
        if before is None:
            # The baseline; the series exist from now on, at zero.
            self.queries.labels(replica.label or replica.name)
            self.hits.labels(replica.label or replica.name)
            return
        restarted = (
            now.queries < before.queries
            or now.hits < before.hits
            or (
                before.process_start_time is not None
                and now.process_start_time is not None
                and now.process_start_time != before.process_start_time
            )
        )
        base_queries, base_hits = (0.0, 0.0) if restarted else (before.queries, before.hits)
        if now.queries > base_queries:
            self.queries.labels(replica.label or replica.name).inc(now.queries - base_queries)
        if now.hits > base_hits:
            self.hits.labels(replica.label or replica.name).inc(now.hits - base_hits)

    def on_fleet_event(self, event: FleetEvent, replica: Replica) -> None:
        if event == "left":
            self.forget(replica.name, replica.label or replica.name)

    def forget(self, name: str, label: str) -> None:
        """A replica left: drop its series and its baseline (it may come back as another process)."""
        self._seen.pop(name, None)
        for counter in (self.queries, self.hits):
            remove_series(counter, label)


__all__ = ["EngineCacheCounters"]
