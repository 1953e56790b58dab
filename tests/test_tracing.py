"""W3C trace context and OpenTelemetry spans (router/tracing.py, router/otel.py; issue 21 item 6).

Real parts: a router in this process in front of plain aiohttp servers answering as OpenAI
replicas that record the headers they get, the openai client, and OpenTelemetry's SDK with its
in-memory exporter as the process's tracer provider (what ``opentelemetry-instrument`` would set).
"""

from __future__ import annotations

import sys

import openai
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvroute.router.tracing import MISSING_EXTRA, make_tracing
from tests.router_support import MODEL, ScriptedReplica, label, openai_client, running_router

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque,other=1"
CACHED = 3


class RecordingReplica(ScriptedReplica):
    """Answers chats as an OpenAI server (usage with cached tokens) and keeps each request's
    headers; while ``busy`` (shared by several replicas) counts, requests get a 503 (retried elsewhere)."""

    def __init__(self, busy: list[int] | None = None) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []
        self.busy = busy if busy is not None else [0]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        if self.busy[0]:
            self.busy[0] -= 1
            return web.json_response({"error": {"message": "busy", "type": "server_error", "code": 503}}, status=503)
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                      "prompt_tokens_details": {"cached_tokens": CACHED}},
        })  # fmt: skip


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """The process's tracer provider, exporting to memory (set once: OpenTelemetry allows one)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[attr-defined]
    return exporter


def sampled_parent(traceparent: str) -> str:
    """version-trace-parent of a traceparent whose flags say sampled (bit 0; W3C level 2 may add
    bit 1, a random trace id)."""
    head, _, flags = traceparent.rpartition("-")
    assert int(flags, 16) & 1, traceparent
    return head


async def chat(client: openai.AsyncOpenAI, headers: dict[str, str] | None = None) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=1, extra_headers=headers or {}
    )
    assert reply.choices[0].message.content == "hi"


async def test_the_clients_trace_context_reaches_the_replica_unchanged_without_tracing():
    async with RecordingReplica() as replica, running_router([replica.url]) as app:
        client = openai_client(app)
        await chat(client, {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        await chat(client)
    traced, untraced = replica.headers
    assert (traced["traceparent"], traced["tracestate"]) == (TRACEPARENT, TRACESTATE)
    assert "traceparent" not in untraced and "tracestate" not in untraced  # the router starts none


async def test_spans_continue_the_clients_trace_and_the_replica_gets_the_attempts_context(spans):
    spans.clear()
    async with RecordingReplica() as replica, running_router([replica.url], tracing=True, policy="round_robin") as app:
        await chat(openai_client(app), {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    by_name = {s.name: s for s in spans.get_finished_spans()}
    server, route, upstream = by_name["POST /v1/chat/completions"], by_name["kvroute.route"], by_name["kvroute.upstream"]
    # one trace, the client's: the request under the client's span, the route and the attempt under the request
    assert {format(s.context.trace_id, "032x") for s in (server, route, upstream)} == {CLIENT_TRACE}
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN and server.kind == SpanKind.SERVER
    assert route.parent.span_id == server.context.span_id and upstream.parent.span_id == server.context.span_id
    assert upstream.kind == SpanKind.CLIENT
    # the replica's parent is the attempt; the client's tracestate goes on
    (got,) = replica.headers
    assert sampled_parent(got["traceparent"]) == f"00-{CLIENT_TRACE}-{format(upstream.context.span_id, '016x')}"
    assert got["tracestate"] == TRACESTATE
    name = label(replica.url)
    assert route.attributes["gen_ai.request.model"] == MODEL and route.attributes["kvroute.replica"] == name
    assert route.attributes["kvroute.policy"] == "round_robin" and route.attributes["gen_ai.usage.input_tokens"] > 0
    assert upstream.attributes["kvroute.replica"] == name and upstream.attributes["url.full"] == replica.url
    assert upstream.attributes["kvroute.cached_tokens"] == CACHED and upstream.attributes["gen_ai.usage.output_tokens"] == 1
    assert upstream.attributes["http.response.status_code"] == 200
    assert server.attributes["http.response.status_code"] == 200 and server.attributes["kvroute.cached_tokens"] == CACHED
    assert server.attributes["kvroute.policy"] == "round_robin" and server.status.status_code == StatusCode.UNSET


async def test_without_a_client_trace_the_router_starts_one_and_a_retry_is_a_second_attempt(spans):
    spans.clear()
    first_fails = [1]
    async with RecordingReplica(first_fails) as busy, RecordingReplica(first_fails) as other:
        async with running_router([busy.url, other.url], tracing=True, policy="round_robin") as app:
            await chat(openai_client(app))
    finished = spans.get_finished_spans()
    (server,) = [s for s in finished if s.kind == SpanKind.SERVER]
    attempts = sorted((s for s in finished if s.name == "kvroute.upstream"), key=lambda s: s.start_time)
    assert server.parent is None  # a new trace: the router's span is its root
    assert [s.attributes["kvroute.attempt"] for s in attempts] == [1, 2]
    assert [s.attributes["http.response.status_code"] for s in attempts] == [503, 200]
    assert attempts[0].status.status_code == StatusCode.ERROR and attempts[1].status.status_code == StatusCode.UNSET
    assert server.attributes["kvroute.attempts"] == 2
    # each replica got its own attempt's context, in the router's trace
    sent = [sampled_parent(h["traceparent"]) for h in busy.headers + other.headers]
    trace_id = format(server.context.trace_id, "032x")
    assert sorted(sent) == sorted(f"00-{trace_id}-{format(s.context.span_id, '016x')}" for s in attempts)
    assert all("tracestate" not in h for h in busy.headers + other.headers)


async def test_a_refused_request_ends_its_spans_with_its_status(spans):
    spans.clear()
    async with RecordingReplica() as replica, running_router([replica.url], tracing=True) as app:
        with pytest.raises(openai.NotFoundError):
            await openai_client(app).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert by_name["kvroute.route"].attributes["http.response.status_code"] == 404
    assert by_name["POST /v1/chat/completions"].attributes["http.response.status_code"] == 404
    assert "kvroute.upstream" not in by_name and replica.headers == []


def test_tracing_without_the_extra_fails_at_start_saying_how_to_install_it(monkeypatch, capsys):
    from kvroute.router.main import main

    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "kvroute.router.otel", None)
    with pytest.raises(ValueError, match=r"pip install 'kvroute\[otel\]'"):
        make_tracing(True, "cost_model")
    make_tracing(False, "cost_model")  # off: nothing imported
    assert main(["--tracing", "--replicas", "http://127.0.0.1:9", "--port", "0", "--host", "127.0.0.1"]) == 2
    assert MISSING_EXTRA in capsys.readouterr().err


def test_the_console_exporter_is_chosen_by_the_environment(monkeypatch):
    """OTEL_TRACES_EXPORTER picks the exporter (router/otel.py); an unknown one is refused."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from kvroute.router.otel import exporter_from_env

    for env, kind in (({}, Http), ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, Grpc),
                      ({"OTEL_TRACES_EXPORTER": "console"}, ConsoleSpanExporter)):
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        exporter = exporter_from_env()
        assert isinstance(exporter, kind), (env, exporter)
        exporter.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert exporter_from_env() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="otlp, console or none"):
        exporter_from_env()




async def test_a_trace_the_client_does_not_sample_records_nothing_and_stays_unsampled(spans):
    """The SDK's default sampler follows the parent: a client's unsampled trace gets no spans,
    and the replica is told the trace is not sampled (flags 00), under the router's span."""
    spans.clear()
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    async with RecordingReplica() as replica, running_router([replica.url], tracing=True) as app:
        await chat(openai_client(app), {"traceparent": unsampled})
    assert spans.get_finished_spans() == ()
    version, trace_id, parent, flags = replica.headers[0]["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00") and parent != CLIENT_SPAN
