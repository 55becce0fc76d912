"""The end of every request: its response counted and its one canonical log line written.

One structured line per request (structlog's "canonical log lines"): the ids, model, class and tenant, where it
went, how long it queued, TTFT and end-to-end time (ms), status and error. A successful answer also feeds the
end-to-end and inter-token latency histograms and the token counters (BalancerMetrics.observe_answer).
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web

from skylb.balancer.metrics import BalancerMetrics, model_label
from skylb.balancer.protocol import BALANCER_REQUEST_ID_HEADER, REQUEST_ID_HEADER, answer_complete

__all__ = ["RequestLog"]

log = structlog.get_logger("skylb.request")

#: The status logged for a request whose client went away before its answer ended (nginx's 499).
CLIENT_CLOSED = 499


class RequestLog:
    """Counts responses (``skylb_responses_total``, ``skylb_rejected_requests_total``, the latency histograms and
    token counters of answers) and logs each request once."""

    def __init__(self, metrics: BalancerMetrics, *, region: str):
        self.metrics = metrics
        self.region = region

    def cancelled(self, ctx) -> None:
        """Count and log ``ctx``, whose handler was cancelled (its client went away), as status 499 ("client closed
        request", nginx's), error "client disconnected", reason ``client_disconnected``; but a client that closed
        after its stream's last event (``protocol.answer_complete``) got its answer: logged with the stream's status.
        """
        complete = answer_complete(ctx.http)
        if complete is not None:
            ctx.status = ctx.status if ctx.status is not None else complete
            self.finish(ctx, None)
            return
        ctx.status, ctx.reason = CLIENT_CLOSED, ctx.reason or "client_disconnected"
        ctx.error = ctx.error or "client disconnected"
        self.finish(ctx, None)

    def finish(self, ctx, response: web.StreamResponse | None) -> web.StreamResponse | None:
        """Count ``response`` (a rejection too when ``ctx.rejected``) and write ``ctx``'s log line; a response not
        yet sent gets the ids as headers (X-SkyLB-Request-Id, the client's X-Request-Id echoed). Returns it.

        The figures are taken now; counting and writing happen in the event loop's next turn, once aiohttp has
        written the response: the line (structlog, JSON, a write) costs about 0.1 ms of CPU that the client need
        not wait for (bench/results/overhead.md part (a)). The next turn comes before the loop reads anything
        more, so a later request, a scrape of /metrics included, sees the response counted."""
        status = ctx.status if ctx.status is not None else response.status
        if response is not None and not response.prepared:
            response.headers[BALANCER_REQUEST_ID_HEADER] = ctx.request_id
            if ctx.client_id is not None:
                response.headers[REQUEST_ID_HEADER] = ctx.client_id
        decision = ctx.decision
        line = dict(id=ctx.request_id, client_request_id=ctx.client_id, reason=ctx.reason,
                    region=self.region, model=ctx.model,
                    priority=ctx.priority, tenant=ctx.tenant,
                    route=None if decision is None else decision.route,
                    target=None if decision is None else decision.target,
                    rule=None if decision is None else decision.rule,
                    queued_ms=None if decision is None else round(decision.queued_s * 1000, 1),
                    ttft_ms=None if ctx.ttft_s is None else round(ctx.ttft_s * 1000, 1),
                    e2e_ms=round((e2e_s := time.time() - ctx.started) * 1000, 1), status=status, error=ctx.error)
        record = (str(status), ctx.rejected, ctx.reason, line, self._answer(ctx, status, e2e_s))
        try:
            # call_soon runs it in this request's context: the line carries the request id and tenant bound to it.
            asyncio.get_running_loop().call_soon(self._record, *record)
        except RuntimeError:  # no loop running (a direct call): now
            self._record(*record)
        return response

    def _answer(self, ctx, status: int, e2e_s: float) -> tuple | None:
        """What ``observe_answer`` counts of a successful answer (a target answered, status < 400, no error), or
        None. Labels are taken now, while the target's model list is the one that served it."""
        decision, outcome = ctx.decision, ctx.outcome
        if decision is None or outcome is None or outcome.response is None or status >= 400 or ctx.error:
            return None
        metrics = self.metrics
        model = getattr(decision.request, "model", None) or ctx.model  # after a fallback, the fallback's
        labels = (self.region, decision.route, model_label(metrics.router, decision, model, ctx.api),
                  metrics.tenant_label(ctx.tenant))
        stream = ctx.parsed is not None and ctx.parsed.stream
        return labels, dict(e2e_s=e2e_s, ttft_s=ctx.ttft_s if stream else None, usage=outcome.usage,
                            count_tokens=not ctx.forwarded)

    def _record(self, status: str, rejected: bool, reason: str | None, line: dict, answer: tuple | None) -> None:
        metrics = self.metrics
        if rejected:
            metrics.child(metrics.rejected, self.region, str(reason), status).inc()
        metrics.child(metrics.responses, self.region, status).inc()
        if answer is not None:
            metrics.observe_answer(*answer[0], **answer[1])
        log.info("request", **line)
