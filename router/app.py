"""The router service: aiohttp on uvloop, wiring settings, fleet, index, policy, proxy and metrics.

Endpoints
    POST /v1/completions, /v1/chat/completions   routed (cache-aware), streamed or not
    POST /v1/responses                           routed as a chat (common/responses.py)
    GET  /v1/responses/{id}, POST .../{id}/cancel to the replica that stored the id
    POST /v1/embeddings, /tokenize, /detokenize  passed to a replica serving the body's model
    GET  /v1/models, /v1/models/{id}             the union of the fleet's models
    GET  /health                                 the process is alive (200; with health_requires_replica,
                                                 503 until a replica is healthy)
    GET  /ready                                  200 once a replica is healthy and not draining, else 503
    GET  /metrics                                Prometheus (kvroute_*)
    GET  /admin/replicas                         replicas and their state      (admin token)
    POST /admin/replicas/drain | /undrain        {"replica": NAME}            (admin token)

``RouterApp(settings)`` is the service: it builds the parts and wires them, top to bottom (the
edge's handlers over the request layer over placement, forwarding and the fleet; docs/design.md
§1), and runs them; router/main.py runs it as the ``kvroute router`` process, tests and the demo
embed it (``await start()``, ``.url``, ``await stop()``).  ``drain()`` turns /ready 503 while
requests in flight finish (up to ``drain_timeout_s``).
"""

from __future__ import annotations

import asyncio

import logging
import ssl
from collections.abc import Iterable

from aiohttp import web

from kvroute.common.errors import error_middleware
from kvroute.common.tls import client_context, server_context
from kvroute.common.tokens import ClientTemplates, TokenizerRegistry
from kvroute.common.tokens.memory import keep_large_buffers_mapped

from kvroute.router.config import RouterSettings
from kvroute.router.edge.access_log import AccessLog
from kvroute.router.edge.admission import Admission
from kvroute.router.edge.body import BodyReader
from kvroute.router.edge.cutoff import RequestCutoff
from kvroute.router.edge.forwarded import ClientAddress
from kvroute.router.edge.handlers import Handlers, know_models, replica_status
from kvroute.router.edge.request_id import request_id_middleware, request_id_of
from kvroute.router.edge.connections import ConnectionMetrics, connection_cap, open_file_limit
from kvroute.router.edge.server import ClientAppRunner, ClientLimits, ClientSite, announce_close, count_timeouts
from kvroute.router.fleet.engine_counters import EngineCacheCounters
from kvroute.router.fleet.kvevents import KVEventSubscriber
from kvroute.router.fleet.kvevents.metrics import KVEventsStateCollector
from kvroute.router.fleet.membership import Fleet
from kvroute.router.fleet.replica import Replica
from kvroute.router.forwarding.proxy import Proxy, Timeouts, make_upstream_pool, make_upstream_session
from kvroute.router.index.base import PrefixIndex
from kvroute.router.index.client import IndexClient
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.metrics import RouterMetrics
from kvroute.router.placement.hold import Holds
from kvroute.router.placement.load import LoadTracker
from kvroute.router.placement.policy import make_policy
from kvroute.router.placement.room import RoomRule
from kvroute.router.placement.sequence import Placement
from kvroute.router.request.accounting import Accounting
from kvroute.router.request.prompt import PromptBuilder
from kvroute.router.request.response_homes import ResponseHomes
from kvroute.router.request.response_memory import ResponseMemory
from kvroute.router.request.reuse import ReuseTracker
from kvroute.router.request.route import Router
from kvroute.router.tracing import make_tracing
from kvroute.router.worker_metrics import WorkerMetrics
from kvroute.router.workers import WorkerRole

log = logging.getLogger("kvroute.router")


class RouterApp:
    def __init__(self, settings: RouterSettings, *, worker: WorkerRole | None = None):
        self.settings = settings
        self._worker = worker  # one of --workers N (router/workers.py), or None: the only process
        self.worker_metrics: WorkerMetrics | None = None
        self.cutoff = RequestCutoff()
        self.client_address = ClientAddress(settings.trusted_proxies)  # the peer, or X-Forwarded-For behind a proxy
        self.bodies = BodyReader(
            settings.max_body_bytes, settings.max_body_reads, settings.max_body_read_bytes, settings.retry_after_s
        )
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._started = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.tracing = make_tracing(s.tracing, s.policy)  # first: a missing extra fails the start now
        keep_large_buffers_mapped()  # a huge request's buffers go back to the OS once freed
        self.timeouts = Timeouts(s.connect_timeout_s, s.first_byte_timeout_s, s.idle_timeout_s)
        listener_tls, upstream_tls = self._tls_contexts()  # first: a bad file stops the router before anything runs
        client_templates = None
        if s.allow_client_chat_template:
            client_templates = ClientTemplates(
                timeout_s=s.client_chat_template_timeout_s,
                max_output_chars=s.client_chat_template_max_chars,
                workers=s.client_chat_template_workers,
            )
        # bad paths fail now
        self.tokenizers = TokenizerRegistry.from_config(s.tokenizers, s.tokenizer, client_templates=client_templates)
        if client_templates is not None:
            client_templates.start()  # in the background: an interpreter per worker
        self.policy = make_policy(s.policy, **s.policy_options)
        self.session = make_upstream_session(self.timeouts, upstream_tls)  # the fleet's probes and scrapes
        self.upstream = make_upstream_pool(self.timeouts, upstream_tls, s.fleet.replica_server_name)  # proxied requests
        self.index = self._make_index()
        self.load = LoadTracker()
        self.metrics = RouterMetrics(self.policy.name, self.policy.reasons, s.max_client_labels)
        # every index call goes through it: budgets, failure counts, writes behind the answer
        self.index_client = IndexClient(self.index, metrics=self.metrics.index, timeout_s=s.index_timeout_s)
        self.fleet = Fleet(
            s.fleet, self.session, index=self.index_client, registry=self.metrics.registry, follows_events=s.kv_events,
            registration_secrets=s.registration_keys(),
        )
        self.fleet.subscribe(self._on_fleet_event)
        self.metrics.replica_label = self.fleet.label  # series name a replica as discovery does
        self.metrics.bind_replicas(self._replica_gauges)
        self.metrics.bind_replica_info(lambda: ((r.label or r.name, r.url, r.models) for r in self.fleet.replicas()))
        self.metrics.register_live(
            KVEventsStateCollector(lambda: ((r.label or r.name, r.kv_events) for r in self.fleet.replicas()))
        )
        # the engines' own prefix-cache counters, next to the router's delivered figure (counted by
        # one worker of several: each would count the same growth, and their counters add up)
        if self._worker is None or self._worker.index == 0:
            EngineCacheCounters(self.metrics.registry).attach(self.fleet)
        if self._worker is not None:
            self.worker_metrics = WorkerMetrics(self.metrics.publish, restarted=self._worker.restarted)
        self.reuse = ReuseTracker(window_blocks=s.reuse_window_blocks)
        self.responses = ResponseMemory(int(s.responses_memory_mb * 2**20))
        self.response_homes = ResponseHomes(  # shared through Redis when there is one
            self.responses, s.redis_url, key_prefix=s.redis_key_prefix, ttl_s=s.responses_ttl_s,
            timeout_s=5 * s.index_timeout_s,
        )
        # the index client bounds the lookup by index_timeout_s and writes predictions behind the answer
        self.placement = Placement(self.policy, self.index_client, self.load)
        self.holds = None  # late binding (docs/design.md §5.9), off unless --hold-max-s
        if s.hold_max_s > 0:
            self.holds = Holds(self.load, RoomRule(s.hold_queued_tokens), s.hold_max_s, on_wait=self.metrics.held)
            self.placement.on_freed = self.holds.notify
        prompts = PromptBuilder(self.tokenizers, want_text=self.policy.needs_text)
        self.router = Router(s, fleet=self.fleet, placement=self.placement, prompts=prompts, metrics=self.metrics,
                             holds=self.holds)
        self.accounting = Accounting(self.placement, self.reuse, self.metrics)
        self.proxy = Proxy(self.upstream, self.timeouts, upstream_headers=self.fleet.upstream_headers())
        self.admission = Admission(
            client_keys=s.client_keys(),
            admin_token=s.admin_token.get_secret_value() if s.admin_token else None,
            max_in_flight=s.max_in_flight,
            retry_after_s=s.retry_after_s,
            metrics=self.metrics,
            max_queue_wait_s=s.max_queue_wait_s,
            max_queue_length=s.max_queue_length,
            saturated_loop_lag_s=s.saturated_loop_lag_s,
            queue_when_saturated=s.queue_when_saturated,
            stale_request_s=s.stale_request_s,
            fair_share_when_short=s.fair_share_when_short,
            fair_slot_reserve=s.fair_slot_reserve,
            tenant_weights=s.tenant_weights,
            client_address=self.client_address,
        )
        self.handlers = Handlers(
            s,
            admission=self.admission,
            bodies=self.bodies,
            cutoff=self.cutoff,
            router=self.router,
            accounting=self.accounting,
            proxy=self.proxy,
            fleet=self.fleet,
            load=self.load,
            responses=self.responses,
            response_homes=self.response_homes,
            index=self.index_client,
            metrics=self.metrics,
            tracing=self.tracing,
            peers=self._worker,
        )
        if not (s.fleet.replicas or s.fleet.discovery_redis or s.fleet.dns_name or s.fleet.k8s_selector):
            log.warning("no replicas configured (--replicas, fleet.discovery_redis, fleet.dns_name or fleet.k8s_selector)")
        self._started = True
        self.kv_events: KVEventSubscriber | None = None
        if s.kv_events:
            # Replicas with an events endpoint (registered, configured or by convention) are followed
            # once up: their BlockStored / BlockRemoved confirm and remove index entries (started
            # first: the fleet's first round already announces replicas as up).
            self.kv_events = KVEventSubscriber(
                self.index_client, block_size_for=self.fleet.block_size, registry=self.metrics.registry,
                topic=s.fleet.events_topic, silent_after_s=s.fleet.events_silent_after_s,
                on_state=self.fleet.set_kv_events,
            )
            self.kv_events.metrics.label_of = self.fleet.label
            self.fleet.subscribe(self.kv_events.on_fleet_event)
        try:
            await self.index_client.start()
            if self.kv_events is not None:
                await self.kv_events.start()
            await self.fleet.start()
            know_models(self.metrics, self.fleet)
            middlewares = [request_id_middleware, self.cutoff.middleware, error_middleware]
            if s.access_log:  # outside the cutoff and error middlewares: it sees the status they answer
                middlewares.insert(1, AccessLog(request_id_of, self.client_address).middleware)
            app = web.Application(middlewares=middlewares, client_max_size=s.max_body_bytes)
            self.cutoff.attach(app)
            app.on_response_prepare.append(announce_close)
            self.handlers.add_routes(app)
            # handler_cancellation: a client that disconnects cancels its handler, which closes the
            # upstream connection, so the engine stops generating for nobody
            open_files = open_file_limit()
            cap = s.max_client_connections or connection_cap(open_files, s.max_in_flight)
            limits = ClientLimits(
                s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s, count_timeouts(self.metrics.registry),
                max_connections=cap, connection_metrics=ConnectionMetrics(self.metrics.registry),
                door=self.admission.door,
            )
            self._runner = ClientAppRunner(
                app, limits=limits, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
            )
            await self._runner.setup()
            # several workers listen on one port: the kernel spreads connections over them
            site = ClientSite(
                self._runner, s.host, s.port, backlog=s.listen_backlog, reuse_port=self._worker is not None or None,
                ssl_context=listener_tls, handshake_timeout_s=s.header_timeout_s or None,
            )
            await site.start()
            # the loop's lag, the tokenizer pool and the accept queue watched (with a queue)
            self.admission.start(list(site._server.sockets) if site._server is not None else [])
            if self.worker_metrics is not None:
                self.worker_metrics.start()
        except BaseException:
            await self.stop()  # a port in use, a fleet that cannot start: leave nothing open
            raise
        self._port = self._runner.addresses[0][1]
        log.info("router listening on %s (policy %s, index %s); client connections capped at %d (open-file limit %d)",
                 self.url, self.policy.name, type(self.index).__name__, cap, open_files)

    def _tls_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        """The listener's (``tls_cert_file``) and the one for https replicas (the fleet's CA bundle,
        client certificate); None: plain HTTP, and the system's CAs for https replicas."""
        s, f = self.settings, self.settings.fleet
        listener = server_context(s.tls_cert_file, s.tls_key_file) if s.tls_cert_file and s.tls_key_file else None
        upstream = None
        if f.replica_ca_file or f.replica_client_cert_file:
            upstream = client_context(f.replica_ca_file, f.replica_client_cert_file, f.replica_client_key_file)
        return listener, upstream

    def _make_index(self) -> PrefixIndex:
        s = self.settings
        if s.redis_url:
            from kvroute.router.index.redis_index import RedisIndex

            return RedisIndex(
                s.redis_url,
                key_prefix=s.redis_key_prefix,
                predicted_ttl_s=s.predicted_ttl_s,
                key_ttl_s=s.index_key_ttl_s,
                timeout_s=5 * s.index_timeout_s,  # the client's budget for writes: lookups have their own
            )
        return MemoryIndex(predicted_ttl_s=s.predicted_ttl_s)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("router not started")
        return self._port

    @property
    def url(self) -> str:
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        scheme = "https" if self.settings.tls_cert_file else "http"
        return f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"

    @property
    def in_flight(self) -> int:
        admission = getattr(self, "admission", None)  # made by start()
        return admission.in_flight if admission is not None else 0

    async def drain(self, timeout_s: float | None = None) -> bool:
        """/ready turns 503; wait for requests in flight to finish.  True if they all did."""
        self.admission.draining = True
        return await self.admission.idle(self.settings.drain_timeout_s if timeout_s is None else timeout_s)

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self.worker_metrics is not None:
            await self.worker_metrics.stop()
        self.admission.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.fleet.stop()
        await self.index_client.stop()
        await self.session.close()
        await self.upstream.close()
        await self.index.close()
        await self.response_homes.close()
        await self.tokenizers.aclose()
        await asyncio.to_thread(self.tracing.shutdown)  # the last spans exported (blocking: off the loop)

    async def __aenter__(self) -> RouterApp:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the fleet's events and gauges --------------------------------------------------------
    def _on_fleet_event(self, event: str, replica: Replica) -> None:
        if event in ("left", "down"):
            self.policy.forget_replica(replica.name)
        if event == "left":
            self.load.remove(replica.name)
            self.metrics.forget_replica(replica.name)
            self.accounting.forget_replica(replica.name)
            self.responses.forget_replica(replica.name)

    def _replica_gauges(self) -> Iterable[tuple[str, bool, str, int, int, float]]:
        for st in replica_status(self.fleet, self.load):
            load = self.load.states.get(st.name)
            rate = load.prefill_rate if load is not None else 0.0
            yield st.label or st.name, st.healthy, st.breaker_state, st.in_flight, st.queued_prefill_tokens, rate
