"""The request pipeline: parse, admit, acquire a routing decision, relay, retry before the first byte, and one
canonical log line per request.

Retries and outlier detection use Envoy's names (``retry_policy``, ``outlier_detection``; shared/reference/
reliability.md): a target that fails before the first byte (refused, reset, timed out, 502/503/504) counts a
gateway failure (skylb/core/outlier.py ejects it after enough in a row), and the request, after a jittered backoff,
goes back to the head of the queue to be routed to another target, while it has retries left (``num_retries``) and
the retry budget allows (skylb/balancer/retry.py). Once a byte reached the client the request is never retried
(DESIGN.md decision 6).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from aiohttp import web

from skylb.balancer.api import BadRequest, error_response, parse_ollama, parse_openai
from skylb.balancer.balancer import Balancer
from skylb.balancer.classes import classify_request
from skylb.balancer.dispatcher import QueueFull, QueueTimeout
from skylb.balancer.ollama_fleet import pin_num_ctx, with_model
from skylb.balancer.lease_api import lease_covers
from skylb.balancer.model_groups import choose_group_model
from skylb.balancer.retry import backoff_s
from skylb.balancer.retry_after import queue_retry_after_s
from skylb.balancer.protocol import (BALANCER_REQUEST_ID_HEADER, FORWARDED_FROM, QUEUE_MS_HEADER,
                                     REQUEST_ID_HEADER, ROUTE_HEADER, TOKEN_HEADER, client_request_id, queued_ms,
                                     token_ok)
from skylb.balancer.status import BALANCER
from skylb.balancer.usage import observe as observe_usage
from skylb.core import Decision, Request
from skylb.core.fleet_rules import resolve_name
from skylb.quota.gate import QuotaExceeded
from skylb.quota.priorities import BadPriority

__all__ = ["handle_generate", "finish_request", "GENERATE_PATHS", "REQUEST_IDS", "api_of"]

#: The endpoints whose requests are queued, routed and relayed.
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                  "/api/generate", "/api/chat", "/api/embed", "/api/embeddings")

#: Request key: (the balancer's request id, the client's X-Request-Id label), for the error middleware's log line.
REQUEST_IDS = (web.RequestKey("skylb_request_ids", tuple) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
               else "skylb_request_ids")

log = structlog.get_logger("skylb.request")


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Queue, route and relay one generation or embedding request (OpenAI ``/v1/*`` or Ollama ``/api/*``); 503 once
    the balancer is shutting down."""
    balancer = request.app[BALANCER]
    if balancer.shutting_down:
        api = "ollama" if request.path.startswith("/api/") else "openai"
        response = error_response(api, 503, "balancer is shutting down; retry on another", type_="overloaded_error")
        response.headers["Connection"] = "close"
        return response
    balancer.active_requests += 1
    try:
        return await _generate(request, balancer)
    finally:
        balancer.active_requests -= 1


async def _generate(request: web.Request, balancer: Balancer) -> web.StreamResponse:
    cfg = balancer.cfg
    arrived_at = balancer.now()
    started = time.time()
    # The balancer's own id: the queue, the dispatcher and the replicas key requests by it, and clients may send
    # the same X-Request-Id twice. The client's id is only a label (logged, echoed back).
    request_id = uuid.uuid4().hex
    client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_IDS] = (request_id, client_id)
    api = api_of(request.path)
    parse = parse_ollama if api == "ollama" else parse_openai

    def reject(status: int, message: str, reason: str, *, model: str | None = None, type_: str | None = None,
               param: str | None = None, retry_after: bool | int = False) -> web.StreamResponse:
        response = error_response(api, status, message, type_=type_, param=param)
        if retry_after:  # True: the configured value; a number: seconds estimated for this answer
            response.headers["Retry-After"] = str(cfg.retry_after_s if retry_after is True else retry_after)
        balancer.metrics.rejected.labels(balancer.region, reason, str(status)).inc()
        return finish_request(balancer, response, request_id, model, started, client_id=client_id, reason=reason)

    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return reject(413, f"request body is larger than balancer.max_body_bytes ({cfg.max_body_bytes} bytes)",
                      "body_too_large")
    try:
        parsed = parse(request.path, body, session_header_value=request.headers.get(cfg.session_header))
    except BadRequest as exc:
        return reject(400, str(exc), exc.reason, param=exc.param)
    forwarded_from = request.headers.get(FORWARDED_FROM)
    if forwarded_from is not None and not token_ok(cfg.peer_token, request.headers.get(TOKEN_HEADER)):
        return reject(403, "forwarded request with a missing or wrong peer token", "forbidden",
                      model=parsed.model, type_="permission_error")
    # Priority class and tenant (skylb/balancer/classes.py); a repeated embedding is answered from the cache here,
    # before the queue (skylb/balancer/embed_cache.py).
    try:
        priority, tenant = classify_request(balancer, request, forwarded=forwarded_from is not None)
    except BadPriority as exc:
        return reject(400, str(exc), "bad_priority", model=parsed.model)
    cache = balancer.embed_cache
    cache_key = None if cache is None else cache.key(
        request.path, body, tenant=tenant,
        authorization=None if balancer.client_keys else request.headers.get("Authorization"))
    if cache_key is not None:
        hit = cache.get(cache_key)
        if hit is not None:
            hit.headers[ROUTE_HEADER] = "cache"
            return finish_request(balancer, hit, request_id, parsed.model, started, client_id=client_id,
                                  reason="embedding_cache_hit")
    router = balancer.router
    served = router.served_models(api, with_peers=forwarded_from is None)
    if not balancer.gate.is_group(parsed.model):  # "gemma3" means "gemma3:latest", as on Ollama itself
        resolved = resolve_name(parsed.model, served)
        if resolved != parsed.model:
            parsed.model, body = resolved, with_model(body, resolved)
    if api == "ollama":  # num_ctx pinning (skylb/balancer/ollama_fleet.py), so no client makes Ollama reload a model
        body = pin_num_ctx(cfg.ollama_fleet, parsed.model, body)
    if (not balancer.fleet.any_served(parsed.model, served) and not balancer.gate.is_group(parsed.model)
            and router.models_known()):
        if balancer.model_recently_served(api, parsed.model, with_peers=forwarded_from is None):
            return reject(503, f"model '{parsed.model}' is served by no replica or peer reachable now; retry later",
                          "model_unavailable", model=parsed.model, type_="service_unavailable", retry_after=True)
        message = (f"model '{parsed.model}' not found" if api == "ollama" else
                   f"The model `{parsed.model}` does not exist.")
        hint = f" Models served here: {', '.join(sorted(served)) or 'none'}."
        return reject(404, message + hint, "unknown_model", model=parsed.model, param="model")
    admitted = None  # a model group's admission: released when the request ends (skylb/balancer/model_groups.py)
    # Charged once: a group's gate charges the tenant's and the chosen model's buckets, a lease from
    # /skylb/v1/schedule was charged when granted; every other request goes through the quota gate below.
    charged = lease_covers(request, parsed.model)
    if balancer.gate.is_group(parsed.model):
        charged = True
        group = await choose_group_model(request, balancer, api, parsed.model, body, parsed.text,
                                         parsed.max_tokens)
        if group.status is not None:
            response = reject(group.status, group.message, group.reason, model=parsed.model, retry_after=True,
                              type_="rate_limit_exceeded" if group.status == 429 else "service_unavailable")
            response.headers["Retry-After"] = str(group.retry_after_s)
            return response
        admitted, body, parsed.model = group.admitted, group.body, group.model
    # A forwarded request keeps its place in first-come, first-served order: its wait at the forwarding balancer
    # counts here (capped by the queue timeout, so a bad value cannot put it ahead of everything for long).
    waited_s = (min(queued_ms(request.headers.get(QUEUE_MS_HEADER)) / 1000.0, cfg.queue_timeout_s)
                if forwarded_from is not None else 0.0)
    routed = Request(id=request_id, text=parsed.text, arrived_at=arrived_at, model=parsed.model,
                     session_key=parsed.session_key, forwarded_from=forwarded_from, api=api, waited_s=waited_s,
                     embedding=request.path in ("/v1/embeddings", "/api/embed", "/api/embeddings"),
                     priority=priority, tenant=tenant)
    try:  # quotas: wait for room in every bucket of the tenant and model (skylb/quota/gate.py), else 429
        admission = None if charged else await balancer.quota_gate.admit_request(
            tenant=tenant, model=parsed.model, text=parsed.text, max_tokens=parsed.max_tokens,
            path=request.path, arrived_at=arrived_at, forwarded=forwarded_from is not None)
    except QuotaExceeded as exc:
        return reject(429, str(exc), exc.reason, model=parsed.model, type_="rate_limit_exceeded",
                      retry_after=exc.retry_after_s)
    answered = False  # a replica or peer answered: the admission's tokens were used
    dispatcher, relay, metrics = balancer.dispatcher, balancer.relay, balancer.metrics
    budget, policy = balancer.retry_budget, cfg.retry_policy
    attempt = 0
    retrying = False  # holds a place in the retry budget
    try:
        while True:
            try:
                decision, body = await balancer.fleet.acquire(routed, body, retry=attempt > 0)
            except QueueFull as exc:
                return reject(503, f"{exc}; retry later", "queue_full", model=parsed.model,
                              type_="overloaded_error", retry_after=_queue_retry_after(balancer))
            except QueueTimeout as exc:
                return reject(503, str(exc), "queue_timeout", model=parsed.model, type_="overloaded_error",
                              retry_after=_queue_retry_after(balancer))
            ttft_histogram = metrics.ttft.labels(balancer.region, decision.route)

            def first_byte(ttft_s: float, decision: Decision = decision) -> None:
                ttft_histogram.observe(ttft_s)
                router.first_token(decision)  # its prompt left the replica's prefill backlog
                balancer.fleet.first_byte(decision, ttft_s)
                dispatcher.wake()

            try:
                outcome = await relay.relay(request, body, decision, request_id=request_id, arrived_at=arrived_at,
                                            retry_allowed=attempt < policy.num_retries, api=api,
                                            stream=parsed.stream, on_first_byte=first_byte,
                                            client_request_id=client_id, abandon=_peer_gone(balancer, decision),
                                            check_s=cfg.probe_interval_ms / 1000)
                observe_usage(router, decision, outcome, balancer.now())  # measured speed, before release
            finally:
                dispatcher.release(decision)
                balancer.fleet.finished(decision)
            _outlier(balancer, decision, outcome.failure)
            answered = answered or outcome.response is not None
            if retrying:
                budget.release()
                retrying = False
            if cache_key is not None and outcome.status == 200 and outcome.error is None \
                    and isinstance(outcome.response, web.Response) and not parsed.stream:
                cache.put(cache_key, outcome.response.body, outcome.response.content_type)
            if outcome.response is None:  # failed before any byte reached the client
                if not budget.try_acquire(balancer.in_flight()):
                    metrics.retry_budget_exhausted.labels(balancer.region).inc()
                    error = f"{outcome.error}; not retried: retry budget exhausted"
                    return finish_request(balancer, error_response(api, outcome.status, error), request_id,
                                          parsed.model, started, decision=decision, error=error,
                                          status=outcome.status, client_id=client_id)
                retrying = True
                attempt += 1
                metrics.retries.labels(balancer.region).inc()
                routed.avoid = routed.avoid | {(decision.route, decision.target)}
                delay = backoff_s(policy, attempt)
                log.warning("retrying", id=request_id, region=balancer.region, route=decision.route,
                            target=decision.target, error=outcome.error, attempt=attempt,
                            backoff_ms=round(delay * 1000, 1))
                await asyncio.sleep(delay)
                continue
            return finish_request(balancer, outcome.response, request_id, parsed.model, started,
                                  decision=decision, ttft_s=outcome.ttft_s, error=outcome.error,
                                  status=outcome.status, client_id=client_id)
    finally:
        if retrying:
            budget.release()
        # Never leak a quota slot (answered, failed, cancelled, client gone); unused tokens go back.
        balancer.quota_gate.release(admission, refund_tokens=0 if answered or admission is None else admission.tokens)
        if admitted is not None:
            await balancer.gate.release(admitted)


def _queue_retry_after(balancer: Balancer) -> int:
    return queue_retry_after_s(balancer.router, balancer.now(), default_s=balancer.cfg.retry_after_s,
                               max_s=balancer.cfg.queue_timeout_s)


def _peer_gone(balancer: Balancer, decision: Decision):
    """For a forwarded request: a check that says why its peer is to be given up before the first byte (its status
    stale or failing: a partition), else None. Local replicas are not given up on a probe: a busy engine may answer
    its probe late while it works on the request."""
    if decision.route != "peer":
        return None
    router = balancer.router

    def gone() -> str | None:
        peer = router.peers.get(decision.target)
        if peer is None:
            return "left membership"
        return router.rules.peer_unreachable_reason(peer, balancer.now())
    return gone


def _outlier(balancer: Balancer, decision: Decision, failure: str | None) -> None:
    """Outlier detection: count a failure (ejecting the target after enough in a row) or an answer."""
    router = balancer.router
    if failure is None:
        router.target_answered(decision)
    elif router.target_failed(decision, now=balancer.now(), gateway=failure == "gateway"):
        balancer.metrics.ejections.labels(balancer.region, decision.route, decision.target).inc()
        log.warning("ejected", region=balancer.region, route=decision.route, target=decision.target,
                    failure=failure)


def api_of(path: str) -> str:
    """The API dialect of a request path: "ollama" for ``/api/*``, else "openai"."""
    return "ollama" if path.startswith("/api/") else "openai"


def finish_request(balancer: Balancer, response: web.StreamResponse, request_id: str, model: str | None,
                   started: float, *, decision: Decision | None = None, ttft_s: float | None = None,
                   error: str | None = None, status: int | None = None, client_id: str | None = None,
                   reason: str | None = None) -> web.StreamResponse:
    """Count the response and write the request's one log line; returns ``response``.

    ``client_id``: the client's X-Request-Id label; ``reason``: why the balancer rejected the request itself.
    A response not yet sent gets the ids as headers (X-SkyLB-Request-Id, X-Request-Id echoed)."""
    status = status if status is not None else response.status
    if not response.prepared:
        response.headers[BALANCER_REQUEST_ID_HEADER] = request_id
        if client_id is not None:
            response.headers[REQUEST_ID_HEADER] = client_id
    balancer.metrics.responses.labels(balancer.region, str(status)).inc()
    log.info("request", id=request_id, client_request_id=client_id, reason=reason, region=balancer.region,
             model=model,
             priority=None if decision is None else decision.request.priority,
             tenant=None if decision is None else decision.request.tenant,
             route=None if decision is None else decision.route,
             target=None if decision is None else decision.target,
             queued_ms=None if decision is None else round(decision.queued_s * 1000, 1),
             ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 1),
             e2e_ms=round((time.time() - started) * 1000, 1), status=status, error=error)
    return response
