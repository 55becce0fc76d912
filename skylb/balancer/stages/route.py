"""The terminal stage: queue, route, relay, and retry before the first byte.

Like Envoy's router filter (Envoy architecture overview, "HTTP routing" and "Retry semantics"), it always answers, and a
retry happens inside it, so no stage before it runs twice. The request waits in the balancer's queue until the
dispatcher routes it to a local replica or a peer (SkyLB paper §3.3, selective pushing), through an Ollama fleet's
fallback chain when its model has one; the relay streams the answer back. A target that fails before the first byte
(refused, reset, timed out, 502/503/504) counts a gateway failure for outlier detection (ejected after enough in a
row: skylb/core/outlier.py), one that answers 500 a 5xx, and the request, after a jittered backoff, goes back to the head of the queue to be routed to
another target while it has retries left (``retry_policy.num_retries``) and the retry budget allows
(skylb/balancer/retry.py; Envoy's names). 503 with Retry-After when the request's model has had no usable replica or
peer for ``no_target_timeout_s`` (the dispatcher's NoHealthyTarget). Once a byte reached the client it is never retried (a started stream cannot be
spliced). 503 with an estimated Retry-After when the queue is full or the request waited past the queue timeout.
A replica that answers 501 Not Implemented (llama-server without ``--embeddings``) gets no request of that kind
for ``UNSUPPORTED_HOLD_S`` (Router.unsupported) and the request goes to another target; with none left that serves
it, the client gets 501 naming the model and what the engine said.
A request pinned to one target (``ctx.pin``: a Responses API follow-up, skylb/balancer/stages/responses.py) skips
the queue and goes to that target at once, retries included; 503 with Retry-After when it is unavailable.
When the balancer traces, each step is a span of the request's trace (``ctx.trace``: queue, routing decision, relay,
retry backoff; skylb/balancer/spans.py) and the relay's context goes upstream as its ``traceparent``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aiohttp import web

from skylb.balancer.api import error_response
from skylb.balancer import retry_after
from skylb.balancer.dispatcher import Dispatcher, NoHealthyTarget, QueueFull, QueueTimeout
from skylb.balancer.metrics import BalancerMetrics
from skylb.balancer.ollama_fleet import Fleet
from skylb.balancer.protocol import QUEUE_MS_HEADER, queued_ms
from skylb.balancer.relay import Relay
from skylb.balancer.retry import RetryBudget, backoff_s
from skylb.balancer.retry_after import queue_retry_after_s
from skylb.balancer.stages.context import RequestContext
from skylb.balancer.usage import observe as observe_usage
from skylb.config import BalancerConfig
from skylb.core import Decision, Request, Router

__all__ = ["RouteStage"]

log = structlog.get_logger("skylb.request")

#: How long a replica that answered 501 to a kind of request (embeddings, generation) gets none of that kind, s:
#: long enough not to pay a failed attempt per request, short enough for a replica restarted with the feature.
UNSUPPORTED_HOLD_S = 300.0


class RouteStage:
    """Queue, route, relay with retries; sets ``ctx.decision``, ``ctx.outcome``, ``ctx.answered`` and the log fields.

    Args: cfg: the balancer's settings (queue timeout, retry policy, probe interval, Retry-After); router, dispatcher,
    relay, fleet: the balancer's parts; metrics: its metrics; budget: its retry budget; now(): its clock, s;
    in_flight(): requests it holds now (the retry budget's base); region: its region.
    """

    name = "route"

    def __init__(self, cfg: BalancerConfig, *, router: Router, dispatcher: Dispatcher, relay: Relay, fleet: Fleet,
                 metrics: BalancerMetrics, budget: RetryBudget, now: Callable[[], float],
                 in_flight: Callable[[], int], region: str):
        self.cfg, self.router, self.dispatcher, self.relay, self.fleet = cfg, router, dispatcher, relay, fleet
        self.metrics, self.budget, self.now, self.in_flight, self.region = metrics, budget, now, in_flight, region

    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        routed = self._core_request(ctx)
        trace = ctx.trace  # None unless the balancer traces (skylb/balancer/spans.py)
        attempt, retrying = 0, False  # retrying: holds a place in the retry budget
        try:
            while True:
                ctx.decision = None  # a request given up in the queue was routed nowhere (its log line)
                if trace is not None:
                    trace.queue_started(attempt, ctx)
                try:
                    if routed.pin is not None:  # a follow-up of a stateful answer: only its target can serve it
                        ctx.decision = self._place_pinned(routed)
                    else:
                        ctx.decision, ctx.body = await self.fleet.acquire(routed, ctx.body, retry=attempt > 0)
                except NoHealthyTarget as exc:
                    if trace is not None:
                        trace.queue_failed("model_unavailable", str(exc))
                    return ctx.reject(503, str(exc), "model_unavailable", type_="service_unavailable",
                                      retry_after_s=retry_after.retry_after_s(self.cfg.retry_after_s))
                except (QueueFull, QueueTimeout) as exc:
                    full = isinstance(exc, QueueFull)
                    reason = "queue_full" if full else "queue_timeout"
                    if trace is not None:
                        trace.queue_failed(reason, str(exc))
                    return ctx.reject(503, f"{exc}; retry later" if full else str(exc), reason,
                                      type_="overloaded_error", retry_after_s=self._queue_retry_after())
                if trace is not None:
                    trace.routed(ctx.decision, policy=self.cfg.policy)
                outcome = await self._attempt(ctx, attempt)
                if retrying:
                    self.budget.release()
                    retrying = False
                if outcome.response is not None:
                    ctx.ttft_s, ctx.error, ctx.status = outcome.ttft_s, outcome.error, outcome.status
                    return outcome.response
                if outcome.failure == "unsupported" and not self._served_elsewhere(ctx, routed):
                    ctx.error = (f"no target here serves {routed.kind} for model {routed.model or '(any)'!r}: "
                                 f"{outcome.error}")
                    ctx.status = 501
                    return error_response(ctx.api, 501, ctx.error)
                if not self.budget.try_acquire(self.in_flight()):  # failed before any byte reached the client
                    self.metrics.child(self.metrics.retry_budget_exhausted, self.region).inc()
                    ctx.error, ctx.status = f"{outcome.error}; not retried: retry budget exhausted", outcome.status
                    return error_response(ctx.api, outcome.status, ctx.error)
                retrying, attempt = True, attempt + 1
                await self._back_off(ctx, routed, attempt)
        finally:
            if retrying:
                self.budget.release()

    def _core_request(self, ctx: RequestContext) -> Request:
        # A forwarded request keeps its place in first-come, first-served order: its wait at the forwarding balancer
        # counts here (capped by the queue timeout, so a bad value cannot put it ahead of everything for long).
        waited_s = (min(queued_ms(ctx.http.headers.get(QUEUE_MS_HEADER)) / 1000.0, self.cfg.queue_timeout_s)
                    if ctx.forwarded else 0.0)
        parsed = ctx.parsed
        return Request(id=ctx.request_id, text=parsed.text, arrived_at=ctx.arrived_at, model=parsed.model,
                       session_key=parsed.session_key, forwarded_from=ctx.forwarded_from, api=ctx.route_api,
                       waited_s=waited_s, embedding=ctx.embedding, priority=ctx.priority, tenant=ctx.tenant,
                       pin=ctx.pin, block_hashes=ctx.block_hashes, prompt_tokens=ctx.prompt_tokens,
                       max_tokens=parsed.max_tokens)

    def _place_pinned(self, routed: Request) -> Decision:
        """``routed``'s pinned target, at once (Router.place_pinned); QueueTimeout saying why when it cannot take
        it (its target went away or is unavailable; retried by the client after Retry-After)."""
        decision = self.router.place_pinned(routed, self.now())
        if decision is None:
            _, why = (self.router.pinned_unavailable_reason(routed.pin, self.now(), may_forward=routed.may_forward,
                                                            model=routed.model, api=routed.api)
                      or ("", "its target is unavailable"))
            raise QueueTimeout(f"the target holding this request's state cannot take it: {why}")
        self.dispatcher.on_routed(decision)
        return decision

    async def _attempt(self, ctx: RequestContext, attempt: int):
        """One relay to the decision's target; the target's slot is released and outlier detection told, however
        the relay ends: for an answer, in the event loop's next turn, once aiohttp has sent it (before the loop
        reads anything more, so the next request finds the slot free), so the client does not wait for them."""
        decision, trace = ctx.decision, ctx.trace
        ttft_histogram = self.metrics.child(self.metrics.ttft, self.region, decision.route)
        trace_headers = exemplar = None
        if trace is not None:  # the relay's span; its context goes upstream, its ids on the TTFT as an exemplar
            trace_headers = trace.relay_started(decision, attempt=attempt, engine=self._engine(decision),
                                                stream=ctx.parsed.stream, max_tokens=ctx.parsed.max_tokens,
                                                now=self.now())
            exemplar = trace.exemplar()

        def first_byte(ttft_s: float) -> None:
            ttft_histogram.observe(ttft_s, exemplar)
            if trace is not None:
                trace.first_chunk(ttft_s, arrived_at=ctx.arrived_at)
            self.router.first_token(decision, self.now())  # its prompt left the replica's prefill backlog
            self.fleet.first_byte(decision, ttft_s)
            self.dispatcher.wake()

        counted: list[bool] = []  # the forward was counted where it was answered (at its stream's last event)
        try:
            ctx.outcome = outcome = await self.relay.relay(
                ctx.http, ctx.body, decision, request_id=ctx.request_id, arrived_at=ctx.arrived_at,
                retry_allowed=attempt < self.cfg.retry_policy.num_retries, api=ctx.api, stream=ctx.parsed.stream,
                on_first_byte=first_byte, client_request_id=ctx.client_id, abandon=self._peer_gone(decision),
                check_s=self.cfg.probe_interval_ms / 1000, extra_headers=ctx.response_headers,
                trace_headers=trace_headers, translation=ctx.translation,
                on_head=None if ctx.on_answer_head is None else (lambda head: ctx.on_answer_head(decision, head)),
                on_complete=lambda: self._engine_done(decision, counted))
        except BaseException:
            self._attempt_ended(decision, None)
            raise
        if trace is not None:
            trace.relay_ended(outcome, arrived_at=ctx.arrived_at)
        if outcome.response is not None:
            if outcome.relayed and not counted:  # a forward counts where it was answered (no-op if local), not a
                self.router.forward_answered(decision)  # balancer's error
            asyncio.get_running_loop().call_soon(self._attempt_ended, decision, outcome)
        else:  # a retry follows: the slot and the failure count first
            self._attempt_ended(decision, outcome)
        ctx.answered = ctx.answered or outcome.response is not None
        return outcome

    def _engine_done(self, decision: Decision, counted: list[bool]) -> None:
        """The target sent the stream's last event: its replica's slot is free before the client reads the end, and
        a forward is answered (counted now, into ``counted``: a client that closes once it reads the last event
        cancels the handler before the relay returns, and still had its answer)."""
        self.router.engine_done(decision, self.now())
        self.router.forward_answered(decision)
        counted.append(True)
        self.dispatcher.wake()

    def _attempt_ended(self, decision: Decision, outcome) -> None:
        """The measured speed (before the release), the target's slot, outlier detection; only the slot when the
        relay raised (``outcome`` None: cancelled, the client gone)."""
        try:
            if outcome is not None:
                observe_usage(self.router, decision, outcome, self.now())
        finally:
            self.dispatcher.release(decision)
            self.fleet.finished(decision)
        if outcome is not None:
            self._outlier(decision, outcome.failure)

    async def _back_off(self, ctx: RequestContext, routed: Request, attempt: int) -> None:
        decision, outcome = ctx.decision, ctx.outcome
        self.metrics.child(self.metrics.retries, self.region).inc()
        routed.avoid = routed.avoid | {(decision.route, decision.target)}
        delay = backoff_s(self.cfg.retry_policy, attempt)
        log.warning("retrying", route=decision.route, target=decision.target, error=outcome.error,
                    attempt=attempt, backoff_ms=round(delay * 1000, 1))
        if ctx.trace is not None:
            ctx.trace.retry_started(decision, outcome, attempt=attempt, backoff_s=delay)
        await asyncio.sleep(delay)
        if ctx.trace is not None:
            ctx.trace.retry_ended()

    def _served_elsewhere(self, ctx: RequestContext, routed: Request) -> bool:
        """After a 501: record that the replica lacks the request's kind (Router.unsupported), avoid the target,
        and say whether another one could serve the request."""
        decision, now = ctx.decision, self.now()
        self.router.unsupported(decision, now, UNSUPPORTED_HOLD_S)
        log.warning("unsupported", route=decision.route, target=decision.target, kind=routed.kind,
                    error=ctx.outcome.error, hold_s=UNSUPPORTED_HOLD_S)
        routed.avoid = routed.avoid | {(decision.route, decision.target)}
        return self.router.served_elsewhere(routed, now)

    def _engine(self, decision: Decision) -> str | None:
        """The engine adapter of a local decision's replica ("vllm", "ollama", ...); None for a peer."""
        replica = self.router.replicas.get(decision.target) if decision.route == "local" else None
        return None if replica is None else replica.engine

    def _queue_retry_after(self) -> int:
        return queue_retry_after_s(self.router, self.now(), default_s=self.cfg.retry_after_s,
                                   max_s=self.cfg.queue_timeout_s)

    def _peer_gone(self, decision: Decision) -> Callable[[], str | None] | None:
        """For a forwarded request: a check that says why its peer is to be given up before the first byte (its
        status stale or failing: a partition), else None. Local replicas are not given up on a probe: a busy engine
        may answer its probe late while it works on the request."""
        if decision.route != "peer":
            return None

        return lambda: self.router.peer_gone_reason(decision.target, self.now())

    def _outlier(self, decision: Decision, failure: str | None) -> None:
        """Outlier detection: count a failure (ejecting the target after enough in a row) or an answer."""
        if failure is None or failure == "unsupported":  # a 501 is an answer: the target is up
            self.router.target_answered(decision)
        elif self.router.target_failed(decision, now=self.now(), gateway=failure == "gateway"):
            self.metrics.child(self.metrics.ejections, self.region, decision.route, decision.target).inc()
            log.warning("ejected", route=decision.route, target=decision.target, failure=failure)
