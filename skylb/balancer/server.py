"""`skylb balancer --config FILE --region NAME`: one region's balancer, speaking the OpenAI and Ollama APIs.

Queued and routed: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/api/generate``,
``/api/chat``, ``/api/embed``, ``/api/embeddings``. Answered without queueing: ``GET /v1/models``, the Ollama
metadata endpoints (``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version``, ``GET``/``HEAD /``),
``GET /healthz``, ``GET /metrics`` (Prometheus), ``GET /skylb/v1/status`` (msgpack for peers; JSON with
``?format=json`` for operators).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time
import uuid

import structlog
from aiohttp import web

from skylb import aio
from skylb.balancer import ollama_api
from skylb.balancer.api import BadRequest, error_response, openai_error, parse_ollama, parse_openai
from skylb.balancer.balancer import Balancer, QueueFull, QueueTimeout
from skylb.balancer.metrics import CONTENT_TYPE
from skylb.balancer.protocol import (FORWARDED_FROM, REQUEST_ID_HEADER, TOKEN_HEADER, encode_status, token_ok)
from skylb.balancer.proxy import Relay
from skylb.config import BalancerConfig, ConfigError, load_config
from skylb.core import Request, policy_names

__all__ = ["build_app", "add_arguments", "main", "BALANCER", "configure_logging"]

BALANCER = web.AppKey("balancer", Balancer)
RELAY = web.AppKey("relay", Relay)
#: How many times a request is re-queued when its target fails before the first byte.
MAX_RETRIES = 2

log = structlog.get_logger("skylb.request")


def configure_logging() -> None:
    """One JSON object per line on stderr (structlog), timestamps in ISO 8601."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Queue, route and relay one generation or embedding request (OpenAI ``/v1/*`` or Ollama ``/api/*``)."""
    balancer, relay = request.app[BALANCER], request.app[RELAY]
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
    routed = Request(id=request_id, text=parsed.text, arrived_at=arrived_at, model=parsed.model,
                     session_key=parsed.session_key, forwarded_from=forwarded_from, api=api)
    attempt = 0
    while True:
        try:
            decision = await balancer.acquire(routed, retry=attempt > 0)
        except QueueFull as exc:
            return _finish(balancer, error_response(api, 503, f"{exc}; retry later", type_="overloaded_error"),
                           request_id, parsed.model, started)
        except QueueTimeout as exc:
            return _finish(balancer, error_response(api, 503, str(exc), type_="overloaded_error"),
                           request_id, parsed.model, started)
        route = "local" if decision.kind == "replica" else "peer"
        ttft_histogram = balancer.metrics.ttft.labels(balancer.region, route)
        try:
            outcome = await relay.relay(request, body, decision, request_id=request_id, arrived_at=arrived_at,
                                        retry_allowed=attempt < MAX_RETRIES, api=api,
                                        on_first_byte=ttft_histogram.observe)
        finally:
            balancer.release(decision)
        if outcome.response is None:  # failed before any byte reached the client: mark and re-queue
            attempt += 1
            balancer.metrics.retries.labels(balancer.region).inc()
            if decision.kind == "replica":
                balancer.router.observe_replica(decision.target, now=balancer.now(), healthy=False,
                                                error=outcome.error)
            else:
                balancer.router.observe_peer(decision.target, now=balancer.now(), status=None, error=outcome.error)
            log.warning("retrying", id=request_id, region=balancer.region, target=decision.target,
                        error=outcome.error, attempt=attempt)
            continue
        return _finish(balancer, outcome.response, request_id, parsed.model, started, decision=decision,
                       ttft_s=outcome.ttft_s, error=outcome.error, status=outcome.status)


def _finish(balancer: Balancer, response: web.StreamResponse, request_id: str, model: str | None, started: float,
            *, decision=None, ttft_s=None, error=None, status=None) -> web.StreamResponse:
    status = status if status is not None else response.status
    balancer.metrics.responses.labels(balancer.region, str(status)).inc()
    if decision is None:
        where = None
    elif decision.kind == "replica":
        where = f"replica:{decision.target}"
    else:
        where = f"peer:{decision.target}"
    log.info("request", id=request_id, region=balancer.region, model=model, decision=where,
             queued_ms=None if decision is None else round(decision.queued_s * 1000, 1),
             ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 1),
             e2e_ms=round((time.time() - started) * 1000, 1), status=status, error=error)
    return response


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the union of models the local replicas serve, in OpenAI's list shape."""
    balancer = request.app[BALANCER]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "skylb"} for m in balancer.served_models()]
    return web.json_response({"object": "list", "data": data})


async def handle_healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: 200 while the process serves (replica health is in /skylb/v1/status and /metrics)."""
    balancer = request.app[BALANCER]
    return web.json_response({"status": "ok", "region": balancer.region})


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text."""
    return web.Response(body=request.app[BALANCER].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def handle_status(request: web.Request) -> web.Response:
    """``GET /skylb/v1/status``: msgpack for peers (token checked); ``?format=json`` gives operators detail."""
    balancer = request.app[BALANCER]
    if request.query.get("format") == "json":
        return web.json_response(balancer.detailed_status())
    if not token_ok(balancer.cfg.peer_token, request.headers.get(TOKEN_HEADER)):
        return openai_error(403, "missing or wrong peer token", type_="permission_error")
    status = balancer.router.status(balancer.now())
    return web.Response(body=encode_status(status), content_type="application/msgpack")


@web.middleware
async def _errors_in_api_shape(request: web.Request, handler):
    """Turn aiohttp's HTTP errors (404, 405, 413) into JSON in the API's shape, never HTML."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        api = "ollama" if request.path.startswith("/api/") else "openai"
        return error_response(api, exc.status, f"{exc.reason}: {request.method} {request.path}")


def build_app(cfg: BalancerConfig, *, region: str, advertise_url: str) -> web.Application:
    """The balancer's aiohttp application; the Balancer starts and stops with it."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_errors_in_api_shape])
    balancer = Balancer(cfg, region=region, advertise_url=advertise_url)
    app[BALANCER] = balancer

    async def lifecycle(app: web.Application):
        await balancer.start()
        app[RELAY] = Relay(balancer.session, region=region, peer_token=cfg.peer_token,
                           session_header=cfg.session_header)
        yield
        await balancer.stop()

    app.cleanup_ctx.append(lifecycle)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                 "/api/generate", "/api/chat", "/api/embed", "/api/embeddings"):
        app.router.add_post(path, handle_generate)
    ollama_api.add_metadata_routes(app, BALANCER)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/skylb/v1/status", handle_status)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `skylb balancer`."""
    parser.add_argument("--config", help="deployment YAML (default: the embedded configs/local-3region.yaml)")
    parser.add_argument("--region", required=True, help="this balancer's region, a key of `regions` in the config")
    parser.add_argument("--host", help="listen address (overrides the config)")
    parser.add_argument("--port", type=int, help="listen port (overrides the config)")
    parser.add_argument("--controller", help="controller base URL (overrides balancer.controller_url)")
    parser.add_argument("--advertise-url", help="URL peers and the controller use to reach this balancer")
    parser.add_argument("--policy", choices=policy_names(), metavar="NAME",
                        help="routing policy (overrides the config): " + ", ".join(policy_names()))
    parser.add_argument("--peer-url", action="append", default=[], metavar="REGION=URL",
                        help="reach peer REGION at URL (e.g. through a latency proxy); repeatable")


def main(args: argparse.Namespace) -> int:
    """Run one balancer until SIGTERM or SIGINT; exit status 2 on a config error."""
    configure_logging()
    try:
        deployment = load_config(args.config)
        overrides = {k: v for k, v in {"host": args.host, "port": args.port, "controller_url": args.controller,
                                       "advertise_url": args.advertise_url, "policy": args.policy}.items()
                     if v is not None}
        peer_urls = {}
        for item in args.peer_url:
            region, sep, url = item.partition("=")
            if not sep or not url:
                raise ConfigError(f"--peer-url must be REGION=URL, got {item!r}")
            peer_urls[region] = url
        cfg = deployment.balancer_for(args.region).model_copy(update=overrides)
        cfg.peer_urls = {**cfg.peer_urls, **peer_urls}
        if cfg.controller_url is None:
            c = deployment.controller
            cfg.controller_url = f"http://{c.host}:{c.port}"
    except ConfigError as exc:
        print(f"skylb balancer: {exc}", file=sys.stderr)
        return 2
    if cfg.port == 0:  # the advertised URL needs the real port before the server starts
        with socket.socket() as s:
            s.bind((cfg.host, 0))
            cfg.port = s.getsockname()[1]
    advertise_url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"
    return aio.run(_serve(cfg, region=args.region, advertise_url=advertise_url))


async def _serve(cfg: BalancerConfig, *, region: str, advertise_url: str) -> int:
    app = build_app(cfg, region=region, advertise_url=advertise_url)
    # handler_cancellation: a client that disconnects cancels its handler, so a queued request leaves the queue
    # and an upstream request is aborted (aiohttp's default keeps running it; reliability.md).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    structlog.get_logger("skylb.balancer").info("balancer_started", region=region, listen=f"{cfg.host}:{cfg.port}",
                                                policy=cfg.policy, controller=cfg.controller_url,
                                                event_loop=aio.loop_name())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0
