"""OpenTelemetry traces, exported over OTLP/HTTP: off unless an endpoint is given.

``mcp-agent serve/run --otlp-endpoint URL`` and ``mcp-controlplane serve --otlp-endpoint URL``
(``MCP_OTLP_ENDPOINT``) turn tracing on: spans go, batched, to ``URL/v1/traces`` (any OTLP/HTTP
receiver: the OpenTelemetry Collector, Jaeger, Tempo). Without it nothing is imported and
nothing is measured. What is traced:

- on the agent, each inference request (HTTP and gRPC), continuing the caller's trace when
  the request carries a W3C ``traceparent`` (HTTP header or gRPC metadata);
- a deployment, from the control plane's deploy call (``deploy MODEL VERSION``) to the
  device's ``active`` event: the control plane puts its span's ``traceparent`` into the
  desired states it issues, and the agent's deployment span (one child span per phase of its
  update state machine) continues that trace.

:class:`Tracing` is built once at the edge (the command line) and passed down; no global
tracer provider is installed. It needs the ``otel`` extra (``pip install 'mcp-edge[otel]'``).
"""

from __future__ import annotations

import re
from typing import Any

from mcp_edge.shared.errors import McpError

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
"""A W3C trace context ``traceparent`` as this project writes and accepts it (version 00)."""


class TracingError(McpError):
    """Tracing was asked for but cannot run (the ``otel`` extra is missing, a bad URL)."""


class Tracing:
    """One process's tracer, exporting to an OTLP/HTTP endpoint.

    Raises :class:`TracingError` when OpenTelemetry is not installed or the URL is not HTTP.
    """

    def __init__(self, service: str, endpoint: str, *, flush_interval_s: float = 1.0) -> None:
        if not endpoint.startswith(("http://", "https://")):
            raise TracingError(f"OTLP endpoint {endpoint!r} must be an http:// or https:// URL")
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise TracingError(
                f"--otlp-endpoint needs OpenTelemetry ({e.name}); pip install 'mcp-edge[otel]'"
            ) from e
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        self.endpoint = url
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url, timeout=10),
                schedule_delay_millis=int(flush_interval_s * 1000),
            )
        )
        self.tracer: Any = self.provider.get_tracer("mcp-edge")
        self.kind: Any = trace.SpanKind

    def traceparent(self, span: Any = None) -> str | None:
        """The ``traceparent`` of ``span`` (default: the current span), or None."""
        context = None if span is None else self._trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=context)
        value = carrier.get("traceparent")
        return value if value is not None and TRACEPARENT.match(value) else None

    def context(self, traceparent: str | None) -> Any:
        """The context to continue a remote trace in; None for no (or a malformed) parent."""
        if not traceparent or not TRACEPARENT.match(traceparent):
            return None
        return self._propagator.extract({"traceparent": traceparent})

    def within(self, span: Any) -> Any:
        """A context whose current span is ``span`` (to start its children in)."""
        return self._trace.set_span_in_context(span)

    def annotate(self, **attributes: str | int | float | bool) -> None:
        """Set attributes on the current span (``mcp_version`` becomes ``mcp.version``)."""
        span = self._trace.get_current_span()
        for key, value in attributes.items():
            span.set_attribute(key.replace("_", ".", 1), value)

    def error(self, span: Any, message: str) -> None:
        """Mark ``span`` as failed with ``message``."""
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, message[:500]))

    def shutdown(self) -> None:
        """Send the spans still buffered and stop the exporter."""
        self.provider.shutdown()


def setup_tracing(service: str, endpoint: str | None) -> Tracing | None:
    """A :class:`Tracing` for ``service`` when ``endpoint`` is given, else None (no tracing).
    Raises :class:`TracingError`."""
    if not endpoint:
        return None
    return Tracing(service, endpoint)
