"""OpenTelemetry traces: a span per request, with children for its routing decision and
for each attempt on a backend, whose id the backend gets in `traceparent` (vLLM continues
the trace with `--otlp-traces-endpoint`). Attributes follow OpenTelemetry's GenAI and
HTTP semantic conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...).

Off by default, and then nothing here runs. On, the sampling decision comes first and
costs no span: a client's `traceparent` decides (sampled: continue it; not sampled: it
passes to the backend untouched), else `sample_ratio`. Spans are ended with the times
the request already measured and exported in batches by the SDK's thread, off the loop.
The SDK is an optional extra (`kvroute[otel]`), imported only when tracing is on.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import MutableMapping

from router.config import ConfigError, TracingConfig
from router.dispatch.call import Call, Routed
from router.fleet.backend import Backend
from router.metrics.process import release
from router.request import Kind
from router.upstream.usage import Usage

#: W3C Trace Context: version 00, trace id, parent id, flags (lowercase hex)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
#: gen_ai.operation.name by endpoint
_OPERATION = {
    Kind.CHAT: "chat",
    Kind.COMPLETION: "text_completion",
    Kind.EMBEDDING: "embeddings",
    Kind.OTHER: "other",
}


def parent_sampled(traceparent: str | None) -> bool | None:
    """The sampled flag of a valid `traceparent`; None when there is none or it is not
    valid (the request then starts a trace of its own, as W3C says)."""
    if traceparent is None:
        return None
    found = _TRACEPARENT.fullmatch(traceparent.strip())
    if found is None or found.group(1) == _ZERO_TRACE or found.group(2) == _ZERO_SPAN:
        return None
    return bool(int(found.group(3), 16) & 1)


class Tracing:
    """The router's tracer: decides which requests are traced, and exports their spans."""

    def __init__(self, config: TracingConfig, exporter=None) -> None:
        """`exporter`: where spans go (an SDK SpanExporter); by default OTLP/HTTP to
        `config.otlp_endpoint`. ConfigError if the SDK is not installed."""
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise ConfigError(
                "tracing.enabled needs the OpenTelemetry SDK: pip install 'kvroute[otel]'"
            ) from None
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        resource = Resource.create(
            {"service.name": config.service_name, "service.version": release()}
        )
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("kvroute")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._ratio = config.sample_ratio

    def begin(self, call: Call) -> RequestTrace | None:
        """The trace of `call`, or None if it is not sampled."""
        headers = call.headers
        sampled = parent_sampled(headers.get("traceparent"))
        if sampled is False or (sampled is None and random.random() >= self._ratio):
            return None
        parent = None
        if sampled:
            carrier = {"traceparent": headers["traceparent"]}
            if "tracestate" in headers:
                carrier["tracestate"] = headers["tracestate"]
            parent = self._propagator.extract(carrier)
        return RequestTrace(self, call, parent)

    def close(self) -> None:
        """Export the spans still buffered (at shutdown)."""
        self._provider.shutdown()


class RequestTrace:
    """One sampled request's spans: the request's (SERVER), its routing decision's and
    one per attempt (CLIENT), each attempt's id sent to its backend."""

    __slots__ = ("_attempt", "_context", "_span", "_tracing")

    def __init__(self, tracing: Tracing, call: Call, parent) -> None:
        self._tracing = tracing
        operation = _OPERATION[call.kind]
        model = call.req.model or ""
        attributes = {
            "gen_ai.operation.name": operation,
            "http.request.method": call.method,
            "url.path": call.path,
            "kvroute.request_id": call.request_id,
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if call.tenant is not None:
            attributes["kvroute.tenant"] = call.tenant
        trace = tracing._trace
        self._span = tracing._tracer.start_span(
            f"{operation} {model}".rstrip(),
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
            start_time=_ns_ago(call.started),
        )
        self._context = trace.set_span_in_context(self._span)
        self._attempt = None

    def routed(self, routed: Routed, strategy: str, began: float, call: Call) -> None:
        """The routing decision's span: from `began` (perf_counter) to now, with the
        request's class and its wait in admission's queue."""
        elapsed = time.perf_counter() - began
        now = time.time_ns()
        span = self._tracing._tracer.start_span(
            "kvroute.route",
            context=self._context,
            attributes={
                "kvroute.strategy": strategy,
                "kvroute.backend": routed.backend.name,
                "kvroute.route.reason": routed.reason,
                "kvroute.predicted_cached_tokens": routed.predicted_cached,
                "kvroute.priority": call.priority or "",
                "kvroute.queue_wait_ms": round(call.queued * 1000, 3),
            },
            start_time=now - int(elapsed * 1e9),
        )
        span.end(now)

    def attempt_begins(self, backend: Backend, method: str, headers: MutableMapping[str, str]):
        """Open the span of an attempt on `backend` and put its id in the backend's
        `traceparent` (the client's `tracestate` passes as it came)."""
        url = backend.url
        span = self._attempt = self._tracing._tracer.start_span(
            method,
            context=self._context,
            kind=self._tracing._trace.SpanKind.CLIENT,
            attributes={
                "kvroute.backend": backend.name,
                "server.address": url.host or "",
                "server.port": url.port or 0,
            },
        )
        ctx = span.get_span_context()
        headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"

    def attempt_ends(self, status: str, error: Exception | None, first_chunk_at: float | None):
        """End the attempt's span: its status, failure and first chunk (loop clock)."""
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if first_chunk_at is not None:
            span.add_event("first_chunk", timestamp=_ns_ago(first_chunk_at))
        _outcome(span, status, error, self._tracing._trace)
        span.end()

    def finish(
        self, status: str, error: Exception | None, used: Usage, backend: str, retries: int
    ) -> None:
        """End the request's span with its outcome and the tokens its answer reported."""
        span = self._span
        attributes: dict[str, str | int] = {"kvroute.retries": retries}
        if backend:
            attributes["kvroute.backend"] = backend
        if used.prompt is not None:
            attributes["gen_ai.usage.input_tokens"] = used.prompt
        if used.completion is not None:
            attributes["gen_ai.usage.output_tokens"] = used.completion
        if used.cached is not None:
            attributes["gen_ai.usage.cache_read.input_tokens"] = used.cached
        span.set_attributes(attributes)
        _outcome(span, status, error, self._tracing._trace)
        span.end()


def _outcome(span, status: str, error: Exception | None, trace) -> None:
    if status.isdigit():
        span.set_attribute("http.response.status_code", int(status))
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    elif status.isdigit() and int(status) >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))


def _ns_ago(loop_time: float) -> int:
    """A loop-clock time as wall-clock nanoseconds, as spans are stamped."""
    ago = asyncio.get_running_loop().time() - loop_time
    return time.time_ns() - int(ago * 1e9)
