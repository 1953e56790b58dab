"""Prometheus metrics of the KV-event subscriber, created in the registry it is given."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.router.fleet.kvevents.translate import SKIP_REASONS

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# from a millisecond (same host) to seconds (a stalled index or a skewed clock)
KV_EVENTS_STATES = ("off", "pending", "following", "silent")  # router/fleet/replica.py's KVEventsState
LAG_BUCKETS = (5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.label_of: Callable[[str], str] = str  # a replica's name -> its label (the app binds the fleet's)
        self.applied = Counter(
            "kvroute_kv_events_applied", "KV events applied to the prefix index", ["replica", "type"], registry=r
        )
        self.gaps = Counter(
            "kvroute_kv_event_gaps", "sequence gaps (lost KV-event batches) detected", ["replica"], registry=r
        )
        self.replays = Counter(
            "kvroute_kv_event_replays", "replays asked of a replica's replay endpoint", ["replica"], registry=r
        )
        self.restarts = Counter(
            "kvroute_kv_event_restarts", "replica restarts seen in its event stream (its entries cleared)",
            ["replica"], registry=r,
        )
        self.lag = Histogram(
            "kvroute_kv_event_lag_seconds",
            "live batches: now minus the batch's engine timestamp, when its index writes are done",
            ["replica"],  # per replica: a skewed clock or a slow stream is one replica's
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.skipped = Counter(
            "kvroute_kv_events_skipped",
            "blocks not applied, by reason (undecodable: events; bad_frame, index_unavailable: batches)",
            ["reason"],
            registry=r,
        )
        for reason in (*SKIP_REASONS, "index_unavailable"):
            self.skipped.labels(reason)
        self._skip_children = {reason: self.skipped.labels(reason) for reason in (*SKIP_REASONS, "index_unavailable")}

    def skip(self, reason: str, n: int = 1) -> None:
        child = self._skip_children.get(reason)
        if child is None:
            child = self._skip_children[reason] = self.skipped.labels(reason)
        child.inc(n)

    def replica_series(self, replica: str) -> ReplicaSeries:
        return ReplicaSeries(self, self.label_of(replica))


class ReplicaSeries:
    """One replica's children, bound once (``labels()`` costs microseconds per call)."""

    def __init__(self, m: KVEventMetrics, replica: str) -> None:
        self.applied = {t: m.applied.labels(replica, t) for t in EVENT_TYPES}
        self.gaps = m.gaps.labels(replica)
        self.replays = m.replays.labels(replica)
        self.restarts = m.restarts.labels(replica)
        self.lag = m.lag.labels(replica)


class KVEventsStateCollector(Collector):
    """``kvroute_replica_kv_events_state{replica, state}``: 1 for each replica's current state, 0
    for the others, read from ``source`` (replica, state) at every scrape, so a replica that left
    leaves no series behind."""

    # --workers N (router/worker_metrics.py): each worker follows the replica itself; a state any
    # of them is in is 1 (a worker routing on predictions shows as silent)
    multiprocess_modes = {"kvroute_replica_kv_events_state": "livemax"}

    def __init__(self, source: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvroute_replica_kv_events_state",
            "whether the router follows the replica's KV events: off (none), pending (nothing heard yet), "
            "following, silent (nothing within the bound: routed on predictions)",
            labels=["replica", "state"],
        )
        for replica, current in self._source():
            for state in KV_EVENTS_STATES:
                family.add_metric([replica, state], 1.0 if state == current else 0.0)
        yield family


__all__ = ["EVENT_TYPES", "KV_EVENTS_STATES", "KVEventMetrics", "KVEventsStateCollector", "LAG_BUCKETS", "ReplicaSeries"]
