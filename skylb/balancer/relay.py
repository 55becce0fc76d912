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
from skylb.balancer.protocol import (FORWARDED_FROM, QUEUE_MS_HEADER, REQUEST_ID_HEADER, ROUTE_HEADER,
                                     SERVED_BY_HEADER, TOKEN_HEADER)
from skylb.core import Decision

__all__ = ["Relay", "RelayOutcome", "RETRYABLE_STATUSES"]

#: Upstream statuses that mean "this target could not take it": the request is re-queued (before any byte).
RETRYABLE_STATUSES = frozenset({502, 503, 504})
#: Client headers passed to the upstream (auth and session keys; hop-by-hop headers are not).
_PASS_HEADERS = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "X-Session-ID", "Accept")
_STREAM_TYPES = ("text/event-stream", "application/x-ndjson")


@dataclass
class RelayOutcome:
    """How one relay attempt ended.

    Attributes:
        response: the response sent to the client, or None when the attempt failed before any byte went out
            (the caller may retry). status: the HTTP status sent (or the upstream's, when retryable).
        ttft_s: time from arrival to the first streamed byte relayed, s (None when not streamed).
        error: what went wrong, if anything.
    """

    response: web.StreamResponse | None
    status: int
    ttft_s: float | None = None
    error: str | None = None


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
        headers = {ROUTE_HEADER: route, SERVED_BY_HEADER: served_by, REQUEST_ID_HEADER: request_id,
                   QUEUE_MS_HEADER: f"{decision.queued_s * 1000:.1f}"}
        if "Content-Type" in upstream.headers:
            headers["Content-Type"] = upstream.headers["Content-Type"]
        return headers

    async def relay(self, request: web.Request, body: bytes, decision: Decision, *, request_id: str,
                    arrived_at: float, retry_allowed: bool, api: str = "openai",
                    on_first_byte: Callable[[float], None] | None = None) -> RelayOutcome:
        """Send ``body`` to the decision's target at the client's path and relay the answer.

        ``on_first_byte(ttft_s)`` is called when the first streamed byte has been written to the client, so the
        TTFT histogram is current while a long stream is still running (and before the client can see its end).

        Returns RelayOutcome(response=None, ...) when the target failed before any byte went to the client and
        ``retry_allowed``; otherwise the response already sent (an error in the API's shape if the target failed).
        """
        loop = asyncio.get_running_loop()
        url = decision.url + request.rel_url.path_qs
        try:
            upstream_cm = self.session.post(url, data=body,
                                            headers=self._upstream_headers(request, decision, request_id))
            upstream = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            error = f"{decision.route} {decision.target} unreachable: {type(exc).__name__}: {exc}"
            if retry_allowed:
                return RelayOutcome(None, 502, error=error)
            return RelayOutcome(error_response(api, 502, error), 502, error=error)
        try:
            if upstream.status in RETRYABLE_STATUSES and retry_allowed:
                return RelayOutcome(None, upstream.status, error=f"{decision.target} answered {upstream.status}")
            headers = self._client_headers(upstream, decision, request_id)
            content_type = upstream.headers.get("Content-Type", "")
            if not content_type.startswith(_STREAM_TYPES):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    error = f"{decision.target} failed before answering: {type(exc).__name__}"
                    if retry_allowed:
                        return RelayOutcome(None, 502, error=error)
                    return RelayOutcome(error_response(api, 502, error), 502, error=error)
                return RelayOutcome(web.Response(status=upstream.status, body=data, headers=headers),
                                    upstream.status)
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            ttft = None
            error = None
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    if ttft is None:
                        ttft = loop.time() - arrived_at
                        if on_first_byte is not None:
                            on_first_byte(ttft)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                # Bytes already reached the client: end the stream with an error event, never retry.
                error = f"{decision.target} failed mid-stream: {type(exc).__name__}"
                await response.write(_stream_error_event(content_type, error))
            await response.write_eof()
            return RelayOutcome(response, upstream.status, ttft_s=ttft, error=error)
        finally:
            await upstream_cm.__aexit__(None, None, None)


def _stream_error_event(content_type: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    if content_type.startswith("application/x-ndjson"):
        return (json.dumps({"error": message, "done": True}) + "\n").encode()
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
