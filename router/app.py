"""The router service: aiohttp on uvloop, wiring settings, fleet, index, policy, proxy and metrics.

Endpoints
    POST /v1/completions, /v1/chat/completions   routed (cache-aware), streamed or not
    POST /v1/responses                           routed as a chat (common/responses.py)
    POST /v1/embeddings, /tokenize, /detokenize  passed to a replica serving the body's model
    GET  /v1/models, /v1/models/{id}             the union of the fleet's models
    GET  /health                                 the process is alive (200; with health_requires_replica,
                                                 503 until a replica is healthy)
    GET  /ready                                  200 once a replica is healthy and not draining, else 503
    GET  /metrics                                Prometheus (kvroute_*)
    GET  /admin/replicas                         replicas and their state      (admin token)
    POST /admin/replicas/drain | /undrain        {"replica": NAME}            (admin token)

``RouterApp(settings)`` is the service: router/main.py runs it as the ``kvroute router`` process,
tests and the demo embed it (``await start()``, ``.url``, ``await stop()``).  ``drain()`` turns
/ready 503 while requests in flight finish (up to ``drain_timeout_s``).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from kvroute.common.errors import ApiError, error_middleware, error_response
from kvroute.common.requests import Kind, decode_json_object, parse_request
from kvroute.common.responses import parse_responses
from kvroute.common.tokens import ClientTemplates, TokenizerRegistry
from kvroute.common.tokens.memory import keep_large_buffers_mapped

from kvroute.router.edge.access_log import AccessLog, trail_of
from kvroute.router.edge.body import BodyReader
from kvroute.router.config import RouterSettings
from kvroute.router.edge.cutoff import RequestCutoff
from kvroute.router.fleet.membership import Fleet, Replica, ReplicaStatus
from kvroute.router.index.base import PrefixIndex
from kvroute.router.index.client import IndexClient
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.fleet.kvevents import KVEventSubscriber
from kvroute.router.fleet.kvevents.metrics import KVEventsStateCollector
from kvroute.router.placement.load import LoadTracker
from kvroute.router.metrics import CONTENT_TYPE, RouterMetrics
from kvroute.router.placement.policy import make_policy
from kvroute.router.forwarding.proxy import Outcome, Proxy, Timeouts, make_upstream_pool, make_upstream_session
from kvroute.router.request.response_memory import ResponseMemory
from kvroute.router.fleet.engine_counters import EngineCacheCounters
from kvroute.router.request.reuse import ReuseTracker
from kvroute.router.request.route import Router
from kvroute.router.edge.server import ClientAppRunner, ClientLimits, announce_close, count_timeouts
from kvroute.router.worker_metrics import WorkerMetrics
from kvroute.router.workers import WorkerRole

log = logging.getLogger("kvroute.router")

REQUEST_ID = web.RequestKey("request_id", str)
# ASCII only: \w would pass any Unicode letter, echoed back raw in a header
_REQUEST_ID_OK = re.compile(r"[\w.:@/+=-]{1,128}", re.ASCII)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A new request id is this process's random prefix and a counter: unique as a uuid4 per request
# would be, without a getrandom syscall and a UUID object on every request.
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """X-Request-Id: the client's (if sane), else a new one; passed upstream and returned."""
    rid = request.headers.get("X-Request-Id", "")
    if not _REQUEST_ID_OK.fullmatch(rid):
        rid = new_request_id()
    request[REQUEST_ID] = rid
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    return resp


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _matches_any(token: str | None, secrets: Iterable[str]) -> bool:
    if token is None:
        return False
    found = False
    for secret in secrets:  # compare with every key, in constant time each: no early exit to time
        found |= hmac.compare_digest(token.encode(), secret.encode())
    return found


class RouterApp:
    def __init__(self, settings: RouterSettings, *, index: PrefixIndex | None = None, worker: WorkerRole | None = None):
        self.settings = settings
        self._given_index = index
        self._worker = worker  # one of --workers N (router/workers.py), or None: the only process
        self.worker_metrics: WorkerMetrics | None = None
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self.cutoff = RequestCutoff()
        self.bodies = BodyReader(
            settings.max_body_bytes, settings.max_body_reads, settings.max_body_read_bytes, settings.retry_after_s
        )
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._started = False
        self._client_keys = settings.client_keys()
        self._admin_token = settings.admin_token.get_secret_value() if settings.admin_token else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        keep_large_buffers_mapped()  # a huge request's buffers go back to the OS once freed
        self.timeouts = Timeouts(s.connect_timeout_s, s.first_byte_timeout_s, s.idle_timeout_s)
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
        self.session = make_upstream_session(self.timeouts)  # the fleet's probes and scrapes
        self.upstream = make_upstream_pool(self.timeouts)  # proxied requests
        self.index = self._given_index or self._make_index()
        self.load = LoadTracker()
        self.metrics = RouterMetrics(self.policy.name, self.policy.reasons, s.max_client_labels)
        # every index call goes through it: budgets, failure counts, writes behind the answer
        self.index_client = IndexClient(self.index, metrics=self.metrics.index, timeout_s=s.index_timeout_s)
        self.fleet = Fleet(
            s.fleet, self.session, index=self.index_client, registry=self.metrics.registry, follows_events=s.kv_events
        )
        self.fleet.subscribe(self._on_fleet_event)
        self.metrics.bind_replicas(self._replica_gauges)
        self.metrics.register_live(
            KVEventsStateCollector(lambda: ((r.name, r.kv_events) for r in self.fleet.replicas()))
        )
        # the engines' own prefix-cache counters, next to the router's delivered figure (counted by
        # one worker of several: each would count the same growth, and their counters add up)
        if self._worker is None or self._worker.index == 0:
            EngineCacheCounters(self.metrics.registry).attach(self.fleet)
        if self._worker is not None:
            self.worker_metrics = WorkerMetrics(self.metrics.publish, restarted=self._worker.restarted)
        self.reuse = ReuseTracker(window_blocks=s.reuse_window_blocks)
        self.responses = ResponseMemory(int(s.responses_memory_mb * 2**20))
        self.router = Router(
            s,
            fleet=self.fleet,
            index=self.index_client,
            load=self.load,
            policy=self.policy,
            tokenizers=self.tokenizers,
            reuse=self.reuse,
            metrics=self.metrics,
        )
        self.proxy = Proxy(
            self.upstream,
            self.timeouts,
            replica_url=self._replica_url,
            upstream_headers=self.fleet.upstream_headers(),
            on_failure=self._on_upstream_failure,
            on_success=self.fleet.report_success,
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
            self.fleet.subscribe(self.kv_events.on_fleet_event)
        try:
            await self.index_client.start()
            if self.kv_events is not None:
                await self.kv_events.start()
            await self.fleet.start()
            self._refresh_series()
            middlewares = [request_id_middleware, self.cutoff.middleware, error_middleware]
            if s.access_log:  # outside the cutoff and error middlewares: it sees the status they answer
                access = AccessLog(lambda request: request[REQUEST_ID], self.router.cached_tokens)
                middlewares.insert(1, access.middleware)
            app = web.Application(middlewares=middlewares, client_max_size=s.max_body_bytes)
            self.cutoff.attach(app)
            app.on_response_prepare.append(announce_close)
            self._add_routes(app)
            # handler_cancellation: a client that disconnects cancels its handler, which closes the
            # upstream connection, so the engine stops generating for nobody
            limits = ClientLimits(
                s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s, count_timeouts(self.metrics.registry)
            )
            self._runner = ClientAppRunner(
                app, limits=limits, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
            )
            await self._runner.setup()
            # several workers listen on one port: the kernel spreads connections over them
            site = web.TCPSite(self._runner, s.host, s.port, backlog=1024, reuse_port=self._worker is not None or None)
            await site.start()
            if self.worker_metrics is not None:
                self.worker_metrics.start()
        except BaseException:
            await self.stop()  # a port in use, a fleet that cannot start: leave nothing open
            raise
        self._port = self._runner.addresses[0][1]
        log.info("router listening on %s (policy %s, index %s)", self.url, self.policy.name, type(self.index).__name__)

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
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    async def drain(self, timeout_s: float | None = None) -> bool:
        """/ready turns 503; wait for requests in flight to finish.  True if they all did."""
        self.draining = True
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        if self.in_flight == 0:
            return True
        self._idle.clear()
        try:
            async with asyncio.timeout(timeout_s):
                while self.in_flight:
                    await self._idle.wait()
                    self._idle.clear()
            return True
        except TimeoutError:
            log.warning("drain timed out with %d requests in flight", self.in_flight)
            return False

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self.worker_metrics is not None:
            await self.worker_metrics.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.fleet.stop()
        await self.index_client.stop()
        await self.session.close()
        await self.upstream.close()
        if self._given_index is None:
            await self.index.close()
        await self.tokenizers.aclose()

    async def __aenter__(self) -> RouterApp:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- wiring helpers -----------------------------------------------------------------------
    def _replica_url(self, name: str) -> str | None:
        r = self.fleet.get(name)
        return r.url if r is not None else None

    def _on_upstream_failure(self, replica: str, stage: str) -> None:
        self.metrics.upstream_failures.labels(replica, stage).inc()
        self.fleet.report_failure(replica)

    def _on_fleet_event(self, event: str, replica: Replica) -> None:
        if event in ("left", "down"):
            self.policy.forget_replica(replica.name)
        if event == "left":
            self.load.remove(replica.name)
            self.metrics.forget_replica(replica.name)
            self.router.forget_replica(replica.name)
            self.responses.forget_replica(replica.name)

    def _replica_status(self) -> list[ReplicaStatus]:
        """The fleet's view of each replica joined with this router's own load there."""
        out = []
        for st in self.fleet.status():
            load = self.load.states.get(st.name)
            if load is not None:
                st.in_flight, st.queued_prefill_tokens = load.in_flight, load.queued_prefill_tokens
            out.append(st)
        return out

    def _replica_gauges(self) -> Iterable[tuple[str, bool, str, int, int, float]]:
        for st in self._replica_status():
            load = self.load.states.get(st.name)
            rate = load.prefill_rate if load is not None else 0.0
            yield st.name, st.healthy, st.breaker_state, st.in_flight, st.queued_prefill_tokens, rate

    def _refresh_series(self) -> None:
        for model, replicas in self.fleet.models().items():
            self.metrics.know_model(model, [r.name for r in replicas])

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            app.router.add_post(path, self._passthrough)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/replicas", self._admin_replicas)
        app.router.add_post("/admin/replicas/drain", self._admin_drain)
        app.router.add_post("/admin/replicas/undrain", self._admin_undrain)

    # -- guards -------------------------------------------------------------------------------
    def _check_client(self, request: web.Request) -> str | None:
        """The client's bearer token; 401 when keys are configured and it is not one of them."""
        token = _bearer(request)
        if self._client_keys and not _matches_any(token, self._client_keys):
            raise ApiError(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return token

    def _check_admin(self, request: web.Request) -> None:
        if self._admin_token is None:
            raise ApiError(403, "the admin API is disabled: set admin_token to enable it", code="admin_disabled")
        if not _matches_any(_bearer(request), [self._admin_token]):
            raise ApiError(
                401, "missing or invalid admin token", code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}
            )

    def _admit(self) -> None:
        if self.in_flight >= self.settings.max_in_flight:
            raise ApiError(
                429,
                f"the router has {self.in_flight} requests in flight, its limit; retry shortly",
                code="too_many_requests",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0:
            self._idle.set()

    def _model_label(self, model: Any) -> str:
        """A model name fit for a metric label: only models the fleet serves (no client-made series)."""
        if isinstance(model, str) and self.fleet.serves(model):
            return model
        return "unknown"

    # -- generation ---------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """app -> routing (a decision) -> proxy (attempts until one is past its first byte) ->
        routing again (what happened): each step calls the next; none calls back."""
        started = time.perf_counter()
        try:
            api_key = self._check_client(request)
            raw = await self.bodies.read(request)  # before admission: a slow body holds no slot
            self._admit()
        except (ApiError, web.HTTPException) as exc:  # 401, 408, 413, 429: counted, nothing to undo
            self.metrics.requests.labels("unknown", "none", str(exc.status)).inc()
            raise
        model_label = "unknown"
        trail = trail_of(request)
        try:
            rid = request[REQUEST_ID]
            try:
                parsed = parse_responses(raw) if kind == "responses" else parse_request(kind, raw)
                model_label = self._model_label(parsed.request.model)
                if trail is not None:
                    trail.model = parsed.request.model[:128]  # as asked: a 404's name is worth seeing
                session, pin = request.headers.get("X-Session-ID"), None
                if kind == "responses":  # previous_response_id: its conversation, and the replica storing it
                    conversation, pin = self.responses.prepare(parsed)  # type: ignore[arg-type]
                    session = session or conversation
                decision = await self.router.route(
                    parsed, request_id=rid, session_header=session, api_key=api_key, pin=pin
                )
            except (ApiError, web.HTTPException) as exc:
                self.metrics.requests.labels(model_label, "none", str(exc.status)).inc()
                raise
            body = parsed.forward_body(decision.additions)
            outcome = Outcome()
            if trail is not None:
                trail.decision, trail.outcome = decision, outcome
            try:
                while (
                    opened := await self.proxy.open(
                        decision.replica, request.path, body, request_id=rid, stream=parsed.stream, outcome=outcome
                    )
                ) is None:
                    rerouted = self.router.reroute(decision)
                    if rerouted is None:
                        return self.proxy.unanswered(outcome, rid)
                    decision = rerouted
                    if trail is not None:
                        trail.decision = decision
                if opened.ttft_s is not None:
                    self.router.first_token(decision, opened.ttft_s)
                if kind == "responses":  # its id is remembered before the client can send the next turn
                    replica, key = opened.replica, session or parsed.request.user
                    outcome.on_answer = lambda answer: self.responses.remember(parsed, replica, answer, key)  # type: ignore[arg-type]
                return await self.proxy.respond(
                    request, opened, request_id=rid, strip_usage=not parsed.client_wants_usage, outcome=outcome
                )
            except ApiError as exc:
                outcome.status = exc.status
                raise
            except (asyncio.CancelledError, ConnectionResetError):
                # cut at the drain timeout (answered 503 by the cutoff), or the client left (nginx's 499)
                outcome.status = 503 if self.cutoff.cutting else 499
                raise
            except Exception:
                outcome.status = 500
                raise
            finally:
                if outcome.sent_at is not None:
                    self.metrics.added_latency.observe(outcome.sent_at - started)
                self.router.report(decision, outcome)
        finally:
            self._release()

    # -- pass-through -------------------------------------------------------------------------
    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        self._check_client(request)
        raw = await self.bodies.read(request)
        self._admit()
        model_label = "unknown"
        outcome = Outcome()
        trail = trail_of(request)
        if trail is not None:
            trail.outcome = outcome
        try:
            body = decode_json_object(raw)
            model, replicas = self._passthrough_replicas(body.get("model"))
            model_label = model
            if trail is not None:
                trail.model = model
            order = self.fleet.claim_in_order([r.name for r in replicas], 1 + self.settings.retry_attempts)
            return await self.proxy.forward_plain(
                request, order, request.path, raw, request_id=request[REQUEST_ID], outcome=outcome
            )
        except (ApiError, web.HTTPException) as exc:
            outcome.status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            outcome.status = 503 if self.cutoff.cutting else 499
            raise
        finally:
            self.metrics.requests.labels(model_label, outcome.replica or "none", str(outcome.status)).inc()
            self._release()

    def _passthrough_replicas(self, model: Any) -> tuple[str, list[Replica]]:
        """The model (the only one served, when the body names none) and its replicas, least loaded first."""
        if model is None:
            served = set(self.fleet.models())
            if len(served) != 1:
                raise ApiError(400, "missing required parameter: 'model'", param="model", code="missing_required_parameter")
            model = served.pop()
        if not isinstance(model, str) or not model:
            raise ApiError(400, "invalid value for 'model': expected a string", param="model", code="invalid_type")
        replicas = self.router.eligible(model)
        replicas.sort(key=lambda r: self.load.state(r.name).in_flight)
        return model, replicas

    # -- informational ------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        self._check_client(request)
        return web.json_response({"object": "list", "data": self.fleet.model_cards()})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_client(request)
        model = request.match_info["model"]
        for card in self.fleet.model_cards():
            if card.get("id") == model:
                return web.json_response(card)
        raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    async def _health(self, request: web.Request) -> web.Response:
        if self.settings.health_requires_replica and not self.fleet.ready():
            return error_response(503, "no healthy replica yet", code="no_replica_available")
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, "draining: not taking new work", code="draining")
        if not self.fleet.ready():
            return error_response(503, "no healthy replica yet", code="no_replica_available")
        return web.json_response({"status": "ready", "replicas": sum(r.healthy for r in self.fleet.replicas())})

    async def _metrics(self, request: web.Request) -> web.Response:
        self._refresh_series()
        for r in self.fleet.replicas():
            count = await self.index_client.entry_count(r.name)  # None: failed, counted
            if count is not None:
                self.metrics.index_entries.labels(r.name).set(count)
        self.metrics.publish()  # several workers: this one's live values, fresh (the others' are <= 1 s old)
        body = self.metrics.render({r.name for r in self.fleet.replicas()})
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    # -- admin --------------------------------------------------------------------------------
    async def _admin_replicas(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        return web.json_response({"replicas": [asdict(st) for st in self._replica_status()]})

    async def _admin_body_replica(self, request: web.Request) -> str:
        body = decode_json_object(await self.bodies.read(request))
        name = body.get("replica")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "missing required parameter: 'replica'", param="replica", code="missing_required_parameter")
        return name

    async def _admin_drain(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        name = await self._admin_body_replica(request)
        if not await self.fleet.drain(name):
            raise ApiError(404, f"no replica named {name!r}", param="replica", code="replica_not_found")
        if self._worker is not None:
            self._worker.tell_others("drain", name)  # one of several workers: all drain it
        log.info("admin: draining replica %s", name)
        return web.json_response({"replica": name, "draining": True})

    async def _admin_undrain(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        name = await self._admin_body_replica(request)
        if not await self.fleet.undrain(name):
            raise ApiError(404, f"no replica named {name!r}", param="replica", code="replica_not_found")
        if self._worker is not None:
            self._worker.tell_others("undrain", name)
        return web.json_response({"replica": name, "draining": False})
