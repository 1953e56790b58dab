"""W3C trace context through the router; OpenTelemetry spans with ``--tracing``.

Always: a client's ``traceparent`` and ``tracestate`` go on to the replica unchanged, so a trace
the client started continues in vLLM (``--otlp-traces-endpoint``) with the router invisible.

With ``--tracing`` (the optional extra, ``pip install 'kvroute[otel]'``, imported only then): a
SERVER span per routed request, child of the client's context or the root of a new trace, and
under it a span for the route decision (``kvroute.route``) and one CLIENT span per upstream
attempt (``kvroute.upstream``), whose context is the ``traceparent`` the replica gets; so the
replica's spans hang under the attempt that reached it, and a retry shows as a second attempt.
Attributes: the model, the replica (its metrics label) and URL, the policy, the prompt's and the
cached tokens, the status.  Configuration is OpenTelemetry's own environment: ``OTEL_SERVICE_NAME``
(default ``kvroute-router``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and its
``_ARG``, ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` / ``_PROTOCOL`` (``http/protobuf``, the
default, or ``grpc``) / ``_HEADERS``, ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``).
A tracer provider set before the router starts (``opentelemetry-instrument``, a test's) is used
as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.router.spans import NO_SPAN, Span

TRACE_HEADERS = ("traceparent", "tracestate")
__all__ = ["NO_SPAN", "RequestTrace", "Span", "Tracing", "client_trace_headers", "make_tracing"]
MISSING_EXTRA = "--tracing needs OpenTelemetry: pip install 'kvroute[otel]' (opentelemetry-api, -sdk, -exporter-otlp)"
DEFAULT_SERVICE_NAME = "kvroute-router"


def client_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's W3C trace context, to pass on as it came."""
    return {name: value for name in TRACE_HEADERS if (value := headers.get(name))}


class RequestTrace:
    """One request's trace with tracing off: no spans; the client's context forwarded unchanged."""

    __slots__ = ("_forward",)

    def __init__(self, headers: Mapping[str, str]):
        self._forward = client_trace_headers(headers)

    def route(self) -> Span:
        return NO_SPAN

    def upstream(self, **attributes: Any) -> tuple[Span, dict[str, str]]:
        """An attempt's span and the trace headers the replica gets."""
        return NO_SPAN, self._forward

    def end(self, status: int, **attributes: Any) -> None:
        pass


class Tracing:
    """Makes each request's :class:`RequestTrace` (this base: tracing off)."""

    def request(self, headers: Mapping[str, str], name: str) -> RequestTrace:
        return RequestTrace(headers)

    def shutdown(self) -> None:
        pass


def make_tracing(enabled: bool, policy: str) -> Tracing:
    """``--tracing``: OpenTelemetry's spans (ValueError if the extra is missing); else pass-through."""
    if not enabled:
        return Tracing()
    try:
        from kvroute.router.otel import OtelTracing
    except ImportError as exc:
        raise ValueError(f"{MISSING_EXTRA}; {exc}") from None
    return OtelTracing(policy, service_name=DEFAULT_SERVICE_NAME)  # type: ignore[return-value]
