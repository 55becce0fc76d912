"""The relay: sends a request to its target (a local replica or a peer balancer) and the response back, chunk by chunk.

Rules (DESIGN.md decision 6, shared/reference/reliability.md): a request is retried only before its first byte went
to the client; once streaming has started, a failing upstream ends the stream with a well-formed error event instead
of a retry (no spliced, duplicated generation). Closing the upstream response when the client leaves aborts the
upstream request, so the engine frees the slot. Timeouts are per phase (first byte, then idle between chunks),
never a total that would cut a long generation (reliability.md).
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
        failure: for outlier detection: "gateway" (refused, reset, timed out before the first byte, 502/503/504,
            died mid-stream), "5xx" (another status >= 500 from the target), None (the target answered).
    """

    response: web.StreamResponse | None
    status: int
    ttft_s: float | None = None
    error: str | None = None
    failure: str | None = None


class Relay:
    """Sends requests to targets over one shared aiohttp session.

    Args:
        session: the upstream client session; region: this balancer's region; peer_token: sent to peers;
        session_header: the configured session-key header name (passed through).
        first_byte_timeout_s, response_timeout_s, idle_timeout_s: see ``relay`` (s).
    """

    def __init__(self, session: aiohttp.ClientSession, *, region: str, peer_token: str | None,
                 session_header: str, first_byte_timeout_s: float = 60.0, response_timeout_s: float = 600.0,
                 idle_timeout_s: float = 30.0):
        self.session = session
        self.first_byte_timeout_s = first_byte_timeout_s
        self.response_timeout_s = response_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.region = region
        self.peer_token = peer_token
        self.pass_headers = tuple(dict.fromkeys((*_PASS_HEADERS, session_header)))

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
                    arrived_at: float, retry_allowed: bool, api: str = "openai", stream: bool = True,
                    on_first_byte: Callable[[float], None] | None = None,
                    abandon: Callable[[], str | None] | None = None, check_s: float = 0.05) -> RelayOutcome:
        """Send ``body`` to the decision's target at the client's path and relay the answer.

        Timeouts (never a total, which would cut long generations): the first byte of a streamed answer
        (``stream``) must come within ``first_byte_timeout_s``, a whole answer that is not streamed within
        ``response_timeout_s``, and each later chunk within ``idle_timeout_s`` of the one before. The client's
        response starts only with the target's first body byte, so a target that sent headers and then hung or died
        is still retried.

        ``abandon()``, checked every ``check_s`` s until the first byte, returns why the target is to be given up
        (a partitioned peer: its status went stale), so no request waits on it for the whole first-byte timeout.

        ``on_first_byte(ttft_s)`` is called when the first streamed byte has been written to the client, so the
        TTFT histogram is current while a long stream is still running (and before the client can see its end).

        Returns RelayOutcome(response=None, ...) when the target failed before any byte went to the client and
        ``retry_allowed``; otherwise the response already sent (an error in the API's shape if the target failed).
        If the client goes away (the handler is cancelled) the upstream request is closed, so the engine stops.
        """
        loop = asyncio.get_running_loop()
        url = decision.url + request.rel_url.path_qs
        first_timeout = self.first_byte_timeout_s if stream else self.response_timeout_s

        def failed(status: int, error: str) -> RelayOutcome:
            response = None if retry_allowed else error_response(api, status, error)
            return RelayOutcome(response, status, error=error, failure="gateway")

        upstream_cm = self.session.post(url, data=body, headers=self._upstream_headers(request, decision, request_id))
        upstream: aiohttp.ClientResponse | None = None
        abandoned: list[str] = []
        watchdog = None
        try:
            try:
                async with asyncio.timeout(first_timeout) as deadline:
                    if abandon is not None:
                        watchdog = asyncio.create_task(_watch(abandon, check_s, deadline, abandoned))
                    upstream = await upstream_cm.__aenter__()
                    if upstream.status in RETRYABLE_STATUSES and retry_allowed:
                        return failed(upstream.status, f"{decision.target} answered {upstream.status}")
                    content_type = upstream.headers.get("Content-Type", "")
                    streamed = content_type.startswith(_STREAM_TYPES)
                    first = await (upstream.content.readany() if streamed else upstream.read())
            except TimeoutError:
                if abandoned:
                    return failed(504, f"{decision.route} {decision.target} given up before its first byte: "
                                       f"{abandoned[0]}")
                return failed(504, f"{decision.route} {decision.target} sent no byte within {first_timeout:g} s")
            except (aiohttp.ClientError, OSError) as exc:
                return failed(502, f"{decision.route} {decision.target} unreachable: {type(exc).__name__}: {exc}")
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            headers = self._client_headers(upstream, decision, request_id)
            failure = ("gateway" if upstream.status in RETRYABLE_STATUSES else
                       "5xx" if upstream.status >= 500 else None)
            if not streamed:
                return RelayOutcome(web.Response(status=upstream.status, body=first, headers=headers),
                                    upstream.status, failure=failure)
            if not first:  # the stream ended before its first byte: nothing was generated
                return failed(502, f"{decision.target} closed the stream before its first byte")
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            ttft = loop.time() - arrived_at
            error = None
            try:
                await response.write(first)
                if on_first_byte is not None:
                    on_first_byte(ttft)
                while True:
                    try:
                        async with asyncio.timeout(self.idle_timeout_s):
                            chunk = await upstream.content.readany()
                    except TimeoutError:
                        error = f"{decision.target} sent nothing for {self.idle_timeout_s:g} s mid-stream"
                        break
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
                        error = f"{decision.target} failed mid-stream: {type(exc).__name__}"
                        break
                    if not chunk:
                        break
                    await response.write(chunk)
                if error is not None:
                    # Bytes already reached the client: end the stream with an error event, never retry.
                    failure = "gateway"
                    await response.write(_stream_error_event(content_type, error))
                await response.write_eof()
            except ConnectionResetError:  # the client went away: the upstream request is closed below
                return RelayOutcome(response, upstream.status, ttft_s=ttft, error="client disconnected",
                                    failure=failure)
            return RelayOutcome(response, upstream.status, ttft_s=ttft, error=error, failure=failure)
        finally:
            if upstream is not None:
                if not upstream.content.is_eof():
                    upstream.close()  # aborts the upstream request: the engine frees its slot
                await upstream_cm.__aexit__(None, None, None)


async def _watch(abandon: Callable[[], str | None], every_s: float, deadline: asyncio.Timeout,
                 reasons: list[str]) -> None:
    """Until cancelled, check ``abandon()`` every ``every_s`` s; on a reason, record it and end ``deadline`` now."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every_s)
        reason = abandon()
        if reason is not None:
            reasons.append(reason)
            deadline.reschedule(loop.time())
            return


def _stream_error_event(content_type: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    if content_type.startswith("application/x-ndjson"):
        return (json.dumps({"error": message, "done": True}) + "\n").encode()
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
