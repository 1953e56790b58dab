"""The router's view of its replicas: where they come from, whether they are up, how loaded
(docs/design.md §7.3).

Discovery merges the listings of its sources (``kvroute.router.fleet.discovery``: a static list, Redis
registrations, a DNS name, Kubernetes pods by label selector), any of which may be combined.

Every health interval each replica's ``/health`` is probed (and at once after a request to it
failed); ``unhealthy_after`` failures in a row take it out, a refused connection at once, and its
prefix-index entries are dropped (after a crash its cache state is unknown).  It comes back at
the first successful probe, once its ``/v1/models`` has been read.  Load is scraped from
``/metrics`` every metrics interval.  The HTTP calls are ``probes.py``'s; this module
keeps the state they change.  Each probe and scrape runs as its own task with its own timeout,
at most one of each kind per replica at a time, so a slow replica never delays the others.  The
edge reports each answer's verdict (``report_success``, ``report_failure``) to the replica's
circuit breaker, and routing takes a half-open replica's one trial (``claim``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from kvroute.common.registration import ReplicaRecord
from kvroute.common.scrape import ScrapeResult

from kvroute.router.aio import cancel_and_wait
from kvroute.router.fleet.breaker import CircuitBreaker
from kvroute.router.fleet.replica import DEFAULT_BLOCK_SIZE, FleetEvent, KVEventsState, Replica, ReplicaStatus
from kvroute.router.index.base import ReplicaSpec
from kvroute.router.index.client import IndexClient
from kvroute.router.fleet.discovery import (
    DiscoveryMetrics,
    DiscoverySource,
    DnsSource,
    EventEndpointResolver,
    EventEndpoints,
    K8sSource,
    RedisSource,
    ReplicaEntry,
    Source,
    StaticSource,
    replica_label,
    unique_labels,
    entry_url,
)
from kvroute.router.fleet.probes import AuthRefused, ReplicaProbes, TlsFailed
from kvroute.router.fleet.settings import FleetSettings

log = logging.getLogger("kvroute.router.fleet")


class Fleet:
    def __init__(
        self,
        settings: FleetSettings,
        session: aiohttp.ClientSession,
        *,
        index: IndexClient,
        redis: aioredis.Redis | None = None,  # else created from settings.redis_url when needed
        registry: CollectorRegistry | None = None,  # where discovery counts its errors (the router's)
        follows_events: bool = True,  # False: no KV-event subscriber, every replica is routed on predictions
        registration_secrets: tuple[bytes, ...] = (),  # Redis registrations believed only signed with one
    ):
        self.settings = settings
        self.follows_events = follows_events
        self._endpoints = EventEndpointResolver(
            settings.replicas, events_port=settings.events_port, replay_port=settings.replay_port
        )
        self.session = session
        self.index = index
        self._redis = redis  # Redis discovery's client, if the caller has one; else made from settings
        self._registration_secrets = registration_secrets
        self._sources: list[DiscoverySource] = []
        self._discovery_metrics = DiscoveryMetrics(registry)
        self._auth_refusals = Counter(
            "kvroute_replica_auth_refusals", "answers 401/403 from a replica to the router's own requests (its "
            "/v1/models, or a proxied request): the replica refuses the router's API key (fleet.replica_api_key)",
            ["replica"], registry=registry if registry is not None else CollectorRegistry(),
        )
        self._replicas: dict[str, Replica] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._listeners: list[Callable[[FleetEvent, Replica], None]] = []
        self._scrape_listeners: list[Callable[[Replica, ScrapeResult], None]] = []
        self._block_size_warned: set[str] = set()
        self._headers = {"Authorization": f"Bearer {settings.replica_api_key}"} if settings.replica_api_key else {}
        self.probes = ReplicaProbes(
            session, self._headers, health_timeout_s=settings.health_timeout_s, metrics_timeout_s=settings.metrics_timeout_s,
            has_client_cert=settings.replica_client_cert_file is not None, server_name=settings.replica_server_name,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """One full round (discovery, health, models, metrics), then the background loops."""
        self._sources = self._make_sources()
        await self._discover()
        results = await asyncio.gather(*(self._probe(r) for r in list(self._replicas.values())), return_exceptions=True)
        for exc in results:
            if isinstance(exc, Exception):
                log.error("first health round failed", exc_info=exc)
        self._loops = [
            asyncio.create_task(self._every(self.settings.health_interval_s, self._health_round)),
            asyncio.create_task(self._every(self.settings.metrics_interval_s, self._metrics_round)),
        ]

    async def stop(self) -> None:
        tasks = list(self._loops)
        for r in self._replicas.values():
            tasks.extend(r.tasks.values())
            r.tasks.clear()
        self._loops = []
        await cancel_and_wait(tasks)
        for source in self._sources:
            await source.close()
        self._sources = []

    def _make_sources(self) -> list[DiscoverySource]:
        s = self.settings
        named = {e.url: e.name for e in s.replicas if isinstance(e, ReplicaEntry) and e.name}
        sources: list[DiscoverySource] = [StaticSource((entry_url(e) for e in s.replicas), named)]
        if s.discovery_redis:
            secrets, metrics = self._registration_secrets, self._discovery_metrics
            if self._redis is not None:
                sources.append(
                    RedisSource(self._redis, s.redis_key_prefix, s.discovery_timeout_s, secrets=secrets, metrics=metrics)
                )
            elif s.redis_url:
                sources.append(RedisSource.from_url(
                    s.redis_url, s.redis_key_prefix, s.discovery_timeout_s, secrets=secrets, metrics=metrics
                ))
            else:
                raise ValueError("discovery_redis needs redis_url")
            if not self._registration_secrets:
                log.warning(
                    "Redis discovery without a registration secret: whoever can write to Redis can add a replica "
                    "or redirect one, and receive prompts and the replica API key; set --registration-secret-file "
                    "on the routers and the replica launchers (docs/deploy.md)"
                )
        if s.dns_name:
            sources.append(DnsSource(s.dns_name, scheme=s.dns_scheme, family=s.dns_family, timeout_s=s.discovery_timeout_s))
        if s.k8s_selector:
            sources.append(
                K8sSource(
                    s.k8s_selector, namespace=s.k8s_namespace, port_name=s.k8s_port_name, port=s.k8s_port,
                    scheme=s.k8s_scheme, timeout_s=s.discovery_timeout_s, metrics=self._discovery_metrics,
                )
            )
        return sources

    def subscribe(self, callback: Callable[[FleetEvent, Replica], None]) -> None:
        """Call ``callback(event, replica)`` on joined/left/up/down/restarted/changed (a KV-event
        subscriber follows up/down/changed/left; "changed" means new event endpoints)."""
        self._listeners.append(callback)

    def on_scrape(self, callback: Callable[[Replica, ScrapeResult], None]) -> None:
        """Call ``callback(replica, result)`` after each successful /metrics scrape (the engines'
        own counters, e.g. router/fleet/engine_counters.py)."""
        self._scrape_listeners.append(callback)

    # -- queries (synchronous, no I/O) --------------------------------------------------------
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def label(self, name: str) -> str:
        """The ``replica`` label of ``name``'s metrics (fleet/discovery/labels.py); its URL if unknown."""
        r = self._replicas.get(name)
        return r.label if r is not None and r.label else name

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def eligible(self, model: str) -> list[Replica]:
        """Healthy, not draining, serving ``model``, breaker not open.  A half-open replica whose
        trial is free is included without taking the trial: see :meth:`claim`."""
        return [
            r
            for r in self._replicas.values()
            if r.healthy and not r.draining and model in r.models and r.breaker.available()
        ]

    def claim(self, name: str) -> bool:
        """Routing sends a request to ``name``: True if it may (a half-open replica's one trial is
        this request), False if its circuit is open or another request holds the trial."""
        r = self._replicas.get(name)
        return r is not None and r.breaker.claim()

    def claim_in_order(self, names: list[str], limit: int) -> list[str]:
        """Up to ``limit`` of ``names`` to try in turn: the first may be a half-open replica (it
        takes the trial), later ones only closed ones, since they are tried only if earlier ones fail."""
        order: list[str] = []
        for name in names:
            r = self._replicas.get(name)
            if r is None or len(order) >= limit:
                continue
            if r.breaker.state == "closed" or (not order and r.breaker.claim()):
                order.append(name)
        return order

    def serves(self, model: str) -> bool:
        """Some known replica (healthy or not) serves ``model``."""
        return any(model in r.models for r in self._replicas.values())

    def models(self) -> dict[str, list[Replica]]:
        out: dict[str, list[Replica]] = {}
        for r in self._replicas.values():
            if r.healthy:
                for m in sorted(r.models):
                    out.setdefault(m, []).append(r)
        return out

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the healthy replicas' /v1/models entries (first card of each id wins)."""
        cards: dict[str, dict[str, Any]] = {}
        for r in self._replicas.values():
            if r.healthy:
                for card in r.model_cards:
                    cards.setdefault(card["id"], card)
        return list(cards.values())

    def block_size(self, model: str) -> int:
        if self.settings.block_size:
            return self.settings.block_size
        serving = [r for r in self._replicas.values() if model in r.models]
        sizes = [r.block_size for r in sorted(serving, key=lambda r: not r.healthy) if r.block_size]
        if not sizes:
            return DEFAULT_BLOCK_SIZE
        if len(set(sizes)) > 1 and model not in self._block_size_warned:
            # Chains hashed with one size never match blocks of another: routing for this model
            # degrades to load balancing on the replicas that differ.
            self._block_size_warned.add(model)
            log.warning("replicas of model %s disagree on block size: %s", model, sorted(set(sizes)))
        return sizes[0]

    def ready(self) -> bool:
        return any(r.healthy and not r.draining for r in self._replicas.values())

    def upstream_headers(self) -> dict[str, str]:
        return dict(self._headers)

    def status(self) -> list[ReplicaStatus]:
        now = time.monotonic()
        out = []
        for r in self._replicas.values():
            out.append(
                ReplicaStatus(
                    name=r.name,
                    healthy=r.healthy,
                    draining=r.draining,
                    breaker_state=r.breaker.state,
                    breaker_opened_total=r.breaker.opened_times,
                    running=r.running,
                    waiting=r.waiting,
                    kv_usage=r.kv_usage,
                    models=sorted(r.models),
                    block_size=r.block_size,
                    capacity_blocks=r.capacity_blocks,
                    sources=sorted(r.sources),
                    events_endpoint=r.events_endpoint,
                    replay_endpoint=r.replay_endpoint,
                    events_origin=r.events_origin,
                    kv_events=r.kv_events,
                    health_failures=r.health_failures,
                    scrape_age_s=None if r.last_scrape is None else now - r.last_scrape,
                    label=r.label,
                )
            )
        return out

    # -- reports from the proxy and the admin API ---------------------------------------------
    def report_success(self, name: str) -> None:
        r = self._replicas.get(name)
        if r is not None:
            r.breaker.record_success()

    def report_failure(self, name: str) -> None:
        """A connect error or a 5xx before the first byte: count it, and probe health right away."""
        r = self._replicas.get(name)
        if r is None:
            return
        r.breaker.record_failure()
        if self._loops:  # not after stop()
            self._spawn(r, "health", self._probe)

    def set_kv_events(self, name: str, state: KVEventsState) -> None:
        """The KV-event subscriber's verdict on ``name``'s events.  The index learns whether its
        predictions wait for events (expire) or stand on their own (a silent replica's)."""
        r = self._replicas.get(name)
        if r is None or r.kv_events == state or (state != "off" and not r.events_endpoint):
            return
        r.kv_events = state
        if self._loops and r.healthy:  # else the next sync (mark up, scrape) tells the index
            self._spawn(r, "index", self._sync_index)

    def find(self, name_or_label: str) -> Replica | None:
        """A replica by its name (URL) or by its metrics label (what an alert names; unique)."""
        r = self._replicas.get(name_or_label)
        if r is None:
            r = next((r for r in self._replicas.values() if r.label == name_or_label), None)
        return r

    async def drain(self, name: str) -> bool:
        """Stop routing new requests to it (in-flight ones finish).  False if unknown."""
        r = self._replicas.get(name)
        if r is None:
            return False
        r.draining = True
        return True

    async def undrain(self, name: str) -> bool:
        r = self._replicas.get(name)
        if r is None:
            return False
        r.draining = False
        return True

    # -- loops --------------------------------------------------------------------------------
    @staticmethod
    async def _every(interval: float, round_fn: Callable[[], Awaitable[None]]) -> None:
        next_at = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + interval, time.monotonic())
            try:
                await round_fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug in one round must not end the loop
                log.exception("fleet round failed")

    async def _health_round(self) -> None:
        await self._discover()
        for r in list(self._replicas.values()):
            self._spawn(r, "health", self._probe)

    async def _metrics_round(self) -> None:
        for r in list(self._replicas.values()):
            if r.healthy:
                self._spawn(r, "metrics", self._scrape)

    def _spawn(self, r: Replica, kind: str, fn: Callable[[Replica], Awaitable[None]]) -> None:
        """Run ``fn(r)`` as a task unless one of this kind is still running for this replica."""
        running = r.tasks.get(kind)
        if running is not None and not running.done():
            return
        task = asyncio.create_task(fn(r))
        r.tasks[kind] = task
        task.add_done_callback(_log_task_failure)

    def _current(self, r: Replica) -> bool:
        """Still the same replica object (not removed, not replaced) after an await."""
        return self._replicas.get(r.name) is r

    def _notify(self, event: FleetEvent, r: Replica) -> None:
        for cb in self._listeners:
            try:
                cb(event, r)
            except Exception:  # noqa: BLE001 - a listener's bug must not break the fleet
                log.exception("fleet listener failed on %s %s", event, r.name)

    # -- discovery ----------------------------------------------------------------------------
    async def _discover(self) -> None:
        desired: dict[str, set[Source]] = {}
        records: dict[str, ReplicaRecord] = {}
        names: dict[str, list[str | None]] = {}
        for source in self._sources:
            for url, record in (await source.list()).items():
                desired.setdefault(url, set()).add(source.name)
                names.setdefault(url, []).append(source.label(url))
                if record is not None:
                    records[url] = record
        labels = unique_labels({url: replica_label(url, names[url], records.get(url)) for url in desired})

        endpoints = self._endpoints.resolve(desired, records)
        for name, sources in desired.items():
            r = self._replicas.get(name)
            joined = r is None
            if r is None:
                r = Replica(
                    name=name,
                    url=name,
                    breaker=CircuitBreaker(self.settings.breaker_failures, self.settings.breaker_cooldown_s),
                )
                self._replicas[name] = r
                log.info("replica %s joined (%s)", name, ",".join(sorted(sources)))
            r.sources = sources
            r.label = labels[name]
            record = records.get(name)
            record_changed = record != r.record
            if record_changed:
                r.record = record
                self._resolve_geometry(r)
            endpoints_changed = self._set_endpoints(r, endpoints[name])
            if record_changed or endpoints_changed:
                await self._sync_index(r)
            if joined:
                self._notify("joined", r)
            elif endpoints_changed:
                self._notify("changed", r)  # e.g. re-registered with new KV-event endpoints
        for name in [n for n in self._replicas if n not in desired]:
            await self._remove(self._replicas[name])

    def _set_endpoints(self, r: Replica, ep: EventEndpoints) -> bool:
        """True if the endpoints moved: the KV-event state then starts over.  Only a new origin (a
        registration confirming the convention, say) keeps the stream and its state."""
        r.events_origin = ep.origin
        if (ep.events, ep.replay) == (r.events_endpoint, r.replay_endpoint):
            return False
        log.info("replica %s: KV events %s", r.name, f"at {ep.events} ({ep.origin})" if ep.events else "none")
        r.events_endpoint, r.replay_endpoint = ep.events, ep.replay
        r.kv_events = "pending" if ep.events and self.follows_events else "off"
        return True

    async def _remove(self, r: Replica) -> None:
        del self._replicas[r.name]
        tasks = list(r.tasks.values())
        r.tasks.clear()
        # Wait for them so that no index write of theirs lands after the removal below.
        await cancel_and_wait(tasks)
        r.healthy = False
        log.info("replica %s left", r.name)
        await self.index.remove_replica(r.name)  # a failure is counted; its keys then expire
        r.indexed_spec = None
        self._notify("left", r)

    def report_auth_refused(self, name: str, status: int, path: str) -> None:
        """``name`` answered 401/403 to the router (its /v1/models, or a proxied request): counted,
        and logged when it starts (the router's key, not the client's, is wrong: docs/design.md §7.5)."""
        r = self._replicas.get(name)
        if r is None:
            return
        self._auth_refusals.labels(r.label or name).inc()
        if r.auth_refused is None:
            key = "a different API key" if self._headers else "an API key"
            log.error(
                "replica %s refuses the router's API key: %s answered %d; it wants %s (set fleet.replica_api_key, "
                "KVROUTE_FLEET__REPLICA_API_KEY, to the key its server was started with)", name, path, status, key,
            )
        r.auth_refused = status

    def auth_refused(self) -> list[Replica]:
        """Replicas refusing the router's API key: the models they serve are unknown to the router."""
        return [r for r in self._replicas.values() if r.auth_refused is not None]

    def tls_failed(self) -> list[Replica]:
        """Replicas the router cannot talk TLS with: the models they serve are unknown to the router."""
        return [r for r in self._replicas.values() if r.tls_failed is not None]

    def _report_tls(self, r: Replica, failed: TlsFailed | None) -> None:
        """A probe's TLS verdict: logged when it starts and when it ends (a configuration error of the
        router's or the replica's, not a crash: it lasts until someone fixes it)."""
        if failed is not None and r.tls_failed is None:
            log.error("replica %s: %s", r.name, failed.reason)
        elif failed is None and r.tls_failed is not None:
            log.info("replica %s: TLS works again", r.name)
        r.tls_failed = failed.reason if failed is not None else None

    # -- health -------------------------------------------------------------------------------
    async def _probe(self, r: Replica) -> None:
        health = await self.probes.health(r.url)
        if not self._current(r):
            return
        if isinstance(health, TlsFailed) or r.tls_failed is not None:
            self._report_tls(r, health if isinstance(health, TlsFailed) else None)
            if isinstance(health, TlsFailed):
                health = "failed"
        if health != "ok":
            r.health_failures += 1
            # A refused connection is conclusive: nothing listens there (crashed, or restarting,
            # its cache gone either way), so it is out at once, as nginx's max_fails=1 takes a
            # server out on a connect error.  A timeout or an error status may pass: those take
            # unhealthy_after in a row.
            if r.healthy and (health == "refused" or r.health_failures >= self.settings.unhealthy_after):
                await self._mark_down(r)
            return
        r.health_failures = 0
        models_due = r.models_read_at is None or time.monotonic() - r.models_read_at >= self.settings.models_refresh_s
        if r.healthy:
            if models_due:
                await self._read_models(r)
            return
        # (Re)appearing: learn what it serves and its cache geometry before routing to it.
        if not await self._read_models(r):
            return
        await self._scrape(r)
        if self._current(r) and not r.healthy:
            await self._mark_up(r)

    async def _mark_up(self, r: Replica) -> None:
        r.healthy = True
        # Its failures were the outage the health checks saw end: back in rotation at once,
        # rather than after a breaker cooldown and a trial the policy might never send.
        r.breaker.reset()
        log.info("replica %s is up (models %s)", r.name, sorted(r.models))
        await self._sync_index(r)
        self._notify("up", r)

    async def _mark_down(self, r: Replica) -> None:
        r.healthy = False
        r.running = r.waiting = 0
        log.warning("replica %s is down after %d failed health checks", r.name, r.health_failures)
        # Whatever it cached is gone or unknown once it crashed: drop its index entries.
        await self.index.remove_replica(r.name)  # a failure is counted; its keys then expire
        r.indexed_spec = None
        r.process_start_time = None
        r.models_read_at = None  # read again when it comes back: it may serve something else
        self._notify("down", r)

    async def _read_models(self, r: Replica) -> bool:
        cards = await self.probes.model_cards(r.url)
        if isinstance(cards, AuthRefused):
            if self._current(r):
                self.report_auth_refused(r.name, cards.status, cards.path)
            return False
        if cards is None or not self._current(r):
            return False
        if r.auth_refused is not None:
            log.info("replica %s accepts the router's API key again", r.name)
            r.auth_refused = None
        r.model_cards = cards
        r.models = {c["id"] for c in cards}
        r.models_read_at = time.monotonic()
        return True

    # -- load ---------------------------------------------------------------------------------
    async def _scrape(self, r: Replica) -> None:
        scraped = await self.probes.metrics(r.url)
        if scraped is None or not self._current(r):
            return
        for cb in self._scrape_listeners:
            try:
                cb(r, scraped)
            except Exception:  # noqa: BLE001 - a listener's bug must not break the scrape
                log.exception("scrape listener failed on %s", r.name)
        r.running, r.waiting, r.kv_usage = scraped.running, scraped.waiting, scraped.kv_usage
        r.last_scrape = time.monotonic()
        r.scraped_block_size, r.scraped_capacity = scraped.block_size, scraped.capacity_blocks
        restarted = (
            r.process_start_time is not None
            and scraped.process_start_time is not None
            and scraped.process_start_time != r.process_start_time
        )
        r.process_start_time = scraped.process_start_time
        self._resolve_geometry(r)
        if restarted:
            r.breaker.reset()  # a new process answers: the failures of the one that crashed are moot
        if restarted and r.indexed_spec is not None:
            # Restarted between two health checks: its cache is empty, whatever the index says.
            log.warning("replica %s restarted: dropping its index entries", r.name)
            await self.index.clear_replica(r.name)
            self._notify("restarted", r)
        await self._sync_index(r)

    def _resolve_geometry(self, r: Replica) -> None:
        rec = r.record
        r.block_size = self.settings.block_size or r.scraped_block_size or (rec.block_size if rec else None)
        r.capacity_blocks = self.settings.capacity_blocks or r.scraped_capacity or (
            rec.capacity_blocks if rec else None
        )

    async def _sync_index(self, r: Replica) -> None:
        """Tell the index about a healthy replica whose spec is new or changed."""
        if not r.healthy:
            return
        spec = ReplicaSpec(
            name=r.name,
            capacity_blocks=r.capacity_blocks or self.settings.fallback_capacity_blocks,
            # until found silent, predictions on a replica with events expire: its events confirm them
            publishes_events=r.kv_events in ("pending", "following"),
        )
        # a failure (counted by the client) leaves indexed_spec behind: the next scrape retries
        if spec != r.indexed_spec and await self.index.add_replica(spec):
            r.indexed_spec = spec


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fleet task failed", exc_info=task.exception())


__all__ = ["Fleet"]
