"""The relay: sends a request to its target (a local replica or a peer balancer) and the response back, chunk by chunk.

Rules (DESIGN.md decision 6, shared/reference/reliability.md): a request is retried only before its first byte went
to the client; once streaming has started, a failing upstream ends the stream with a well-formed error event instead
of a retry (no spliced, duplicated generation). Closing the upstream response when the client leaves aborts the
upstream request, so the engine frees the slot.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from skylb.balancer.api import error_response
from skylb.balancer.framing import FramingError, StreamFramer, stream_kind
from skylb.balancer.protocol import (BALANCER_REQUEST_ID_HEADER, FORWARDED_FROM, QUEUE_MS_HEADER, REQUEST_ID_HEADER,
                                     ROUTE_HEADER, SERVED_BY_HEADER, TOKEN_HEADER)
from skylb.core import Decision

__all__ = ["Relay", "RelayOutcome", "RETRYABLE_STATUSES", "STREAM_STARTED"]

#: Upstream statuses that mean "this target could not take it": the request is re-queued (before any byte).
RETRYABLE_STATUSES = frozenset({502, 503, 504})
#: Request key set once a streamed response's headers went to the client (no other response can follow).
STREAM_STARTED = (web.RequestKey("skylb_stream_started", bool) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
                  else "skylb_stream_started")
#: Whole answers up to this size are parsed to check they are JSON (bytes).
_FULL_CHECK_BYTES = 1 << 20
#: Client headers passed to the upstream (auth and session keys; hop-by-hop headers are not).
_PASS_HEADERS = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "X-Session-ID", "Accept")


@dataclass
class RelayOutcome:
    """How one relay attempt ended.

    Attributes:
        response: the response sent to the client, or None when the attempt failed before any byte went out
            (the caller may retry). status: the HTTP status sent (or the upstream's, when retryable).
        ttft_s: time from arrival to the first streamed byte relayed, s (None when not streamed).
        error: what went wrong, if anything. target_failed: the target is to blame (see below).
    """

    response: web.StreamResponse | None
    status: int
    ttft_s: float | None = None
    error: str | None = None
    #: True when the target misbehaved although a response was sent (garbage, truncated stream): counted as a
    #: gateway failure by outlier detection, like a failure before the first byte.
    target_failed: bool = False


class Relay:
    """Sends requests to targets over one shared aiohttp session.

    Args:
        session: the upstream client session; region: this balancer's region; peer_token: sent to peers;
        session_header: the configured session-key header name (passed through); forward_client_auth: pass the
        client's Authorization on (False when it holds a SkyLB client key, which is no replica's business);
        replica_api_key: sent to local replicas as ``Authorization: Bearer`` instead (README, "Security").
    """

    def __init__(self, session: aiohttp.ClientSession, *, region: str, peer_token: str | None,
                 session_header: str, forward_client_auth: bool = True, replica_api_key: str | None = None):
        self.session = session
        self.region = region
        self.peer_token = peer_token
        self.replica_api_key = replica_api_key
        pass_headers = _PASS_HEADERS if forward_client_auth else tuple(h for h in _PASS_HEADERS
                                                                        if h != "Authorization")
        self.pass_headers = tuple(dict.fromkeys((*pass_headers, session_header)))

    def _upstream_headers(self, request: web.Request, decision: Decision, request_id: str) -> dict:
        headers = {h: request.headers[h] for h in self.pass_headers if h in request.headers}
        headers["Content-Type"] = "application/json"
        headers[REQUEST_ID_HEADER] = request_id
        # Plain bytes from upstream: the relay re-frames streams (framing.py), times the first byte and checks
        # bodies; gzip between balancer and replica gains little on token-sized chunks and delays them.
        headers["Accept-Encoding"] = "identity"
        if decision.route == "peer":
            headers[FORWARDED_FROM] = self.region
            # Its wait here so far: the peer queues it in first-come, first-served order across regions.
            headers[QUEUE_MS_HEADER] = f"{decision.queued_s * 1000.0:.0f}"
            if self.peer_token:
                headers[TOKEN_HEADER] = self.peer_token
        elif self.replica_api_key:
            headers["Authorization"] = f"Bearer {self.replica_api_key}"
        return headers

    def _client_headers(self, upstream: aiohttp.ClientResponse, decision: Decision, request_id: str) -> dict:
        if decision.route == "local":
            route, served_by = "local", f"{self.region}/{decision.target}"
        else:
            route, served_by = f"peer:{decision.target}", upstream.headers.get(SERVED_BY_HEADER, decision.target)
        headers = {ROUTE_HEADER: route, SERVED_BY_HEADER: served_by, BALANCER_REQUEST_ID_HEADER: request_id,
                   QUEUE_MS_HEADER: f"{decision.queued_s * 1000:.1f}"}
        if "Content-Type" in upstream.headers:
            headers["Content-Type"] = upstream.headers["Content-Type"]
        return headers

    async def relay(self, request: web.Request, body: bytes, decision: Decision, *, request_id: str,
                    arrived_at: float, retry_allowed: bool, api: str = "openai",
                    on_first_byte: Callable[[float], None] | None = None,
                    client_request_id: str | None = None) -> RelayOutcome:
        """Send ``body`` to the decision's target at the client's path and relay the answer.

        ``request_id`` is the balancer's own id (sent upstream as X-Request-Id, to the client as
        X-SkyLB-Request-Id); ``client_request_id``, the client's X-Request-Id label, is echoed back to the client.

        ``on_first_byte(ttft_s)`` is called when the first streamed byte has been written to the client, so the
        TTFT histogram is current while a long stream is still running (and before the client can see its end).

        Returns RelayOutcome(response=None, ...) when the target failed before any byte went to the client and
        ``retry_allowed``; otherwise the response already sent (an error in the API's shape if the target failed).
        """
        url = decision.url + request.rel_url.path_qs
        try:
            upstream_cm = self.session.post(url, data=body,
                                            headers=self._upstream_headers(request, decision, request_id))
            upstream = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            error = f"{decision.route} {decision.target} unreachable: {type(exc).__name__}: {exc}"
            if retry_allowed:
                return RelayOutcome(None, 502, error=error)
            return RelayOutcome(error_response(api, 502, error), 502, error=error, target_failed=True)
        try:
            if upstream.status in RETRYABLE_STATUSES and retry_allowed:
                return RelayOutcome(None, upstream.status, error=f"{decision.target} answered {upstream.status}")
            headers = self._client_headers(upstream, decision, request_id)
            if client_request_id is not None:
                headers[REQUEST_ID_HEADER] = client_request_id
            content_type = upstream.headers.get("Content-Type", "")
            kind = stream_kind(content_type)
            if kind is None:
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    error = f"{decision.target} failed before answering: {type(exc).__name__}"
                    if retry_allowed:
                        return RelayOutcome(None, 502, error=error)
                    return RelayOutcome(error_response(api, 502, error), 502, error=error, target_failed=True)
                return self._checked_body(upstream.status, data, headers, decision, api, retry_allowed)
            return await self._relay_stream(request, upstream, kind, headers, decision, api=api,
                                            arrived_at=arrived_at, retry_allowed=retry_allowed,
                                            on_first_byte=on_first_byte)
        finally:
            await upstream_cm.__aexit__(None, None, None)


    def _checked_body(self, status: int, data: bytes, headers: dict, decision: Decision, api: str,
                      retry_allowed: bool) -> RelayOutcome:
        """A whole (not streamed) answer. JSON passes unchanged (as application/json, whatever type the upstream
        named; bodies over _FULL_CHECK_BYTES, large embeddings, are only checked to start and end as JSON does:
        parsing them costs more than they risk). A 2xx that is not JSON is the target's failure (502, or a retry);
        a non-JSON error page becomes an error in the API's shape with the upstream's status."""
        try:
            if len(data) <= _FULL_CHECK_BYTES:
                json.loads(data)
            elif data.strip()[:1] not in (b"{", b"[") or data.strip()[-1:] not in (b"}", b"]"):
                raise ValueError("not JSON")
        except (ValueError, RecursionError):
            snippet = data[:200].decode("utf-8", "replace")
            if status < 400:
                error = f"{decision.target} answered HTTP {status} with a body that is not JSON: {snippet!r}"
                if retry_allowed:
                    return RelayOutcome(None, 502, error=error)
                return RelayOutcome(error_response(api, 502, error), 502, error=error, target_failed=True)
            error = f"{decision.target} answered HTTP {status}: {snippet}"
            return RelayOutcome(error_response(api, status, error), status, error=error)
        headers["Content-Type"] = "application/json"
        return RelayOutcome(web.Response(status=status, body=data, headers=headers), status)

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, kind: str, headers: dict,
                            decision: Decision, *, api: str, arrived_at: float, retry_allowed: bool,
                            on_first_byte: Callable[[float], None] | None) -> RelayOutcome:
        """Relay an SSE / NDJSON answer whole event by whole event (framing.py). Garbage before the first event is
        a failure before the first byte (retried when allowed); after it, and on a cut or truncated stream, the
        stream ends with a well-formed error event and the target is counted as failed."""
        loop = asyncio.get_running_loop()
        framer = StreamFramer(kind)
        response: web.StreamResponse | None = None
        ttft = None
        error = None
        try:
            async for chunk in upstream.content.iter_any():
                events = framer.feed(chunk)
                if not events:
                    continue
                if response is None:
                    response = await _start_stream(request, upstream.status, headers)
                await response.write(events)
                if ttft is None:
                    ttft = loop.time() - arrived_at
                    if on_first_byte is not None:
                        on_first_byte(ttft)
            last = framer.finish()
            if last:
                if response is None:
                    response = await _start_stream(request, upstream.status, headers)
                await response.write(last)
            if not framer.done:
                error = f"{decision.target} ended the stream before its last event"
        except FramingError as exc:
            error = f"{decision.target} sent a malformed stream: {exc}"
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            error = f"{decision.target} failed mid-stream: {type(exc).__name__}"
        if response is None:  # nothing reached the client: a failure before the first byte
            error = error or f"{decision.target} sent an empty stream"
            if retry_allowed:
                return RelayOutcome(None, 502, error=error)
            return RelayOutcome(error_response(api, 502, error), 502, error=error, target_failed=True)
        if error is not None:  # bytes already reached the client: end the stream with an error event, never retry
            await response.write(_stream_error_event(kind, error))
        await response.write_eof()
        return RelayOutcome(response, upstream.status, ttft_s=ttft, error=error, target_failed=error is not None)


async def _start_stream(request: web.Request, status: int, headers: dict) -> web.StreamResponse:
    request[STREAM_STARTED] = True
    response = web.StreamResponse(status=status, headers=headers)
    await response.prepare(request)
    return response


def _stream_error_event(kind: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    if kind == "ndjson":
        return (json.dumps({"error": message, "done": True}) + "\n").encode()
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
