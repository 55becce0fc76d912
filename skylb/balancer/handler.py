"""The handler of every generation and embedding endpoint: a RequestContext for the request, run through the
balancer's chain of stages (skylb/balancer/stages/).

Endpoints: OpenAI ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``; Ollama
``/api/generate``, ``/api/chat``, ``/api/embed``, ``/api/embeddings``. From SIGTERM on, new requests get 503 (drain).
``GET /v1/responses/{id}`` goes to the target that holds that response (skylb/balancer/responses.py).
"""

from __future__ import annotations

import secrets
import time

import structlog
from aiohttp import web

from skylb.balancer.api import error_response
from skylb.balancer.protocol import REQUEST_ID_HEADER, client_request_id
from skylb.balancer.stages import RequestContext
from skylb.balancer.status import BALANCER

__all__ = ["handle_generate", "ROUTES", "GENERATE_PATHS", "REQUEST_IDS", "api_of"]

#: The endpoints whose requests are queued, routed and relayed.
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                  "/api/generate", "/api/chat", "/api/embed", "/api/embeddings")

#: Request key: (the balancer's request id, the client's X-Request-Id label), for the error middleware's log line.
REQUEST_IDS = (web.RequestKey("skylb_request_ids", tuple) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
               else "skylb_request_ids")


def api_of(path: str) -> str:
    """The API dialect of a request path: "ollama" for ``/api/*``, else "openai"."""
    return "ollama" if path.startswith("/api/") else "openai"


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Run one request through the balancer's chain; 503 with Retry-After once the balancer is shutting down."""
    balancer = request.app[BALANCER]
    api = api_of(request.path)
    if balancer.shutting_down:
        response = error_response(api, 503, "balancer is shutting down; retry on another", type_="overloaded_error")
        response.headers["Connection"] = "close"
        response.headers["Retry-After"] = str(balancer.cfg.retry_after_s)  # by then DNS may name another balancer
        return response
    # The balancer's own id: the queue, the dispatcher and the replicas key requests by it, and clients may send
    # the same X-Request-Id twice. The client's id is only a label (logged, echoed back).
    request_id = secrets.token_hex(16)  # 32 hex digits like uuid4().hex, without building a UUID
    client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_IDS] = (request_id, client_id)
    ctx = RequestContext(http=request, api=api, request_id=request_id, client_id=client_id,
                         arrived_at=balancer.now(), started=time.time())
    # Every line logged for this request (retries, ejections, fallbacks, its canonical line) carries these. aiohttp
    # runs each request in a task of its own, with its own copy of the context: nothing to reset afterwards.
    structlog.contextvars.bind_contextvars(region=balancer.region, request_id=request_id)
    balancer.active_requests += 1
    try:
        return await balancer.chain.run(ctx)
    finally:
        balancer.active_requests -= 1


async def handle_retrieve_response(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{response_id}``: the stored response, from the target that holds it (or 404)."""
    return await request.app[BALANCER].retrieve_response(request)


#: The generation and embedding routes, and the Responses API's retrieve.
ROUTES = [*(web.post(path, handle_generate) for path in GENERATE_PATHS),
          web.get("/v1/responses/{response_id}", handle_retrieve_response)]
