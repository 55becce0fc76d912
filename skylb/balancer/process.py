"""`skylb balancer --config FILE --region NAME`: one region's balancer process, speaking the OpenAI and Ollama APIs.

Start-up and shut-down: the aiohttp application and its routes, the command line, and serving until SIGTERM or
SIGINT. Queued and routed (skylb/balancer/pipeline.py): ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/api/generate``, ``/api/chat``, ``/api/embed``, ``/api/embeddings``. Answered without queueing
(status.py, ollama_api.py): ``GET /v1/models``, the Ollama metadata endpoints (``/api/tags``, ``/api/ps``,
``/api/show``, ``/api/version``, ``GET``/``HEAD /``), ``GET /healthz``, ``GET /metrics`` (Prometheus),
``GET /skylb/v1/status`` (msgpack for peers; JSON with ``?format=json`` for operators).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

import structlog
from aiohttp import web
from pydantic import ValidationError

from skylb import aio
from skylb.balancer import ollama_api, status
from skylb.balancer.api import error_response
from skylb.balancer.balancer import Balancer
from skylb.balancer.pipeline import GENERATE_PATHS, handle_generate
from skylb.balancer.status import BALANCER
from skylb.config import BalancerConfig, ConfigError, load_config
from skylb.core import policy_names
from skylb.logs import configure_logging

__all__ = ["build_app", "add_arguments", "main", "BALANCER", "PEER_TOKEN_ENV", "stop_time_bound_s"]

#: After the drain: aiohttp's wait for connections still open (idle keep-alive ones; the requests are done).
SHUTDOWN_TIMEOUT_S = 2.0


def stop_time_bound_s(cfg: BalancerConfig) -> float:
    """The longest a balancer takes to exit after SIGTERM, s: the drain, the bounded end of what is left
    (skylb.balancer.balancer.DRAIN_END_S), aiohttp's shutdown. A supervisor's stop timeout must be longer."""
    from skylb.balancer.balancer import DRAIN_END_S
    return cfg.drain_timeout_s + DRAIN_END_S + SHUTDOWN_TIMEOUT_S

#: Environment variable with the peer token (overrides ``balancer.peer_token``), so the secret can live outside the
#: config file: a systemd EnvironmentFile, a Kubernetes Secret. `skylb-ctl status` reads the same variable.
PEER_TOKEN_ENV = "SKYLB_PEER_TOKEN"


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
        yield
        await balancer.stop()

    app.cleanup_ctx.append(lifecycle)
    for path in GENERATE_PATHS:
        app.router.add_post(path, handle_generate)
    ollama_api.add_metadata_routes(app, BALANCER)
    app.router.add_get("/v1/models", status.handle_models)
    app.router.add_get("/healthz", status.handle_healthz)
    app.router.add_get("/metrics", status.handle_metrics)
    app.router.add_get("/skylb/v1/status", status.handle_status)
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
    parser.epilog = (f"environment: ${PEER_TOKEN_ENV}, when set and not empty, is the shared secret between "
                     "balancers (overrides balancer.peer_token in the config)")


def main(args: argparse.Namespace) -> int:
    """Run one balancer until SIGTERM or SIGINT; exit status 2 on a config error."""
    configure_logging()
    try:
        deployment = load_config(args.config)
        overrides = {k: v for k, v in {"host": args.host, "port": args.port, "controller_url": args.controller,
                                       "advertise_url": args.advertise_url, "policy": args.policy,
                                       "peer_token": os.environ.get(PEER_TOKEN_ENV) or None}.items()
                     if v is not None}
        peer_urls = {}
        for item in args.peer_url:
            region, sep, url = item.partition("=")
            if not sep or not url:
                raise ConfigError(f"--peer-url must be REGION=URL, got {item!r}")
            peer_urls[region] = url
        base = deployment.balancer_for(args.region)
        cfg = BalancerConfig.model_validate(base.model_dump() | overrides
                                            | {"peer_urls": {**base.peer_urls, **peer_urls}})
        if cfg.controller_url is None:
            c = deployment.controller
            cfg.controller_url = f"http://{c.host}:{c.port}"
    except (ConfigError, ValidationError) as exc:
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
    # shutdown_timeout: the drain below already waited for the requests held; what is left is idle connections.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
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
    # Drain (Envoy's word): /healthz answers 503 and new requests get 503 (still listening, so that load balancers
    # and the controller see it draining rather than a refused connection), what is held is served, then stop.
    balancer = app[BALANCER]
    took = await balancer.drain(cfg.drain_timeout_s)
    structlog.get_logger("skylb.balancer").info("balancer_drained", region=region, drain_s=round(took, 3),
                                                left=balancer.active_requests)
    await runner.cleanup()
    return 0
