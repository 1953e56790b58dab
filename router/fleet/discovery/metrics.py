"""Prometheus counters of the discovery sources that talk to an API (the Kubernetes watch)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.errors = Counter(
            "kvroute_discovery_errors",
            "failed discovery calls (the source keeps its last listing and retries with backoff), by source and "
            "error: config, connection, api (an error status), protocol (an answer it cannot read)",
            ["source", "error"],
            registry=r,
        )
        self.relists = Counter(
            "kvroute_discovery_relists",
            "full listings by source and reason: start, expired (the watch's resourceVersion was compacted: 410 "
            "Gone), error (after a failed call)",
            ["source", "reason"],
            registry=r,
        )
        self.events = Counter(
            "kvroute_discovery_watch_events", "watch events received, by source and type", ["source", "type"], registry=r
        )
