"""The API's handlers: each request flows down through them and its results come back as values
(docs/design.md §1 follows one streamed chat request through every module).

A request about a stored response (``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``)
goes to the replica that stored it (router/request/response_homes.py), like a pass-through.

A routed request (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``):
admission (key, body, in-flight slot) -> the request layer's :class:`Router` (a frozen
:class:`Route`) -> the forwarding's :class:`Proxy` (``open``: :class:`Opened`, or
:class:`Unanswered` and ``Router.reroute`` for the next route) -> ``respond`` (a
:class:`Relayed`) -> ``finish`` -> the request layer's :class:`Accounting` (``first_token``,
``report``, and ``account`` once the answer is written).  The handler tells the fleet each
replica's verdict (its breaker) from those values, and returns its response holding the
:class:`Exchange` the access log writes.  Nothing it calls calls it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, Protocol

from aiohttp import web

from kvroute.common.errors import ApiError, error_response
from kvroute.common.requests import Kind, decode_json_object, parse_request
from kvroute.common.responses import parse_responses
from kvroute.common.tokens.memory import release_free_memory

from kvroute.router.config import RouterSettings
from kvroute.router.edge.access_log import Exchange, answered, cut_short
from kvroute.router.edge.admission import Admission
from kvroute.router.edge.body import BodyReader
from kvroute.router.edge.cutoff import RequestCutoff
from kvroute.router.edge.request_id import REQUEST_ID
from kvroute.router.fleet.membership import Fleet
from kvroute.router.fleet.replica import Replica, ReplicaStatus
from kvroute.router.forwarding.proxy import Opened, Outcome, Proxy, Relayed, Stage, Unanswered
from kvroute.router.index.client import IndexClient
from kvroute.router.metrics import CONTENT_TYPE, RouterMetrics
from kvroute.router.placement.load import LoadTracker
from kvroute.router.request.accounting import Accounting
from kvroute.router.request.response_homes import ResponseHomes
from kvroute.router.request.response_memory import ResponseMemory
from kvroute.router.request.route import Route, Router
from kvroute.router.tracing import NO_SPAN, Span, Tracing, client_trace_headers

log = logging.getLogger("kvroute.router")


# A request this large refused before it was routed: the heap its parse and render freed goes back
# to the OS (glibc keeps it otherwise; common/tokens/memory.py).
GIVE_BACK_AFTER_BYTES = 1 << 20


def give_back_memory() -> None:
    """``malloc_trim`` on a thread (1-20 ms), once the refused request's objects are freed: after
    this turn of the loop, when its handler has returned."""
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.run_in_executor, None, release_free_memory)


class Peers(Protocol):
    """The other workers on this port (``router/workers.py``'s ``WorkerRole``): an admin action
    taken by one is told to all."""

    def tell_others(self, op: str, name: str) -> None: ...


def replica_status(fleet: Fleet, load: LoadTracker) -> list[ReplicaStatus]:
    """The fleet's view of each replica joined with this router's own load there."""
    out = []
    for st in fleet.status():
        own = load.states.get(st.name)
        if own is not None:
            st.in_flight, st.queued_prefill_tokens = own.in_flight, own.queued_prefill_tokens
        out.append(st)
    return out


def know_models(metrics: RouterMetrics, fleet: Fleet) -> None:
    """Per-model series for every model the fleet serves (created at zero)."""
    for model, replicas in fleet.models().items():
        metrics.know_model(model, [r.name for r in replicas])


class Handlers:
    def __init__(
        self,
        settings: RouterSettings,
        *,
        admission: Admission,
        bodies: BodyReader,
        cutoff: RequestCutoff,
        router: Router,
        accounting: Accounting,
        proxy: Proxy,
        fleet: Fleet,
        load: LoadTracker,
        responses: ResponseMemory,
        response_homes: ResponseHomes,
        index: IndexClient,
        metrics: RouterMetrics,
        tracing: Tracing,
        peers: Peers | None,
    ):
        self.settings = settings
        self.admission = admission
        self.bodies = bodies
        self.cutoff = cutoff
        self.router = router
        self.accounting = accounting
        self.proxy = proxy
        self.fleet = fleet
        self.load = load
        self.responses = responses
        self.response_homes = response_homes
        self.index = index
        self.metrics = metrics
        self.tracing = tracing  # router/tracing.py: the client's trace context on, spans with --tracing
        self.peers = peers  # one of --workers N (router/workers.py), or None: the only process

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses_api)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.stored_response)
        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            app.router.add_post(path, self.passthrough)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/admin/replicas", self.admin_replicas)
        app.router.add_post("/admin/replicas/drain", self.admin_drain)
        app.router.add_post("/admin/replicas/undrain", self.admin_undrain)

    def _model_label(self, model: Any) -> str:
        """A model name fit for a metric label: only models the fleet serves (no client-made series)."""
        if isinstance(model, str) and self.fleet.serves(model):
            return model
        return "unknown"

    def _replica_failed(self, replica: str, stage: Stage | None, status: int = 0) -> None:
        """A replica failed a request (``stage``: None when it was only busy): its breaker counts it;
        one that refused the router's API key is reported as such (logged, counted)."""
        if stage is not None:
            self.metrics.upstream_failed(replica, stage)
            self.fleet.report_failure(replica)
            if stage == "auth":
                self.fleet.report_auth_refused(replica, status, "a proxied request")

    def _url(self, replica: str) -> str | None:
        r = self.fleet.get(replica)
        return r.url if r is not None else None

    # -- generation ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def responses_api(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            api_key = self.admission.check_client(request)
            raw = await self.bodies.read(request)  # before admission: a slow body holds no slot
            tenant = await self.admission.admit(request, raw, api_key)  # may queue (overload/queue.py)
        except (ApiError, web.HTTPException) as exc:  # 400, 401, 408, 413, 429: counted, nothing to undo
            self.metrics.requests.labels("unknown", "none", str(exc.status)).inc()
            raise
        try:
            return await self._routed(request, kind, raw, api_key, started)
        finally:
            self.admission.release(tenant)

    async def _routed(
        self, request: web.Request, kind: Kind, raw: bytes, api_key: str | None, started: float
    ) -> web.StreamResponse:
        """edge -> request (a route) -> forwarding (attempts until one is past its first byte) ->
        request again (what happened): each step calls the next and gets a value back."""
        rid = request[REQUEST_ID]
        model: str | None = None
        model_label = "unknown"
        trace = self.tracing.request(request.headers, f"{request.method} {request.path}")
        route_span = trace.route()
        try:
            if kind == "chat":
                self.router.refuse_oversized_chat(raw)  # before the body is parsed, rendered, tokenized
            parsed = parse_responses(raw) if kind == "responses" else parse_request(kind, raw)
            model_label = self._model_label(parsed.request.model)
            model = parsed.request.model[:128]  # as asked: a 404's name is worth seeing
            session, pin = request.headers.get("X-Session-ID"), None
            if kind == "responses":  # previous_response_id: its conversation, and the replica storing it
                conversation, pin = self.responses.prepare(parsed)  # type: ignore[arg-type]
                previous = parsed.body.get("previous_response_id")
                if pin is None and previous is not None:  # relayed by another router or worker?
                    pin = await self.response_homes.find(previous)
                session = session or conversation
            route = await self.router.route(parsed, request_id=rid, session_header=session, api_key=api_key, pin=pin)
        except (ApiError, web.HTTPException) as exc:
            self.metrics.requests.labels(model_label, "none", str(exc.status)).inc()
            route_span.end(exc.status)
            trace.end(exc.status, model=model_label)
            if len(raw) >= GIVE_BACK_AFTER_BYTES:
                give_back_memory()
            if isinstance(exc, ApiError):
                return answered(exc.response(), Exchange(model=model))
            raise

        route_span.set(model=model_label, replica=self.metrics.label(route.replica), prompt_tokens=route.prompt.tokens)
        route_span.end()
        body = parsed.forward_body(route.additions)  # type: ignore[arg-type]
        attempts, sent_at = 0, None
        replica = route.replica  # the last one tried
        opened: Opened | None = None
        relayed: Relayed | None = None
        upstream_span: Span = NO_SPAN  # the attempt in progress (tracing)

        def ended(status: int) -> Exchange:
            """The request is over: its outcome, reported; what the access log writes."""
            outcome = Outcome(
                replica=replica,
                status=status,
                usage=relayed.usage if relayed is not None else None,
                ttft_s=opened.ttft_s if opened is not None else None,
                attempts=attempts,
                mid_stream_error=relayed.failure if relayed is not None else None,
                duration_s=time.perf_counter() - started,
                events=relayed.events if relayed is not None else 0,
                decode_s=relayed.decode_s if relayed is not None else None,
            )
            if sent_at is not None:
                self.metrics.added_latency.observe(sent_at - started)
            cached = self.accounting.report(route, outcome)
            if 200 <= status < 300:  # the hit-rate breakdown, once the answer is written
                asyncio.get_running_loop().call_soon(self.accounting.account, route, cached)
            output = outcome.usage.completion_tokens if outcome.usage is not None else None
            upstream_span.set(cached_tokens=cached, output_tokens=output)
            upstream_span.end(outcome.status)
            trace.end(status, model=model_label, replica=self.metrics.label(replica), cached_tokens=cached,
                      attempts=attempts)
            return Exchange(model, route, outcome, cached)

        try:
            failure: Unanswered | None = None
            while True:
                attempts, replica = attempts + 1, route.replica  # counted while in flight, as sent
                sent_at = time.perf_counter() if sent_at is None else sent_at
                upstream_span, trace_headers = trace.upstream(
                    replica=self.metrics.label(route.replica), url=route.url, attempt=attempts
                )
                attempt = await self.proxy.open(
                    route.replica, route.url, request.path, body, request_id=rid, stream=parsed.stream,
                    trace_headers=trace_headers,
                )
                if isinstance(attempt, Opened):
                    opened = attempt
                    break
                upstream_span.end(attempt.status)
                upstream_span = NO_SPAN
                failure = attempt
                self._replica_failed(attempt.replica, attempt.stage, attempt.replica_status)
                rerouted: Route | None = self.router.reroute(route)
                if rerouted is None:
                    response: web.StreamResponse = self.proxy.unanswered(failure, rid)
                    return answered(response, ended(failure.status))
                route = rerouted
            if opened.ttft_s is not None:
                self.accounting.first_token(route, opened.ttft_s)
            relayed = await self.proxy.respond(
                request, opened, request_id=rid, strip_usage=not parsed.client_wants_usage
            )
            if relayed.failure is None:
                self.fleet.report_success(opened.replica)
            else:
                self._replica_failed(opened.replica, "mid_stream")
            if kind == "responses" and relayed.answer is not None:
                # its id is remembered before the client can send the next turn (finish sends it)
                self.responses.remember(parsed, opened.replica, relayed.answer, session or parsed.request.user)  # type: ignore[arg-type]
                if isinstance(relayed.answer.get("id"), str):
                    await self.response_homes.record(relayed.answer["id"], opened.replica)
            await self.proxy.finish(relayed)
            return answered(relayed.response, ended(relayed.status))
        except ApiError as exc:
            return answered(exc.response(), ended(exc.status))
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            # cut at the drain timeout (answered 503 by the cutoff), or the client left (nginx's 499)
            raise cut_short(exc, ended(503 if self.cutoff.cutting else 499))
        except Exception:
            ended(500)
            raise

    # -- pass-through -------------------------------------------------------------------------
    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """``/v1/embeddings``, ``/tokenize``, ``/detokenize``: a replica serving the body's model."""
        return await self._pass(request, self._passthrough_order)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` and ``POST .../cancel``: the replica that stored the id."""
        return await self._pass(request, self._response_home)

    async def _pass(
        self, request: web.Request, order_of: Callable[[web.Request, bytes], Awaitable[tuple[str | None, list[str]]]]
    ) -> web.StreamResponse:
        """Forwarded as it came (method, path and query, body) to the replicas ``order_of`` names, in turn."""
        api_key = self.admission.check_client(request)
        raw = await self.bodies.read(request)
        tenant = await self.admission.admit(request, raw, api_key)
        model: str | None = None
        replica: str | None = None
        attempts, status = 0, 0
        relayed: Relayed | None = None

        def ended(new_status: int) -> Exchange:
            nonlocal status
            status = new_status
            usage = relayed.usage if relayed is not None else None
            return Exchange(model, None, Outcome(replica=replica, status=status, usage=usage, attempts=attempts))

        try:
            model, order = await order_of(request, raw)
            failure: Unanswered | None = None
            for name in order:  # no routing: tried in order
                attempts, replica = attempts + 1, name  # counted while in flight, as sent
                attempt = await self.proxy.open(name, self._url(name), request.raw_path, raw,
                                                request_id=request[REQUEST_ID], stream=False, method=request.method,
                                                trace_headers=client_trace_headers(request.headers))
                if isinstance(attempt, Unanswered):
                    failure = attempt
                    self._replica_failed(name, attempt.stage, attempt.replica_status)
                    continue
                relayed = await self.proxy.respond(request, attempt, request_id=request[REQUEST_ID])
                self.fleet.report_success(name)
                return answered(relayed.response, ended(relayed.status))
            response = self.proxy.unanswered(failure, request[REQUEST_ID])
            return answered(response, ended(response.status))
        except ApiError as exc:
            return answered(exc.response(), ended(exc.status))
        except web.HTTPException as exc:
            ended(exc.status)
            raise
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            raise cut_short(exc, ended(503 if self.cutoff.cutting else 499))
        finally:
            self.metrics.requests.labels(model or "unknown", self.metrics.label(replica or "none"), str(status)).inc()
            self.admission.release(tenant)

    async def _passthrough_order(self, request: web.Request, raw: bytes) -> tuple[str | None, list[str]]:
        model, replicas = self._passthrough_replicas(decode_json_object(raw).get("model"))
        return model, self.fleet.claim_in_order([r.name for r in replicas], 1 + self.settings.retry_attempts)

    async def _response_home(self, request: web.Request, raw: bytes) -> tuple[str | None, list[str]]:
        """The replica that stored the id: vLLM keeps a response in that process's memory, so no
        other replica has it (404 when no router relayed it, or its replica left the fleet)."""
        response_id = request.match_info["response_id"]
        name = await self.response_homes.find(response_id)
        if name is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        if self.fleet.get(name) is None:
            raise ApiError(404, f"Response with id '{response_id}' not found: replica {name} stored it and is not in "
                           "the fleet (a replica keeps its stored responses in memory: gone with it)",
                           param="response_id", code="response_not_found")
        return None, [name]

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
    async def models(self, request: web.Request) -> web.Response:
        self.admission.check_client(request)
        return web.json_response({"object": "list", "data": self.fleet.model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        self.admission.check_client(request)
        model = request.match_info["model"]
        for card in self.fleet.model_cards():
            if card.get("id") == model:
                return web.json_response(card)
        raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    async def health(self, request: web.Request) -> web.Response:
        if self.settings.health_requires_replica and not self.fleet.ready():
            return error_response(503, "no healthy replica yet", code="no_replica_available")
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.admission.draining:
            return error_response(503, "draining: not taking new work", code="draining")
        if not self.fleet.ready():
            return error_response(503, "no healthy replica yet", code="no_replica_available")
        return web.json_response({"status": "ready", "replicas": sum(r.healthy for r in self.fleet.replicas())})

    async def metrics_page(self, request: web.Request) -> web.Response:
        know_models(self.metrics, self.fleet)
        for r in self.fleet.replicas():
            count = await self.index.entry_count(r.name)  # None: failed, counted
            if count is not None:
                self.metrics.index_entries.labels(self.metrics.label(r.name)).set(count)
        self.metrics.publish()  # several workers: this one's live values, fresh (the others' are <= 1 s old)
        body = self.metrics.render({self.metrics.label(r.name) for r in self.fleet.replicas()})
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    # -- admin --------------------------------------------------------------------------------
    async def admin_replicas(self, request: web.Request) -> web.Response:
        self.admission.check_admin(request)
        return web.json_response({"replicas": [asdict(st) for st in replica_status(self.fleet, self.load)]})

    async def _admin_body_replica(self, request: web.Request) -> str:
        """The replica the body names, by its name (URL) or its metrics label (what alerts name)."""
        body = decode_json_object(await self.bodies.read(request))
        name = body.get("replica")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "missing required parameter: 'replica'", param="replica", code="missing_required_parameter")
        replica = self.fleet.find(name)
        return replica.name if replica is not None else name

    async def admin_drain(self, request: web.Request) -> web.Response:
        self.admission.check_admin(request)
        name = await self._admin_body_replica(request)
        if not await self.fleet.drain(name):
            raise ApiError(404, f"no replica named {name!r}", param="replica", code="replica_not_found")
        if self.peers is not None:
            self.peers.tell_others("drain", name)  # one of several workers: all drain it
        log.info("admin: draining replica %s", name)
        return web.json_response({"replica": name, "draining": True})

    async def admin_undrain(self, request: web.Request) -> web.Response:
        self.admission.check_admin(request)
        name = await self._admin_body_replica(request)
        if not await self.fleet.undrain(name):
            raise ApiError(404, f"no replica named {name!r}", param="replica", code="replica_not_found")
        if self.peers is not None:
            self.peers.tell_others("undrain", name)
        return web.json_response({"replica": name, "draining": False})

