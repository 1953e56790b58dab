"""A replica as the router knows it (``Replica``, which the fleet keeps up to date) and as it shows
it (``ReplicaStatus``: plain data for metrics and the admin API)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from kvroute.common.registration import ReplicaRecord

from kvroute.router.fleet.breaker import BreakerState, CircuitBreaker
from kvroute.router.index.base import ReplicaSpec

DEFAULT_BLOCK_SIZE = 16  # vLLM's default
FleetEvent = Literal["joined", "left", "up", "down", "restarted", "changed"]
# Whether a replica's KV events are followed: "off" (no endpoint, or not following events),
# "pending" (followed, nothing heard yet), "following" (a batch or a replay answer came), "silent"
# (nothing within events_silent_after_s: routed on predictions, as a replica without events)
KVEventsState = Literal["off", "pending", "following", "silent"]


@dataclass(eq=False)
class Replica:
    name: str  # stable id: its base URL
    url: str
    breaker: CircuitBreaker  # .available(), .claim(), .record_success(), .record_failure(), .state
    label: str = ""  # its metrics' replica label: the name discovery gives (fleet/discovery/labels.py)
    models: set[str] = field(default_factory=set)  # from its /v1/models
    model_cards: list[dict[str, Any]] = field(default_factory=list)
    block_size: int | None = None  # effective: configured, else scraped, else registered
    capacity_blocks: int | None = None
    events_endpoint: str | None = None  # router/fleet/discovery/event_endpoints.py says which
    replay_endpoint: str | None = None
    events_origin: str | None = None  # "registered", "configured", "convention"
    kv_events: KVEventsState = "off"  # the KV-event subscriber reports it (set_kv_events)
    healthy: bool = False
    draining: bool = False
    # scraped load
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    last_scrape: float | None = None  # time.monotonic() of the last successful scrape
    # bookkeeping
    sources: set[str] = field(default_factory=set)
    record: ReplicaRecord | None = None
    health_failures: int = 0  # consecutive
    auth_refused: int | None = None  # the status (401/403) of its last refusal of the router's key; None: accepted
    tls_failed: str | None = None  # why TLS with it failed at its last health check; None: it did not
    models_read_at: float | None = None
    process_start_time: float | None = None
    scraped_block_size: int | None = None
    scraped_capacity: int | None = None
    indexed_spec: ReplicaSpec | None = None  # what the index was last told; None = not in it
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)


@dataclass
class ReplicaStatus:
    """Plain data for metrics and the admin API."""

    name: str
    healthy: bool
    draining: bool
    breaker_state: BreakerState
    breaker_opened_total: int
    running: int
    waiting: int
    kv_usage: float
    models: list[str]
    block_size: int | None
    capacity_blocks: int | None
    sources: list[str]
    events_endpoint: str | None
    replay_endpoint: str | None
    events_origin: str | None
    kv_events: KVEventsState
    health_failures: int
    scrape_age_s: float | None
    # this router's own load there (kvroute.router.placement.load owns it; the app fills it in)
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    label: str = ""  # the replica label of its metrics
