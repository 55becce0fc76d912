"""The spans of a request's stages (OpenTelemetry), for a balancer with tracing on: only such a balancer imports this
module (skylb/balancer/tracing.py), and with it the OpenTelemetry SDK.

One trace per request, across regions. At each balancer the request gets a SERVER span, "POST /v1/chat/completions"
(OpenTelemetry semantic conventions, "HTTP spans", server span), whose parent is the caller's ``traceparent`` (W3C
Trace Context, §3.2): a client's, or the relay span of the balancer that forwarded it, so one trace shows both
balancers. Its children, one set per attempt:

* ``skylb.queue``: the wait in the balancer's queue for a routing decision (``skylb.queue.wait_s``);
* ``skylb.route``: the routing decision (``skylb.route`` local or peer, ``skylb.target`` the replica or region,
  ``skylb.rule`` the profile's plugin that chose it);
* ``{gen_ai.operation.name} {gen_ai.request.model}``, kind CLIENT: the relay to the replica or peer, with the
  attributes of the GenAI semantic conventions' inference span ("Semantic conventions for generative AI client
  inference": ``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``, ``gen_ai.request.stream``,
  ``gen_ai.request.max_tokens``, ``gen_ai.response.time_to_first_chunk``, ``gen_ai.usage.input_tokens``,
  ``gen_ai.usage.output_tokens``, ``server.address``, ``server.port``, ``error.type``); its context goes upstream as
  the ``traceparent`` the replica or peer continues;
* ``skylb.retry``: the backoff after an attempt that failed before its first byte, before the next attempt.

The SDK's batch span processor exports them from a thread of its own (OTLP/HTTP, protobuf), so a request never waits
on the collector; its queue is bounded (2048 spans by default, ``$OTEL_BSP_MAX_QUEUE_SIZE``) and drops when full.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import structlog
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from skylb.balancer.protocol import ANSWER_USAGE, answer_complete

__all__ = ["Tracing", "TracedChain", "RequestTrace", "operation_name", "SERVICE_NAME"]

#: The ``service.name`` of a balancer's spans when $OTEL_SERVICE_NAME does not name one.
SERVICE_NAME = "skylb-balancer"
#: ``gen_ai.operation.name`` by request path (GenAI semantic conventions' well-known values: chat, text_completion,
#: embeddings); Ollama's /api/generate is a text completion, its /api/chat a chat.
_OPERATIONS = {"/v1/chat/completions": "chat", "/api/chat": "chat", "/v1/completions": "text_completion",
               "/api/generate": "text_completion", "/v1/embeddings": "embeddings", "/api/embed": "embeddings",
               "/api/embeddings": "embeddings"}
#: ``gen_ai.provider.name`` of a forwarded attempt: the service called is another region's SkyLB balancer.
PEER_PROVIDER = "skylb"


def operation_name(path: str) -> str:
    """The GenAI ``gen_ai.operation.name`` of a request at ``path`` ("chat", "text_completion" or "embeddings")."""
    return _OPERATIONS.get(path, "chat")


def _attributes(**values: Any) -> dict[str, Any]:
    """Span attributes from keyword arguments, dots for double underscores, the None values left out (the
    OpenTelemetry API refuses None)."""
    return {key.replace("__", "."): value for key, value in values.items() if value is not None}


class Tracing:
    """A balancer's tracer: its provider (resource, sampler), the OTLP/HTTP exporter and the W3C propagator.

    Args: endpoint: the URL spans are posted to; region: the balancer's region; instance: its advertised URL
    (``service.instance.id``); sample_ratio: the share of traces started here that are recorded (0-1).
    """

    def __init__(self, *, endpoint: str, region: str, instance: str, sample_ratio: float = 1.0):
        self.endpoint = endpoint
        self.region = region
        resource = Resource.create({"service.instance.id": instance, "skylb.region": region})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))  # $OTEL_SERVICE_NAME wins
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("skylb.balancer")
        self.propagator = TraceContextTextMapPropagator()

    def traced(self, chain) -> "TracedChain":
        """``chain`` (a stages.Chain) with a SERVER span around each request it runs."""
        return TracedChain(chain, self)

    async def shutdown(self, timeout_s: float) -> bool:
        """Export what is left and stop the exporter's thread, waiting at most ``timeout_s`` s (the event loop keeps
        running meanwhile); True when it finished in time."""
        closing = threading.Thread(target=self.provider.shutdown, name="skylb-tracing-shutdown", daemon=True)
        closing.start()
        deadline = time.monotonic() + timeout_s
        while closing.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not closing.is_alive()


class TracedChain:
    """A request chain whose ``run`` records the request's SERVER span; anything else is the chain's own."""

    def __init__(self, chain, tracing: Tracing):
        self.chain = chain
        self.tracing = tracing

    def __getattr__(self, name: str):
        return getattr(self.chain, name)

    async def run(self, ctx):
        """Run ``ctx`` (a RequestContext) through the chain inside its SERVER span (``ctx.trace``); the span ends
        with the response's status, or with the error that ended the request. Returns the chain's response."""
        ctx.trace = request_trace = RequestTrace(self.tracing, ctx)
        # Every line logged for this request, its canonical line included, names its trace.
        structlog.contextvars.bind_contextvars(trace_id=request_trace.trace_id)
        try:
            response = await self.chain.run(ctx)
        except BaseException as exc:
            request_trace.end(ctx, None, error=exc)
            raise
        request_trace.end(ctx, response)
        return response


class RequestTrace:
    """The spans of one request at this balancer (module docstring); RouteStage calls it at each stage.

    Attributes: span: the SERVER span; trace_id: the trace's id (32 hex digits).
    """

    def __init__(self, tracing: Tracing, ctx):
        self.tracing = tracing
        request = ctx.http
        self.operation = operation_name(request.path)
        parent = tracing.propagator.extract(request.headers)  # none or an invalid one: this request starts a trace
        self.span = tracing.tracer.start_span(
            f"{request.method} {request.path}", context=parent, kind=SpanKind.SERVER,
            attributes=_attributes(http__request__method=request.method, url__path=request.path,
                                   http__route=request.path, skylb__region=tracing.region,
                                   skylb__request_id=ctx.request_id, skylb__client_request_id=ctx.client_id,
                                   gen_ai__operation__name=self.operation))
        self.context = trace.set_span_in_context(self.span, parent)
        self.trace_id = trace.format_trace_id(self.span.get_span_context().trace_id)
        self._open: dict[str, Any] = {}  # the child spans not ended yet, by kind: "queue", "relay", "retry"
        self._relay_started_at = 0.0
        self._first_chunk_s: float | None = None  # the current relay's first chunk, s after it started

    def _start(self, kind: str, name: str, span_kind: SpanKind = SpanKind.INTERNAL, **attributes: Any):
        span = self.tracing.tracer.start_span(name, context=self.context, kind=span_kind,
                                              attributes=_attributes(**attributes))
        self._open[kind] = span
        return span

    def _end(self, kind: str, *, error: str | None = None, description: str | None = None, **attributes: Any):
        span = self._open.pop(kind, None)
        if span is None:
            return
        span.set_attributes(_attributes(error__type=error, **attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, description or error))
        span.end()

    def queue_started(self, attempt: int, ctx) -> None:
        """The request (attempt ``attempt``, 0 first) enters the queue to wait for a routing decision."""
        self._start("queue", "skylb.queue", skylb__attempt=attempt, skylb__priority=ctx.priority,
                    skylb__tenant=ctx.tenant, skylb__forwarded_from=ctx.forwarded_from)

    def queue_failed(self, reason: str, message: str) -> None:
        """It left the queue without a decision: ``reason`` "queue_full" or "queue_timeout"."""
        self._end("queue", error=reason, description=message)

    def routed(self, decision, *, policy: str) -> None:
        """The routing decision (a skylb.core Decision) came: the queue span ends, the route span records it."""
        self._end("queue", skylb__queue__wait_s=decision.queued_s)
        self._start("route", "skylb.route", skylb__route=decision.route, skylb__target=decision.target,
                    skylb__rule=decision.rule, skylb__policy=policy, skylb__queue__wait_s=decision.queued_s)
        self._end("route")

    def relay_started(self, decision, *, attempt: int, engine: str | None, stream: bool,
                      max_tokens: int | None, now: float) -> dict[str, str]:
        """The relay of attempt ``attempt`` to ``decision``'s target starts at ``now`` (the balancer's clock, s);
        ``engine``: the local replica's engine adapter (None for a peer). Returns the headers that carry its
        context upstream (``traceparent``, and ``tracestate`` when the caller sent one)."""
        model, operation = decision.request.model, self.operation
        target = urlsplit(decision.url)
        span = self._start(
            "relay", f"{operation} {model}" if model else operation, SpanKind.CLIENT,
            gen_ai__operation__name=operation, gen_ai__provider__name=engine or PEER_PROVIDER,
            gen_ai__request__model=model, gen_ai__request__stream=stream, gen_ai__request__max_tokens=max_tokens,
            server__address=target.hostname, server__port=target.port, skylb__route=decision.route,
            skylb__target=decision.target, skylb__attempt=attempt,
            http__request__resend_count=attempt or None)
        self._relay_started_at, self._first_chunk_s = now, None
        headers: dict[str, str] = {}
        self.tracing.propagator.inject(headers, context=trace.set_span_in_context(span, self.context))
        return headers

    def exemplar(self) -> dict[str, str] | None:
        """The labels of a metric exemplar that points at the current relay span (OpenMetrics exemplars: trace_id
        and span_id, as Prometheus and Grafana read them); None when the trace is not recorded (sampled out), which
        no exemplar should point at."""
        span = self._open.get("relay", self.span)
        context = span.get_span_context()
        if not context.trace_flags.sampled:
            return None
        return {"trace_id": self.trace_id, "span_id": trace.format_span_id(context.span_id)}

    def first_chunk(self, ttft_s: float, *, arrived_at: float) -> None:
        """The relay's first chunk reached the client ``ttft_s`` s after the request's arrival (``arrived_at``, the
        balancer's clock): kept for the relay span, which a client closing after its last event ends early."""
        self._first_chunk_s = max(0.0, arrived_at + ttft_s - self._relay_started_at)

    def relay_ended(self, outcome, *, arrived_at: float) -> None:
        """The relay attempt ended with ``outcome`` (a RelayOutcome); ``arrived_at``: the request's arrival on the
        balancer's clock, s (RelayOutcome.ttft_s counts from it, the GenAI convention from the call)."""
        usage = outcome.usage
        cached = None
        if usage is not None and usage.prompt_tokens is not None and usage.prefilled_tokens is not None:
            cached = usage.prompt_tokens - usage.prefilled_tokens or None
        error = None
        if outcome.failure is not None or outcome.error is not None:
            error = str(outcome.status) if outcome.status >= 400 else (outcome.failure or "stream_error")
        first_chunk = (None if outcome.ttft_s is None
                       else max(0.0, arrived_at + outcome.ttft_s - self._relay_started_at))
        self._end("relay", error=error, description=outcome.error,
                  http__response__status_code=outcome.status, gen_ai__response__time_to_first_chunk=first_chunk,
                  gen_ai__usage__input_tokens=None if usage is None else usage.prompt_tokens,
                  gen_ai__usage__output_tokens=None if usage is None else usage.output_tokens,
                  gen_ai__usage__cache_read__input_tokens=cached,
                  skylb__retried=outcome.response is None)

    def retry_started(self, decision, outcome, *, attempt: int, backoff_s: float) -> None:
        """The backoff before attempt ``attempt`` starts: the last attempt (``decision``, ``outcome``) failed
        before its first byte."""
        self._start("retry", "skylb.retry", skylb__attempt=attempt, skylb__retry__backoff_s=backoff_s,
                    skylb__failed_route=decision.route, skylb__failed_target=decision.target,
                    skylb__failure=outcome.error)

    def retry_ended(self) -> None:
        """The backoff is over: the request goes back to the head of the queue."""
        self._end("retry")

    def end(self, ctx, response, *, error: BaseException | None = None) -> None:
        """End the SERVER span (and any child span an error or a cancellation left open) with the request's
        outcome: its HTTP status, where it went, its TTFT (s), or the error that ended it. A client that closed
        after its stream's last event (``protocol.answer_complete``) got its answer: no error then."""
        complete = isinstance(error, asyncio.CancelledError) and answer_complete(ctx.http) is not None
        if complete:  # RequestLog.cancelled logs it with the stream's status too
            error = None
            usage = ctx.http.get(ANSWER_USAGE)
            self._end("relay", http__response__status_code=answer_complete(ctx.http),
                      gen_ai__response__time_to_first_chunk=self._first_chunk_s,
                      gen_ai__usage__input_tokens=None if usage is None else usage.prompt_tokens,
                      gen_ai__usage__output_tokens=None if usage is None else usage.output_tokens)
        for kind in list(self._open):
            self._end(kind, error=None if complete else
                      "cancelled" if isinstance(error, asyncio.CancelledError) else "aborted")
        status = ctx.status if ctx.status is not None else (None if response is None else response.status)
        decision = ctx.decision
        self.span.set_attributes(_attributes(
            http__response__status_code=status, gen_ai__request__model=ctx.model, skylb__tenant=ctx.tenant,
            skylb__priority=ctx.priority, skylb__forwarded_from=ctx.forwarded_from, skylb__reason=ctx.reason,
            skylb__route=None if decision is None else decision.route,
            skylb__target=None if decision is None else decision.target, skylb__ttft_s=ctx.ttft_s))
        if error is not None:
            kind = "cancelled" if isinstance(error, asyncio.CancelledError) else type(error).__qualname__
            self.span.set_attributes({"error.type": kind})
            self.span.set_status(Status(StatusCode.ERROR, kind))
        elif status is not None and status >= 500:  # HTTP conventions: a server span errs on 5xx only
            self.span.set_attributes({"error.type": str(status)})
            self.span.set_status(Status(StatusCode.ERROR, ctx.error or str(status)))
        self.span.end()
