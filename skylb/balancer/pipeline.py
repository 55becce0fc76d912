"""The request pipeline: parse, admit, acquire a routing decision, relay, retry before the first byte, and one
canonical log line per request.

Retries and outlier detection use Envoy's names (``retry_policy.num_retries``,
``outlier_detection.consecutive_gateway_failure``; shared/reference/reliability.md): a target that fails before
the first byte (refused, 502/503/504) counts a gateway failure, is ejected (unavailable until its next probe
answer) after that many in a row, and the request goes back to the head of the queue while it has retries left.
Once a byte reached the client the request is never retried (DESIGN.md decision 6).
"""

from __future__ import annotations

import time
import uuid

import structlog
from aiohttp import web

from skylb.balancer.api import BadRequest, error_response, parse_ollama, parse_openai
from skylb.balancer.balancer import Balancer
from skylb.balancer.dispatcher import QueueFull, QueueTimeout
from skylb.balancer.protocol import (FORWARDED_FROM, QUEUE_MS_HEADER, REQUEST_ID_HEADER, TOKEN_HEADER, queued_ms,
                                     token_ok)
from skylb.balancer.status import BALANCER
from skylb.core import Decision, Request

__all__ = ["handle_generate", "GENERATE_PATHS"]

#: The endpoints whose requests are queued, routed and relayed.
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                  "/api/generate", "/api/chat", "/api/embed", "/api/embeddings")

log = structlog.get_logger("skylb.request")


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Queue, route and relay one generation or embedding request (OpenAI ``/v1/*`` or Ollama ``/api/*``)."""
    balancer = request.app[BALANCER]
    cfg = balancer.cfg
    arrived_at = balancer.now()
    started = time.time()
    request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    api = "ollama" if request.path.startswith("/api/") else "openai"
    parse = parse_ollama if api == "ollama" else parse_openai
    body = await request.read()
    try:
        parsed = parse(request.path, body, session_header_value=request.headers.get(cfg.session_header))
    except BadRequest as exc:
        return _finish(balancer, error_response(api, 400, str(exc), param=exc.param), request_id, None, started)
    forwarded_from = request.headers.get(FORWARDED_FROM)
    if forwarded_from is not None and not token_ok(cfg.peer_token, request.headers.get(TOKEN_HEADER)):
        return _finish(balancer, error_response(api, 403, "forwarded request with a missing or wrong peer token",
                                                type_="permission_error"), request_id, parsed.model, started)
    router = balancer.router
    served = router.served_models(api, with_peers=forwarded_from is None)
    if parsed.model not in served and router.models_known():
        message = (f"model '{parsed.model}' not found" if api == "ollama" else
                   f"The model `{parsed.model}` does not exist.")
        hint = f" Models served here: {', '.join(sorted(served)) or 'none'}."
        return _finish(balancer, error_response(api, 404, message + hint, param="model"), request_id,
                       parsed.model, started)
    # A forwarded request keeps its place in first-come, first-served order: its wait at the forwarding balancer
    # counts here (capped by the queue timeout, so a bad value cannot put it ahead of everything for long).
    waited_s = (min(queued_ms(request.headers.get(QUEUE_MS_HEADER)) / 1000.0, cfg.queue_timeout_s)
                if forwarded_from is not None else 0.0)
    routed = Request(id=request_id, text=parsed.text, arrived_at=arrived_at, model=parsed.model,
                     session_key=parsed.session_key, forwarded_from=forwarded_from, api=api, waited_s=waited_s)
    dispatcher, relay, metrics = balancer.dispatcher, balancer.relay, balancer.metrics
    attempt = 0
    while True:
        try:
            decision = await dispatcher.acquire(routed, retry=attempt > 0)
        except QueueFull as exc:
            return _finish(balancer, error_response(api, 503, f"{exc}; retry later", type_="overloaded_error"),
                           request_id, parsed.model, started)
        except QueueTimeout as exc:
            return _finish(balancer, error_response(api, 503, str(exc), type_="overloaded_error"),
                           request_id, parsed.model, started)
        ttft_histogram = metrics.ttft.labels(balancer.region, decision.route)

        def first_byte(ttft_s: float, decision: Decision = decision) -> None:
            ttft_histogram.observe(ttft_s)
            router.first_token(decision)  # its prompt left the replica's prefill backlog
            dispatcher.wake()

        try:
            outcome = await relay.relay(request, body, decision, request_id=request_id, arrived_at=arrived_at,
                                        retry_allowed=attempt < cfg.retry_policy.num_retries, api=api,
                                        on_first_byte=first_byte)
        finally:
            dispatcher.release(decision)
        if outcome.response is None:  # failed before any byte reached the client: count it and re-queue
            attempt += 1
            metrics.retries.labels(balancer.region).inc()
            _gateway_failure(balancer, decision, outcome.error)
            log.warning("retrying", id=request_id, region=balancer.region, route=decision.route,
                        target=decision.target, error=outcome.error, attempt=attempt)
            continue
        router.target_answered(decision)
        return _finish(balancer, outcome.response, request_id, parsed.model, started, decision=decision,
                       ttft_s=outcome.ttft_s, error=outcome.error, status=outcome.status)


def _gateway_failure(balancer: Balancer, decision: Decision, error: str | None) -> None:
    """Outlier detection: count the failure and eject the target after enough in a row."""
    if balancer.router.target_failed(decision, now=balancer.now(), error=error,
                                     eject_after=balancer.cfg.outlier_detection.consecutive_gateway_failure):
        balancer.metrics.ejections.labels(balancer.region, decision.route, decision.target).inc()


def _finish(balancer: Balancer, response: web.StreamResponse, request_id: str, model: str | None, started: float,
            *, decision: Decision | None = None, ttft_s: float | None = None, error: str | None = None,
            status: int | None = None) -> web.StreamResponse:
    """Count the response and write the request's one log line; returns ``response``."""
    status = status if status is not None else response.status
    balancer.metrics.responses.labels(balancer.region, str(status)).inc()
    log.info("request", id=request_id, region=balancer.region, model=model,
             route=None if decision is None else decision.route,
             target=None if decision is None else decision.target,
             queued_ms=None if decision is None else round(decision.queued_s * 1000, 1),
             ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 1),
             e2e_ms=round((time.time() - started) * 1000, 1), status=status, error=error)
    return response
