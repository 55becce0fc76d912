"""`skylb balancer --config FILE --region NAME`, or `skylb balancer --replica URL ...` (static mode, no controller):
one region's balancer process, speaking the OpenAI and Ollama APIs.

Start-up and shut-down: the aiohttp application and its routes, the command line, and serving until SIGTERM or SIGINT;
SIGHUP (or a change of the config or keys file) reloads what can change at run time (skylb/balancer/reload.py).
Through the chain of stages (skylb/balancer/handler.py, skylb/balancer/stages/): ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``, ``/api/generate``, ``/api/chat``, ``/api/embed``,
``/api/embeddings``. Answered without queueing (status.py, ollama_api.py, model_management.py, lease_api.py,
responses.py): ``GET /v1/models``, ``GET /v1/responses/{id}`` (from the replica holding it), the Ollama metadata
endpoints (``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version``, ``GET``/``HEAD /``), ``GET /healthz``,
``GET /readyz``, ``GET /metrics`` (Prometheus), ``GET /skylb/v1/status`` (msgpack for peers; JSON with
``?format=json`` for operators). Who may call which route (client API keys, the peer token, the metrics token) is
checked before any handler, in skylb/balancer/auth.py; with ``tls_cert_file`` and ``tls_key_file`` the listener
speaks HTTPS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import ssl
import sys
import time
import uuid

import structlog
from aiohttp import web
from pydantic import ValidationError

from skylb import aio, gc_pauses, status_page
from skylb.balancer import handler, lease_api, model_management, ollama_api, status, tracing
from skylb.balancer.auth import Credentials, auth_middleware
from skylb.balancer.balancer import Balancer
from skylb.balancer.handler import REQUEST_IDS, api_of
from skylb.listener import ClientBodyTimeout, GuardedAppRunner, unreadable_body
from skylb.balancer.stages import RequestContext
from skylb.balancer.stages.model_group import add_model_header
from skylb.balancer.relay import STREAM_STARTED
from skylb.balancer.retry_after import retry_after_hook
from skylb.balancer.status import BALANCER
from skylb.balancer.reload import Reload, Settings, resolve
from skylb.balancer.static import ENGINES, STATIC_REGION
from skylb.config import BalancerConfig, ConfigError
from skylb.core import policy_names
from skylb import environment, logs
from skylb.logs import configure_logging
from skylb.tokens import GuessThrottle
from skylb.reload import Reloader

__all__ = ["build_app", "add_arguments", "main", "BALANCER", "PEER_TOKEN_ENV", "REPLICA_API_KEY_ENV",
           "stop_time_bound_s"]

#: After the drain: aiohttp's wait for connections still open (idle keep-alive ones; the requests are done).
SHUTDOWN_TIMEOUT_S = 2.0


def stop_time_bound_s(cfg: BalancerConfig) -> float:
    """The longest a balancer takes to exit after SIGTERM, s: the drain, the bounded end of what is left
    (skylb.balancer.balancer.DRAIN_END_S), aiohttp's shutdown, the last spans' export (skylb.balancer.tracing.FLUSH_S,
    counted whether or not tracing is on: the environment may turn it on). A supervisor's stop timeout must be
    longer."""
    from skylb.balancer.balancer import DRAIN_END_S
    from skylb.balancer.tracing import FLUSH_S
    return cfg.drain_timeout_s + DRAIN_END_S + SHUTDOWN_TIMEOUT_S + FLUSH_S

#: Environment variable with the peer token (overrides ``balancer.peer_token``), so the secret can live outside the
#: config file: a systemd EnvironmentFile, a Kubernetes Secret. `skylb-ctl status` reads the same variable.
PEER_TOKEN_ENV = environment.PEER_TOKEN.name
#: Environment variable with the key sent to local replicas (overrides ``balancer.replica_api_key``).
REPLICA_API_KEY_ENV = environment.REPLICA_API_KEY.name

log = structlog.get_logger("skylb.balancer")


@web.middleware
async def _errors_in_api_shape(request: web.Request, handler):
    """Every error the balancer answers itself is JSON in the API's shape, logged and counted, never HTML or
    ``500 text/plain``: aiohttp's HTTP errors (404, 405, 413), a body the client sent too slowly (408), a body
    that cannot be read (400: gzip or deflate that does not decompress, a chunked body cut short) and, as a last
    resort, any bug (500)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = {404: "no_route", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        return _answered_error(request, exc.status, f"{exc.reason}: {request.method} {request.path}", reason)
    except ClientBodyTimeout as exc:  # a handler other than the chain's was reading a body too slow to wait for
        return _answered_error(request, 408, str(exc), "body_timeout")
    except web.RequestPayloadError as exc:  # a body that does not decode (Content-Encoding) or ends early
        return _answered_error(request, 400, f"the request body could not be read: {unreadable_body(exc)}",
                               "unreadable_body")
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: there is nobody to answer
    except Exception as exc:
        if request.get(STREAM_STARTED):  # headers already sent: only closing the connection tells the client
            raise
        structlog.get_logger("skylb.balancer").exception("unhandled_error", method=request.method,
                                                         path=request.path)
        return _answered_error(request, 500, f"internal error in the balancer: {type(exc).__name__}",
                               "internal_error")


def _answered_error(request: web.Request, status: int, message: str, reason: str) -> web.Response:
    balancer = request.app[BALANCER]
    request_id, client_id = request.get(REQUEST_IDS) or (uuid.uuid4().hex, None)
    ctx = RequestContext(http=request, api=api_of(request.path), request_id=request_id, client_id=client_id,
                         arrived_at=balancer.now(), started=time.time())
    response = ctx.reject(status, message, reason)
    ctx.error = message
    return balancer.request_log.finish(ctx, response)


def build_app(cfg: BalancerConfig, *, region: str, advertise_url: str,
              api_keys: frozenset[str] = frozenset(), tenants: dict[str, str] | None = None,
              static_membership: dict | None = None) -> web.Application:
    """The balancer's aiohttp application; the Balancer starts and stops with it. ``api_keys``: the client keys
    (auth.load_api_keys), checked with the peer and metrics tokens of ``cfg`` before any handler runs; ``tenants``:
    {key: tenant} (auth.load_tenants); ``static_membership``: replicas and peers from the command line
    (skylb/balancer/static.py), None for the controller's. ``app[CREDENTIALS].set(...)`` replaces the credentials
    while it serves (a reload)."""
    creds = _CredentialsInForce(Credentials(api_keys=api_keys, peer_token=cfg.peer_token,
                                            metrics_token=cfg.metrics_token, tenants=dict(tenants or {})))
    # Errors first, so a 404 or 405 for an unknown route is also behind the credential check.
    guesses = GuessThrottle()  # wrong credentials per address: the middleware's checks and the page's login
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[_errors_in_api_shape, auth_middleware(creds.get, throttle=guesses)])
    app[CREDENTIALS] = creds
    balancer = Balancer(cfg, region=region, advertise_url=advertise_url, client_keys=bool(api_keys),
                        static_membership=static_membership)
    balancer.key_tenants = frozenset(creds.get().tenants.values())
    app[BALANCER] = balancer
    app[status_page.ACCESS] = status_page.PageAccess(cfg.peer_token, "the peer token", f"region {region}",
                                                     status_page.PEER_SESSION, throttle=guesses)

    async def lifecycle(app: web.Application):
        await balancer.start()
        yield
        await balancer.stop()

    app.cleanup_ctx.append(lifecycle)
    # Every 503 and 429 carries a jittered Retry-After, also a replica's own passed on without one.
    app.on_response_prepare.append(retry_after_hook(cfg.retry_after_s))
    # One way to register routes: each handler module's route table.
    app.add_routes(handler.ROUTES)  # /v1/chat/completions, /api/generate, ...: the chain
    app.add_routes(status.ROUTES)  # /v1/models, /healthz, /metrics, /skylb/v1/status
    app.add_routes(ollama_api.ROUTES)  # /, /api/version, /api/tags, /api/ps, /api/show
    app.add_routes(status_page.ROUTES)  # /skylb/login, /skylb/logout, /skylb/static/*: the status page at /
    app.add_routes(model_management.ROUTES)  # /api/pull, /api/delete, /api/copy, /api/create
    if cfg.quota.enabled:
        app.add_routes(lease_api.ROUTES)  # /skylb/v1/schedule, heartbeat, complete, advice
        leases = lease_api.LeaseApi(
            gate=balancer.gate, leases=balancer.leases, served_models=lambda: balancer.router.served_models("openai"),
            models_known=balancer.router.models_known, quotas=lambda: balancer.quotas,
            recently_served=lambda model: balancer.model_recently_served("openai", model), limits=balancer.limits,
            now=balancer.now, region=balancer.region, retry_after_s=cfg.retry_after_s)
        lease_api.start_reclaimer(app, leases, registry=balancer.metrics.registry)
        app.on_response_prepare.append(add_model_header)  # X-SkyLB-Model on a model group's answers
    return app


class _CredentialsInForce:
    """The credentials the auth middleware checks now; ``set`` replaces them (a reload)."""

    def __init__(self, creds: Credentials):
        self.creds = creds

    def get(self) -> Credentials:
        return self.creds

    def set(self, creds: Credentials) -> None:
        self.creds = creds


#: App key: the credentials in force (``_CredentialsInForce``).
CREDENTIALS = web.AppKey("skylb_credentials", _CredentialsInForce)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `skylb balancer`."""
    parser.add_argument("--config", help="deployment YAML: its balancer section and regions.<region>.balancer "
                        "(default: none, the built-in defaults, with the controller at --controller or "
                        "http://127.0.0.1:8470)")
    parser.add_argument("--region", help="this balancer's region, a key of `regions` in the config (required with "
                        f"a controller; with --replica default {STATIC_REGION!r})")
    static = parser.add_argument_group(
        "static mode", "serve in front of replicas that already run, with no controller and no YAML: "
        "skylb balancer --replica http://127.0.0.1:11434")
    static.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL (an engine's OpenAI or Ollama server); repeatable. A vLLM "
                             "replica that publishes KV-cache events (vLLM --kv-events-config) takes its endpoints "
                             "after '#': URL#kv=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,block_size=N], and the "
                             "balancer then routes by its exact cache state. URL#max_concurrency=N states the "
                             "requests the engine runs at once (vLLM --max-num-seqs): the balancer sends no more at "
                             "once and starts there instead of learning the batch from a small start")
    static.add_argument("--engine", default="auto", choices=ENGINES, metavar="ENGINE",
                        help=f"the replicas' engine: {', '.join(ENGINES)} (default: auto, detected by probing "
                             "each replica once)")
    static.add_argument("--peer", action="append", default=[], metavar="REGION=URL",
                        help="a peer region's balancer to forward overflow to; repeatable; needs a peer token "
                             f"(${PEER_TOKEN_ENV}), the same on both balancers")
    parser.add_argument("--host", help="listen address (overrides the config)")
    parser.add_argument("--port", type=int, help="listen port (overrides the config)")
    parser.add_argument("--controller", help="controller base URL (overrides balancer.controller_url)")
    parser.add_argument("--advertise-url", help="URL peers and the controller use to reach this balancer")
    parser.add_argument("--balancer-id", metavar="ID", help="this balancer's name among its region's balancers "
                        "(default: the advertised host:port); a region runs several, each with its own id")
    parser.add_argument("--policy", choices=policy_names(), metavar="NAME",
                        help="routing policy (overrides the config): " + ", ".join(policy_names()))
    parser.add_argument("--peer-url", action="append", default=[], metavar="REGION=URL",
                        help="reach peer REGION at URL (e.g. through a latency proxy); repeatable")
    logs.add_arguments(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog is a list, one variable a line
    parser.epilog = (environment.epilog(environment.BALANCER_VARIABLES)
                     + "\nprecedence: the config file's balancer section, its regions.<region>.balancer, the "
                       "environment, the flags"
                     + "\nreload: SIGHUP (or a change of the config or keys file) re-reads client keys, tenants, "
                       "metrics_token and quotas; other settings need a restart (logged as reload_needs_restart)")


def main(args: argparse.Namespace) -> int:
    """Run one balancer until SIGTERM or SIGINT (SIGHUP reloads); exit status 2 on a config error, 1 when it
    cannot listen (the port taken, the host not this machine's)."""
    try:
        configure_logging(level=args.log_level)
        settings = resolve(args)
        tracing.check_installed(settings.cfg.tracing)
    except (ConfigError, ValidationError, ValueError, RuntimeError) as exc:
        print(f"skylb balancer: {exc}", file=sys.stderr)
        return 2
    cfg = settings.cfg.model_copy()  # the running copy gets the real port; a reload compares with the file's
    if cfg.port == 0:  # the advertised URL needs the real port before the server starts
        try:
            with socket.socket() as s:
                s.bind((cfg.host, 0))
                cfg.port = s.getsockname()[1]
        except OSError as exc:  # a host name that does not resolve, an address not this machine's
            print(f"skylb balancer: cannot listen on {cfg.host}: {_why(exc)}", file=sys.stderr)
            return 1
    scheme = "https" if cfg.tls_cert_file else "http"
    advertise_url = cfg.advertise_url or f"{scheme}://{cfg.host}:{cfg.port}"
    try:
        ssl_context = _ssl_context(cfg)
    except (OSError, ssl.SSLError) as exc:
        print(f"skylb balancer: cannot load tls_cert_file / tls_key_file: {exc}", file=sys.stderr)
        return 2
    return aio.run(_serve(cfg, region=settings.region, advertise_url=advertise_url, settings=settings, args=args,
                          ssl_context=ssl_context))


def _why(exc: OSError) -> str:
    """The reason of a failed bind in a few words ("Address already in use"), without the event loop's wrapping."""
    if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:
        return exc.strerror or str(exc)
    return os.strerror(exc.errno)


def _ssl_context(cfg: BalancerConfig) -> ssl.SSLContext | None:
    """The public listener's TLS context from ``tls_cert_file`` and ``tls_key_file`` (PEM), or None without them.
    Raises OSError or ssl.SSLError when they cannot be read or do not match."""
    if not cfg.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2+, Python's vetted cipher choice
    context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    return context


def _warn_open(cfg: BalancerConfig, api_keys: frozenset[str]) -> None:
    """Say loudly which checks are off because their secret is not configured (README, "Security")."""
    if not cfg.peer_token:
        log.warning("peer_endpoints_open",
                    detail=f"no peer token (${PEER_TOKEN_ENV}): /skylb/v1/status and /metrics are answered from this "
                           "machine only, forwarded requests are refused, and this balancer has no peers; set one "
                           "to add peers")
    if not api_keys:
        log.warning("client_api_open", detail="no client API keys: anyone can send requests")


async def _serve(cfg: BalancerConfig, *, region: str, advertise_url: str, settings: Settings,
                 args: argparse.Namespace, ssl_context: ssl.SSLContext | None = None) -> int:
    # One region per process: every line this process logs from here on names it (skylb/logs.py).
    structlog.contextvars.bind_contextvars(region=region)
    api_keys = settings.api_keys
    app = build_app(cfg, region=region, advertise_url=advertise_url, api_keys=api_keys, tenants=settings.tenants,
                    static_membership=settings.static_membership)
    # handler_cancellation: a client that disconnects cancels its handler, so a queued request leaves the queue
    # and an upstream request is aborted (aiohttp's default keeps running it; reliability.md).
    # shutdown_timeout: the drain below already waited for the requests held; what is left is idle connections.
    # GuardedAppRunner: deadlines on reading requests, idle keep-alive and a connection cap (skylb/listener.py).
    runner = GuardedAppRunner(app, limits=cfg.client_connections, setting="balancer.client_connections",
                              handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    # Built: what exists now lives as long as the process, and full collections skip it from here on. Before the
    # probers start (runner.setup) and the listener opens: the collection before the freeze stops the loop for
    # about 0.1 s, which a peer's status probes, ours or its, would measure as round-trip time (it lengthens how
    # long a partitioned peer takes to go stale: 2 x its RTT).
    gc_pauses.watch()
    frozen = gc_pauses.freeze_startup_heap()
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:  # the port is taken, the address is not this machine's or does not resolve
        await runner.cleanup()
        print(f"skylb balancer: cannot listen on {cfg.host}:{cfg.port}: {_why(exc)}", file=sys.stderr)
        return 1
    static = settings.static_membership
    log.info("balancer_started", listen=f"{cfg.host}:{cfg.port}", tls=ssl_context is not None,
             policy=cfg.policy, controller=cfg.controller_url, client_api_keys=len(api_keys),
             peer_token=bool(cfg.peer_token), event_loop=aio.loop_name(), gc_frozen_objects=frozen,
             **({"static_replicas": len(static["replicas"]), "static_peers": len(static["balancers"])}
                if static is not None else {}))
    _warn_open(cfg, api_keys)
    reload = Reload(args, settings, set_credentials=app[CREDENTIALS].set, balancer=app[BALANCER])
    reloader = Reloader(reload, lambda: reload.settings.files())
    reloader.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await reloader.stop()
    # Drain (Envoy's word): /healthz answers 503 and new requests get 503 (still listening, so that load balancers
    # and the controller see it draining rather than a refused connection), what is held is served, then stop.
    balancer = app[BALANCER]
    took = await balancer.drain(cfg.drain_timeout_s)
    structlog.get_logger("skylb.balancer").info("balancer_drained", drain_s=round(took, 3),
                                                left=balancer.active_requests)
    await runner.cleanup()
    return 0
