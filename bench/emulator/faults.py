"""Faults a chaos run injects into a running emulated replica, switched on and off over HTTP.

``PUT /emulator/faults`` with ``{"slowdown": float >= 1, "error_status": int | null}`` sets them (each key
optional; the answer is the faults now in force); ``GET /emulator/faults`` reads them. ``slowdown`` stretches every
engine step (prefill and decode) by that factor, as an engine sharing its GPU or thermally throttled is slower;
``error_status`` answers every generation request (POST) with that status in the engine's own error shape before
it reaches the engine, as an engine whose scheduler has died while its HTTP server and ``/health`` still answer
(vLLM's API server answers 500 "EngineDeadError" in that state). The route exists only when the emulator runs with
``--fault-control`` (bench code only; an emulator without it is unchanged).

The middleware also remembers the ``X-Request-Id`` a request arrived with, so the replica's ``request_finished``
log line names it (``upstream_request_id``): a balancer sends its own request id there, which is how a chaos run
tells which client request a replica executed.
"""

from __future__ import annotations

import contextvars
from dataclasses import asdict, dataclass

from aiohttp import web

__all__ = ["Faults", "UPSTREAM_ID", "FAULTS_PATH", "fault_middleware", "add_fault_routes"]

#: The X-Request-Id of the request being handled (None outside one), read by Replica.submit.
UPSTREAM_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("upstream_request_id", default=None)
FAULTS_PATH = "/emulator/faults"
_KEY = web.AppKey("faults", object)


@dataclass
class Faults:
    """The faults in force on one replica: ``slowdown`` (x, 1 = none), ``error_status`` (HTTP status or None)."""

    slowdown: float = 1.0
    error_status: int | None = None

    def update(self, body: object) -> None:
        """Apply a PUT body; ValueError naming the bad field."""
        if not isinstance(body, dict) or set(body) - {"slowdown", "error_status"}:
            raise ValueError("body must be an object with slowdown and/or error_status")
        slowdown = body.get("slowdown", self.slowdown)
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown >= 1:
            raise ValueError("slowdown must be a number >= 1")
        status = body.get("error_status", self.error_status)
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)
                                   or not 400 <= status <= 599):
            raise ValueError("error_status must be null or an HTTP error status (400-599)")
        self.slowdown, self.error_status = float(slowdown), status


def fault_middleware(faults: Faults | None, error_response):
    """An aiohttp middleware: binds UPSTREAM_ID for the handler, and with ``faults.error_status`` set answers every
    POST (generation) with ``error_response(status, message)``."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        token = UPSTREAM_ID.set(request.headers.get("X-Request-Id"))
        try:
            if faults is not None and faults.error_status is not None and request.method == "POST":
                return error_response(faults.error_status, "emulated engine failure (fault injected)")
            return await handler(request)
        finally:
            UPSTREAM_ID.reset(token)

    return middleware


def add_fault_routes(app: web.Application, faults: Faults) -> None:
    """GET/PUT ``/emulator/faults`` on ``app``."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response(asdict(faults))

    async def update(request: web.Request) -> web.Response:
        try:
            faults.update(await request.json())
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "BadRequestError"}}, status=400)
        return web.json_response(asdict(faults))

    app.router.add_get(FAULTS_PATH, show)
    app.router.add_put(FAULTS_PATH, update)
