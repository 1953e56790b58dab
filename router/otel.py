"""OpenTelemetry's side of ``--tracing`` (router/tracing.py says what is traced and how it is
configured); imported only when tracing is on, so the extra stays optional.  Its classes have the
methods of tracing.py's ``Span``, ``RequestTrace`` and ``Tracing`` (which import this module)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvroute.router.spans import NO_SPAN, Span

log = logging.getLogger("kvroute.router")
_W3C = TraceContextTextMapPropagator()  # traceparent/tracestate, whatever OTEL_PROPAGATORS says elsewhere


def exporter_from_env() -> SpanExporter | None:
    """``OTEL_TRACES_EXPORTER`` (otlp, console, none) and, for OTLP, ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
    (http/protobuf, the specification's default, or grpc); the exporters read the rest themselves."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: kvroute exports to otlp, console or none")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTLP protocol {protocol!r}: kvroute exports over http/protobuf or grpc")


class _OtelSpan:
    __slots__ = ("_span", "_error_from")

    def __init__(self, span: Any, error_from: int):
        self._span = span
        self._error_from = error_from  # a SERVER span's error is a 5xx, a CLIENT span's any 4xx too

    def set(self, **attributes: Any) -> None:
        for key, value in attributes.items():
            if value is not None:
                self._span.set_attribute(_ATTRIBUTES.get(key, f"kvroute.{key}"), value)

    def end(self, status: int | None = None) -> None:
        if status is not None:
            self._span.set_attribute("http.response.status_code", status)
            if status >= self._error_from:
                self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()


# keyword -> attribute: OpenTelemetry's semantic conventions where there is one, kvroute.* otherwise
_ATTRIBUTES = {
    "model": "gen_ai.request.model",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "url": "url.full",
}


class _OtelRequestTrace:
    __slots__ = ("_tracer", "_span", "_context", "_policy", "_recording")

    def __init__(self, tracer: Any, headers: Mapping[str, str], name: str, policy: str):
        self._tracer = tracer
        self._policy = policy
        parent = _W3C.extract(headers)  # the client's trace, or none: this span starts one
        self._span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        self._context = trace.set_span_in_context(self._span)
        # not sampled: its children would not be either, so none are made (a third of the cost of
        # tracing per request); the replica gets this span's context, marked not sampled
        self._recording = self._span.is_recording()

    def route(self) -> _OtelSpan | Span:
        if not self._recording:
            return NO_SPAN
        span = _OtelSpan(self._tracer.start_span("kvroute.route", context=self._context), 500)
        span.set(policy=self._policy)
        return span

    def upstream(self, **attributes: Any) -> tuple[_OtelSpan | Span, dict[str, str]]:
        if not self._recording:
            unsampled: dict[str, str] = {}
            _W3C.inject(unsampled, context=self._context)
            return NO_SPAN, unsampled
        span = self._tracer.start_span("kvroute.upstream", context=self._context, kind=SpanKind.CLIENT)
        headers: dict[str, str] = {}
        _W3C.inject(headers, context=trace.set_span_in_context(span))
        traced = _OtelSpan(span, 400)
        traced.set(**attributes)
        return traced, headers

    def end(self, status: int, **attributes: Any) -> None:
        if not self._recording:
            self._span.end()
            return
        span = _OtelSpan(self._span, 500)
        span.set(policy=self._policy, **attributes)
        span.end(status)


class OtelTracing:
    """The global tracer provider if one is set (``opentelemetry-instrument``, a test), else one
    configured from ``OTEL_*`` (router/tracing.py), flushed and shut down with the router."""

    def __init__(self, policy: str, *, service_name: str):
        self._policy = policy
        self._own: TracerProvider | None = None
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # nobody set one
            attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
            self._own = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER
            exporter = exporter_from_env()
            if exporter is not None:
                self._own.add_span_processor(BatchSpanProcessor(exporter))
            provider: Any = self._own
        else:
            provider = trace.get_tracer_provider()
        self._tracer = provider.get_tracer("kvroute.router")

    def request(self, headers: Mapping[str, str], name: str) -> _OtelRequestTrace:
        return _OtelRequestTrace(self._tracer, headers, name, self._policy)

    def shutdown(self) -> None:
        if self._own is not None:
            self._own.shutdown()  # exports what the batch still holds
