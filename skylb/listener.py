"""The listener of the balancer and the controller: aiohttp's HTTP server with deadlines on reading clients' requests
and a cap on open connections (settings: ``balancer.client_connections`` and ``controller.client_connections``,
skylb.config.ClientConnections).

aiohttp bounds the size of a request's head (8190-byte lines and fields, 128 headers) and closes idle keep-alive
connections (``keepalive_timeout``, passed through here), but has no deadline on reading a request, and versions
before 3.10 start no timer at all on a connection that has not finished its first head: a client sending its head or
its body one byte a second holds a connection, and many such clients every file descriptor, for ever (slowloris).
aiohttp offers no hook for this, so ``GuardedRequestHandler`` is its connection class with three small additions, and
``GuardedAppRunner`` builds aiohttp's server with that class:

- head deadline: from a connection's opening, and from the first byte of each later request, the head must be
  complete within ``header_timeout_s``; else the client gets a bare 408 (or nothing, if it sent no byte) and the
  connection is closed;
- body deadline: from its head, a body must be complete within ``body_timeout_s`` plus a second per
  ``body_min_rate_bytes_s`` bytes received; else the handler reading it gets ``ClientBodyTimeout`` (it answers 408 in
  the API's shape) and the connection is closed after that answer;
- connection cap: a connection beyond ``max_connections`` open gets a bare 503 with Retry-After and is closed;
- errors in the API's shape: what aiohttp answers itself before any handler runs (a malformed head, a head line
  over its 8190 bytes, a body in a content coding it cannot decode) is JSON in OpenAI's error shape (Ollama's on
  an ``/api/`` path, when aiohttp parsed one) rather than aiohttp's ``text/plain``, and logged as the client's
  error at info; an unsupported content coding is 415 with ``Accept-Encoding`` naming the codings taken (RFC 9110
  §15.5.16), the rest keeps aiohttp's status.

Every answer and log line names the setting that cut (``setting``, e.g. ``controller.client_connections``), so an
operator knows which server's limit to raise; the lines go to the server's own logger (``skylb.balancer``,
``skylb.controller``).
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from skylb.config import ClientConnections

__all__ = ["ClientBodyTimeout", "GuardedRequestHandler", "GuardedAppRunner", "unreadable_body"]


class ClientBodyTimeout(TimeoutError):
    """Raised by a request's body reads (``request.read()``, ``request.post()``, ...) when the client did not send
    the body in time (``client_connections.body_timeout_s``); the handler answers 408. A TimeoutError, so aiohttp's
    own discarding of an unread body after the answer stops quietly on it."""


#: The request content codings aiohttp decodes without optional packages (RFC 9110 §8.4.1).
ACCEPTED_ENCODINGS = "gzip, deflate"


def unreadable_body(exc: Exception) -> str:
    """Why a request body could not be read (aiohttp's ``RequestPayloadError``: a gzip or deflate body that does
    not decompress, a chunked body cut short), in one line without aiohttp's "400, message:" wrapping."""
    return " ".join(str(exc).split()).split("message: ", 1)[-1]


def _error_body(status: int, message: str, ollama: bool = False) -> bytes:
    """An error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}), or Ollama's ({"error": message})
    when ``ollama``, as JSON bytes."""
    if ollama:
        return json.dumps({"error": message}).encode()
    return json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": status}}).encode()


def _bare(status: int, reason: str, message: str, headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer closing the connection, its body an error in OpenAI's shape: written to the socket
    directly where no request (and so no API) is known."""
    body = _error_body(status, message)
    return (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's connection (one per client connection) with a head deadline, a body deadline and a connection
    cap, per ``limits`` (named ``setting`` in answers and logs). Reads three of aiohttp's counters of its own base
    class (``_request_count``: heads parsed, ``_messages``: heads waiting for the handler, ``_current_request``),
    since aiohttp exposes no hook for them."""

    def __init__(self, manager: web.Server, *, limits: ClientConnections, setting: str, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._setting = setting
        self._server = setting.partition(".")[0]  # "balancer", "controller"
        self._log = structlog.get_logger(f"skylb.{self._server}")
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # a byte of the awaited head arrived
        self._heads_at_arm = 0  # heads parsed when the head deadline was armed
        self._body_timer: asyncio.TimerHandle | None = None
        self._cut = False  # past a deadline or over the cap: what the client sends now is dropped
        self._refused = False  # over the cap: never handed to aiohttp's base

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if manager is not None and len(manager.connections) >= self._limits.max_connections:
            self._cut = self._refused = True
            self._log.warning("client_connection_refused", reason="max_connections",
                              limit=self._limits.max_connections, peer=_peer(transport))
            transport.write(_bare(503, "Service Unavailable", f"too many open connections to this {self._server} "
                                  f"({self._setting}.max_connections {self._limits.max_connections})",
                                  "Retry-After: 1\r\n"))
            transport.close()
            return  # never registered with aiohttp's server: no task, nothing to clean up
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        if self._refused:
            return  # aiohttp's base never saw it
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._cut:
            return
        if self._head_timer is None and self._current_request is None and not self._messages:
            self._arm_head_deadline()  # the first byte of a new head, after an idle keep-alive
        self._head_bytes = self._head_bytes or bool(data)
        heads = self._request_count
        super().data_received(data)
        if self._request_count > heads:  # a head is complete: its deadline is met, its body's starts
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._messages:
                payload = self._messages[-1][1]
                if not payload.is_eof():
                    self._watch_body(payload, self._loop.time())

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse or serve (module docstring, "errors in the API's
        shape"), closing the connection, never with a traceback. A 5xx is logged by aiohttp (with its traceback),
        a client's malformed request at info (``client_error``): a client's garbage is not the server's error.
        Raises ConnectionError, as aiohttp does, once bytes of an answer were sent. aiohttp parses no path from a
        head it rejects, so those answers are in OpenAI's shape."""
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs; raises ConnectionError after bytes sent
        elif request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        else:  # without the bytes aiohttp quotes (a header line's start: it may hold a credential)
            said = " ".join((message or "").split(": b'")[0].split())[:200]
            self._log.info("client_error", status=status, error=said, peer=_peer(self.transport))
        headers = {}
        if isinstance(exc, ContentEncodingError):
            status, headers = HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"Accept-Encoding": ACCEPTED_ENCODINGS}
        text = ((message or "").strip() or HTTPStatus(status).phrase if status < 500
                else f"internal error in the {self._server}" if status == 500 else HTTPStatus(status).phrase)
        try:
            ollama = request.path.startswith("/api/")
        except Exception:  # a head too malformed to have a path: OpenAI's shape, as the bare answers
            ollama = False
        response = web.Response(status=status, body=_error_body(status, text, ollama), headers=headers,
                                content_type="application/json")
        response.force_close()
        return response

    def _arm_head_deadline(self) -> None:
        self._heads_at_arm = self._request_count
        self._head_bytes = False
        self._head_timer = self._loop.call_later(self._limits.header_timeout_s, self._head_deadline)

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self.transport is None or self._request_count > self._heads_at_arm:
            return
        self._cut = True
        self._log.info("client_cut", reason="header_timeout", limit_s=self._limits.header_timeout_s,
                 bytes_received=self._head_bytes, peer=_peer(self.transport))
        if self._head_bytes:  # nothing to answer to a connection that never sent a byte (nginx does the same)
            self.transport.write(_bare(408, "Request Timeout", f"request head not complete within {self._setting}."
                                       f"header_timeout_s ({self._limits.header_timeout_s} s)"))
        self.force_close()  # as aiohttp's own keep-alive timeout does: the idle handler ends, the socket closes

    def _watch_body(self, payload, started: float) -> None:
        """Check at the body's deadline, moved later by the bytes received meanwhile, that it is complete."""
        limits = self._limits
        deadline = started + limits.body_timeout_s + (payload.total_bytes / limits.body_min_rate_bytes_s
                                                      if limits.body_min_rate_bytes_s else 0.0)
        if payload.is_eof() or payload.exception() is not None or self.transport is None:
            self._body_timer = None
            return
        if self._loop.time() < deadline:
            self._body_timer = self._loop.call_at(deadline, self._watch_body, payload, started)
            return
        self._body_timer = None
        self._cut = True
        self._log.info("client_cut", reason="body_timeout", limit_s=limits.body_timeout_s,
                       body_bytes=payload.total_bytes, peer=_peer(self.transport))
        payload.set_exception(ClientBodyTimeout(
            f"request body not complete within {self._setting}.body_timeout_s ({limits.body_timeout_s} s) plus 1 s "
            f"per {limits.body_min_rate_bytes_s:g} bytes received ({payload.total_bytes} bytes)"))
        self.close()  # after the handler's answer: no keep-alive


def _peer(transport: asyncio.BaseTransport | None) -> str | None:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None


class _GuardedServer(web.Server):
    """aiohttp's low-level server whose connections are GuardedRequestHandlers."""

    def __init__(self, *args: Any, limits: ClientConnections, setting: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.setting = setting

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, limits=self.limits, setting=self.setting,
                                     **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` serving ``app`` through GuardedRequestHandlers with ``limits`` (its keep-alive timeout
    included), named ``setting`` (where they are configured: ``balancer.client_connections``,
    ``controller.client_connections``) in answers and logs; other keyword arguments as AppRunner's. Overrides
    AppRunner's server factory (``_make_server``, the one place aiohttp builds its server) to build the same server
    with that connection class."""

    def __init__(self, app: web.Application, *, limits: ClientConnections, setting: str, **kwargs: Any):
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self._limits = limits
        self._setting = setting

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's start-up, as AppRunner does
        return _GuardedServer(server.request_handler, request_factory=server.request_factory,
                              handler_cancellation=server.handler_cancellation, loop=server._loop,
                              limits=self._limits, setting=self._setting, **server._kwargs)
