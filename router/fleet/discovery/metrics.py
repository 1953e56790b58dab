"""Prometheus counters of the discovery sources: the calls of those that talk to an API (the
Kubernetes watch), and the Redis registrations a router does not believe."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvroute.common.registration_auth import REJECTIONS


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
        self.rejected = Counter(
            "kvroute_discovery_rejected",
            "Redis registrations ignored for want of a valid signature (the router has a registration secret), "
            "counted at each discovery round that lists them, by reason: unsigned, bad_signature, stale",
            ["reason"],
            registry=r,
        )
        for reason in REJECTIONS:  # at zero from the start: an increase from nothing is seen
            self.rejected.labels(reason)
        self.events = Counter(
            "kvroute_discovery_watch_events", "watch events received, by source and type", ["source", "type"], registry=r
        )
