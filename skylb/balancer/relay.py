"""The relay: sends a request to its target (a local replica or a peer balancer) and the response back, chunk by chunk.

Rules (Envoy's router filter, "Retry semantics"; aiohttp's "Web Server Advanced", "Peer disconnection"): a request is
retried only before its first byte went to the client; once streaming has started, a failing upstream ends the stream
with a well-formed error event instead of a retry (no spliced, duplicated generation). Closing the upstream response
when the client leaves aborts the upstream request, so the engine frees the slot. Timeouts are per phase (first byte,
then idle between chunks), never a total that would cut a long generation (aiohttp's client default, a 300 s total,
would). Streams are relayed whole event by whole event (framing.py), so an error event is never spliced into half an
event, and garbage is caught. An Ollama-API request translated to the OpenAI API (skylb/balancer/translate.py) is sent
to the OpenAI path, and its answer, whole or streamed, is turned back into Ollama's shape on the way.
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
from skylb.balancer.protocol import (ANSWER_COMPLETE, ANSWER_USAGE, BALANCER_REQUEST_ID_HEADER, FORWARDED_FROM, QUEUE_MS_HEADER, REQUEST_ID_HEADER,
                                     MODEL_HEADER, ROUTE_HEADER, RULE_HEADER, SERVED_BY_HEADER, TOKEN_HEADER,
                                     header_value)
from skylb.balancer.translate import StreamTranslator, Translation
from skylb.balancer.usage import UsageTap, usage_of, usage_of_body
from skylb.core import Decision
from skylb.core.rates import Usage
from skylb.quota.priorities import peer_headers

__all__ = ["Relay", "RelayOutcome", "GATEWAY_STATUSES", "RETRYABLE_STATUSES", "UNSUPPORTED_STATUS", "STREAM_STARTED"]

#: Upstream statuses that mean "this target could not take it": gateway failures for outlier detection.
GATEWAY_STATUSES = frozenset({502, 503, 504})
#: Upstream statuses after which the request is re-queued for another target (before any byte reached the client):
#: the gateway failures and 500, the engine's own failure on this request, which another replica may well serve
#: (Envoy's ``retry_on: 5xx``, SGLang's gateway retries it too); a 500 counts as a 5xx, not a gateway failure.
RETRYABLE_STATUSES = GATEWAY_STATUSES | {500}
#: 501 Not Implemented: the target does not serve this kind of request (llama-server without ``--embeddings``);
#: retried elsewhere before the first byte, and not a failure for outlier detection (the target is fine otherwise).
UNSUPPORTED_STATUS = 501
#: Request key set once a streamed response's headers went to the client (no other response can follow).
STREAM_STARTED = (web.RequestKey("skylb_stream_started", bool) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
                  else "skylb_stream_started")
#: Whole answers up to this size are parsed to check they are JSON (bytes).
_FULL_CHECK_BYTES = 1 << 20
#: ``_checked_body``'s mark for a body too large to decode.
_NOT_DECODED = object()
#: Client headers passed to the upstream (auth and session keys; hop-by-hop headers are not). A balancer that does not
#: trace passes the caller's W3C trace context on unchanged, as a proxy that takes no part in the trace does, so the
#: replica's own spans still join the caller's trace; one that traces sends its relay span's instead (``relay``).
_PASS_HEADERS = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "X-Session-ID", "Accept",
                 "traceparent", "tracestate")


@dataclass
class RelayOutcome:
    """How one relay attempt ended.

    Attributes:
        response: the response sent to the client, or None when the attempt failed before any byte went out
            (the caller may retry). status: the HTTP status sent (or the upstream's, when retryable).
        ttft_s: time from arrival to the first streamed byte relayed, s (None when not streamed).
        error: what went wrong, if anything.
        failure: for outlier detection: "gateway" (refused, reset, timed out before the first byte, 502/503/504,
            garbage, died or was cut mid-stream), "5xx" (another status >= 500 from the target, 500 included, which is
            retried as the gateway failures are), "unsupported" (501 Not Implemented, retried elsewhere; ``error``
            holds the engine's message), None (the target answered).
        usage: the token counts and engine durations the answer reported (skylb/balancer/usage.py), or None.
    """

    response: web.StreamResponse | None
    status: int
    ttft_s: float | None = None
    error: str | None = None
    failure: str | None = None
    usage: Usage | None = None

    @property
    def relayed(self) -> bool:
        """The response sent is the target's own answer passed on (it carries ``X-SkyLB-Route``), not an error the
        balancer wrote after the target failed."""
        return self.response is not None and ROUTE_HEADER in self.response.headers


def _failure_of(status: int) -> str | None:
    """Outlier detection's name for an answer with HTTP ``status``."""
    return "gateway" if status in GATEWAY_STATUSES else "5xx" if status >= 500 else None


async def _unsupported(upstream: aiohttp.ClientResponse, decision: Decision) -> RelayOutcome:
    """The outcome of a 501 before the first byte: retried elsewhere, the engine's message kept (first 4 KiB)."""
    said = _error_message(await upstream.content.read(4096))
    return RelayOutcome(None, UNSUPPORTED_STATUS, failure="unsupported",
                        error=f"{decision.target} answered 501" + (f": {said}" if said else ""))


def _error_message(body: bytes) -> str:
    """The ``error.message`` (OpenAI, llama.cpp) or ``error`` (Ollama) of an error body, at most 300 characters;
    "" when the body says none."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = err.get("message") if isinstance(err, dict) else err
    return str(message)[:300] if message else ""


class Relay:
    """Relays requests to replicas and peers over one aiohttp session.

    Args:
        session: the upstream client session; region: this balancer's region; peer_token: sent to peers;
        session_header: the configured session-key header name (passed through); forward_client_auth: pass the
        client's Authorization on (False when it holds a SkyLB client key, which is no replica's business);
        replica_api_key: sent to local replicas as ``Authorization: Bearer`` instead (README, "Security");
        first_byte_timeout_s, response_timeout_s, idle_timeout_s: see ``relay`` (s).
    """

    def __init__(self, session: aiohttp.ClientSession, *, region: str, peer_token: str | None,
                 session_header: str, forward_client_auth: bool = True, replica_api_key: str | None = None,
                 first_byte_timeout_s: float = 60.0, response_timeout_s: float = 600.0, idle_timeout_s: float = 30.0):
        self.session = session
        self.first_byte_timeout_s = first_byte_timeout_s
        self.response_timeout_s = response_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.region = region
        self.peer_token = peer_token
        self.replica_api_key = replica_api_key
        pass_headers = _PASS_HEADERS if forward_client_auth else tuple(h for h in _PASS_HEADERS
                                                                        if h != "Authorization")
        self.pass_headers = tuple(dict.fromkeys((*pass_headers, session_header)))

    def _upstream_headers(self, request: web.Request, decision: Decision, request_id: str,
                          trace_headers: dict[str, str] | None = None) -> dict:
        headers = {h: request.headers[h] for h in self.pass_headers if h in request.headers}
        if trace_headers is not None:
            headers.pop("tracestate", None)  # the relay span's context replaces the caller's as a whole
            headers.update(trace_headers)
        headers["Content-Type"] = "application/json"
        headers[REQUEST_ID_HEADER] = request_id
        # Plain bytes from upstream: the relay re-frames streams (framing.py), times the first byte and checks
        # bodies; gzip between balancer and replica gains little on token-sized chunks and delays them.
        headers["Accept-Encoding"] = "identity"
        if decision.route == "peer":
            headers[FORWARDED_FROM] = self.region
            # Its wait here so far: the peer queues it in first-come, first-served order across regions.
            headers[QUEUE_MS_HEADER] = f"{decision.queued_s * 1000.0:.0f}"
            # Its class and tenant: the peer queues it as this balancer did (trusted there with the peer token).
            if decision.request is not None:
                headers.update(peer_headers(decision.request.priority, decision.request.tenant))
            if self.peer_token:
                headers[TOKEN_HEADER] = self.peer_token
        elif self.replica_api_key:
            headers["Authorization"] = f"Bearer {self.replica_api_key}"
        return headers

    def replica_authorization(self, request: web.Request) -> str | None:
        """The Authorization a local replica gets for ``request``: the replica API key, else the client's own
        when it is passed on (no SkyLB client keys), else None."""
        if self.replica_api_key:
            return f"Bearer {self.replica_api_key}"
        return request.headers.get("Authorization") if "Authorization" in self.pass_headers else None

    def _client_headers(self, upstream: aiohttp.ClientResponse, decision: Decision, request_id: str) -> dict:
        if decision.route == "local":
            route, served_by = "local", f"{self.region}/{decision.target}"
        else:
            route, served_by = f"peer:{decision.target}", upstream.headers.get(SERVED_BY_HEADER, decision.target)
        headers = {ROUTE_HEADER: route, SERVED_BY_HEADER: served_by, BALANCER_REQUEST_ID_HEADER: request_id,
                   QUEUE_MS_HEADER: f"{decision.queued_s * 1000:.1f}"}
        if decision.rule is not None:
            # A forward's rule, then the peer's own (its answer's header): the whole decision, hop by hop.
            peer_rule = upstream.headers.get(RULE_HEADER) if decision.route != "local" else None
            headers[RULE_HEADER] = (f"{decision.rule}, {peer_rule}" if peer_rule and header_value(peer_rule)
                                    else decision.rule)
        # What a replica or peer said goes into a header only as printable ASCII (no CR/LF: a split header drops
        # the client's connection after the handler returned); anything else is left out.
        for name, value in ((MODEL_HEADER, decision.request.model),  # the model asked of the target (a fallback's)
                            ("Content-Type", upstream.headers.get("Content-Type"))):
            if header_value(value) is not None:
                headers[name] = value
        if header_value(served_by) is None:
            headers[SERVED_BY_HEADER] = decision.target
        return headers

    async def relay(self, request: web.Request, body: bytes, decision: Decision, *, request_id: str,
                    arrived_at: float, retry_allowed: bool, api: str = "openai", stream: bool = True,
                    on_first_byte: Callable[[float], None] | None = None, client_request_id: str | None = None,
                    abandon: Callable[[], str | None] | None = None, check_s: float = 0.05,
                    extra_headers: dict[str, str] | None = None, on_head: Callable[[bytes], None] | None = None,
                    trace_headers: dict[str, str] | None = None, translation: Translation | None = None,
                    on_complete: Callable[[], None] | None = None) -> RelayOutcome:
        """Send ``body`` to the decision's target at the client's path and relay the answer. ``request_id`` is the
        balancer's own id (sent upstream as X-Request-Id, to the client as X-SkyLB-Request-Id); ``client_request_id``,
        the client's X-Request-Id label, is echoed back to the client.

        Timeouts (never a total, which would cut long generations): the first whole event of a streamed answer
        (``stream``) must come within ``first_byte_timeout_s``, a whole answer that is not streamed within
        ``response_timeout_s``, and each later chunk within ``idle_timeout_s`` of the one before. The client's
        response starts only with the target's first whole event, so a target that sent headers and then hung,
        died or sent garbage is still retried. ``abandon()``, checked every ``check_s`` s until the first byte,
        returns why the target is to be given up (a partitioned peer: its status went stale), so no request waits on
        it for the whole first-byte timeout.

        ``trace_headers`` (the relay span's W3C ``traceparent``, ``tracestate``) replace the client's upstream when
        the balancer traces (skylb/balancer/spans.py). ``on_first_byte(ttft_s)`` is called when the first streamed
        byte has been written to the client (the TTFT histogram is current while a long stream still runs).
        ``on_head(bytes)`` gets the head of a successful (< 400) answer before the client does: the whole body, or a
        stream's first whole event; ``on_complete()``, once, a stream's last event (its engine is done with it).
        ``extra_headers`` go to the client with the answer. ``translation``: ``body`` is an Ollama-API request
        translated to the OpenAI API (sent to its path; the answer comes back in Ollama's shape, NDJSON streamed).

        Returns RelayOutcome(response=None, ...) when the target failed before any byte went to the client and
        ``retry_allowed``; otherwise the response already sent (an error in the API's shape if the target failed).
        If the client goes away (the handler is cancelled) the upstream request is closed, so the engine stops.
        """
        url = decision.url + (translation.path if translation is not None else request.rel_url.path_qs)
        first_timeout = self.first_byte_timeout_s if stream else self.response_timeout_s

        def failed(status: int, error: str) -> RelayOutcome:  # a 500 is a 5xx, the rest (502-504) gateway failures
            response = None if retry_allowed else error_response(api, status, error)
            return RelayOutcome(response, status, error=error, failure=_failure_of(status))

        upstream_cm = self.session.post(url, data=body,
                                        headers=self._upstream_headers(request, decision, request_id, trace_headers))
        upstream: aiohttp.ClientResponse | None = None
        abandoned: list[str] = []
        framer, watchdog, first, data, eof = None, None, b"", b"", False  # framer: StreamFramer once the head is read
        try:
            try:
                async with asyncio.timeout(first_timeout) as deadline:
                    if abandon is not None:
                        watchdog = asyncio.create_task(_watch(abandon, check_s, deadline, abandoned))
                    upstream = await upstream_cm.__aenter__()
                    if retry_allowed and upstream.status in RETRYABLE_STATUSES | {UNSUPPORTED_STATUS}:
                        return (await _unsupported(upstream, decision) if upstream.status == UNSUPPORTED_STATUS
                                else failed(upstream.status, f"{decision.target} answered {upstream.status}"))
                    framer, first, data, eof = await _read_until_first_event(upstream)
            except TimeoutError:
                return failed(504, f"{decision.route} {decision.target} " + (
                    f"given up before its first byte: {abandoned[0]}" if abandoned
                    else f"sent no byte within {first_timeout:g} s"))
            except FramingError as exc:
                return failed(502, f"{decision.target} sent a malformed stream: {exc}")
            except (aiohttp.ClientError, OSError) as exc:
                return failed(502, f"{decision.route} {decision.target} unreachable: {type(exc).__name__}: {exc}")
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            headers = self._answer_headers(upstream, decision, request_id, client_request_id, extra_headers)
            if on_head is not None and upstream.status < 400:
                on_head(data if framer is None else first)
            if framer is None:
                return self._checked_body(upstream.status, data, headers, decision, api, retry_allowed,
                                          translation)
            if not first:  # the stream ended before its first event: nothing was generated
                return failed(502, f"{decision.target} sent an empty stream")
            return await self._relay_stream(request, upstream, framer, first, eof, headers, decision,
                                            on_complete=on_complete, arrived_at=arrived_at, on_first_byte=on_first_byte,
                                            translator=translation.stream() if translation is not None else None)
        finally:
            if upstream is not None:
                if not upstream.content.is_eof():
                    upstream.close()  # aborts the upstream request: the engine frees its slot
                await upstream_cm.__aexit__(None, None, None)

    def _answer_headers(self, upstream: aiohttp.ClientResponse, decision: Decision, request_id: str,
                        client_request_id: str | None, extra: dict[str, str] | None) -> dict[str, str]:
        """The headers of the client's answer: the target's that pass, SkyLB's, ``extra`` (rate limits) and the
        client's own request id echoed back."""
        headers = {**self._client_headers(upstream, decision, request_id), **(extra or {})}
        if client_request_id is not None:
            headers[REQUEST_ID_HEADER] = client_request_id
        return headers

    def _checked_body(self, status: int, data: bytes, headers: dict, decision: Decision, api: str,
                      retry_allowed: bool, translation: Translation | None = None) -> RelayOutcome:
        """A whole (not streamed) answer. JSON passes unchanged (as application/json, whatever type the upstream
        named; bodies over _FULL_CHECK_BYTES, large embeddings, are only checked to start and end as JSON does:
        parsing them costs more than they risk), or, with a ``translation``, decoded and turned into Ollama's shape
        (an answer in no OpenAI shape is the target's failure, as garbage is). A 2xx that is not JSON is the target's
        failure (502, or a retry); a non-JSON error page becomes an error in the API's shape with the upstream's
        status."""
        decoded = _NOT_DECODED
        try:
            if len(data) <= _FULL_CHECK_BYTES or translation is not None:
                decoded = json.loads(data)
            elif data.strip()[:1] not in (b"{", b"[") or data.strip()[-1:] not in (b"}", b"]"):
                raise ValueError("not JSON")
        except (ValueError, RecursionError):
            snippet = data[:200].decode("utf-8", "replace")
            if status < 400:
                error = f"{decision.target} answered HTTP {status} with a body that is not JSON: {snippet!r}"
                response = None if retry_allowed else error_response(api, 502, error)
                return RelayOutcome(response, 502, error=error, failure="gateway")
            error = f"{decision.target} answered HTTP {status}: {snippet}"
            return RelayOutcome(error_response(api, status, error), status, error=error, failure=_failure_of(status))
        headers["Content-Type"] = "application/json"
        usage = None
        if status < 400:  # the body decoded above is read for its usage, not decoded again
            usage = usage_of_body(data) if decoded is _NOT_DECODED else usage_of(decoded)
        if translation is not None:
            try:
                data = translation.answer(decoded)
            except FramingError as exc:
                error = f"{decision.target} answered HTTP {status} with {exc}"
                response = None if retry_allowed and status < 400 else error_response(api, 502, error)
                return RelayOutcome(response, 502, error=error, failure="gateway")
        return RelayOutcome(web.Response(status=status, body=data, headers=headers), status,
                            failure=_failure_of(status), usage=usage)

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, framer: StreamFramer,
                            first: bytes, eof: bool, headers: dict, decision: Decision, *, arrived_at: float,
                            on_first_byte: Callable[[float], None] | None,
                            translator: StreamTranslator | None = None,
                            on_complete: Callable[[], None] | None = None) -> RelayOutcome:
        """Relay an SSE / NDJSON answer from its ``first`` whole event on, event by event; each chunk must come
        within ``idle_timeout_s``. A stall, a cut, a truncated or malformed stream ends the client's stream with a
        well-formed error event (never a retry) and counts as the target's gateway failure. With a ``translator``,
        the SSE events go to the client as Ollama NDJSON lines."""
        loop = asyncio.get_running_loop()
        failure = _failure_of(upstream.status)
        if translator is not None:
            headers["Content-Type"] = "application/x-ndjson"
        out = translator.feed if translator is not None else (lambda events: events)
        client_kind = "ndjson" if translator is not None else framer.kind
        response = await _start_stream(request, upstream.status, headers)
        ttft = loop.time() - arrived_at
        error = None
        tap = UsageTap(framer.kind)  # the last event's token counts, for measured speed
        tap.feed(first)
        framer.on_object = tap.see  # later events: the objects the framer decodes to check them, not decoded again
        idle = _IdleDeadline(loop, self.idle_timeout_s)
        try:
            if framer.done:  # the last event goes out now: a client that closes after it has its answer
                _answer_complete(request, upstream.status, tap.usage, on_complete)
            if _read_to_the_end(framer, upstream.content):  # a short answer, whole in the first read
                eof = True
                await response.write_eof(out(first))
            else:
                await response.write(out(first))
            if on_first_byte is not None:
                on_first_byte(ttft)
            while not eof:
                try:
                    chunk = await idle.read(upstream.content)
                except TimeoutError:
                    error = f"{decision.target} sent nothing for {self.idle_timeout_s:g} s mid-stream"
                    break
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
                    error = f"{decision.target} failed mid-stream: {type(exc).__name__}"
                    break
                if chunk:
                    events = framer.feed(chunk)
                else:
                    eof, events = True, framer.finish()
                if events:
                    if framer.done:
                        _answer_complete(request, upstream.status, tap.usage, on_complete)
                        if _read_to_the_end(framer, upstream.content):  # the client's end leaves with them
                            await response.write_eof(out(events))
                            break
                    await response.write(out(events))
            if error is None and not framer.done:
                error = f"{decision.target} ended the stream before its last event"
        except FramingError as exc:
            error = f"{decision.target} sent a malformed stream: {exc}"
        except ConnectionResetError:  # the client went away (the usage it was sent, if any, stays the answer's)
            return RelayOutcome(response, upstream.status, ttft_s=ttft, error=_disconnected(request),
                                failure=failure, usage=tap.usage)
        finally:
            idle.close()
        try:
            if error is not None:  # bytes already reached the client: end the stream with an error event
                failure = "gateway"
                await response.write(_stream_error_event(client_kind, error))
            await response.write_eof()
        except ConnectionResetError:
            return RelayOutcome(response, upstream.status, ttft_s=ttft, error=error or _disconnected(request),
                                failure=failure, usage=tap.usage)
        return RelayOutcome(response, upstream.status, ttft_s=ttft, error=error, failure=failure, usage=tap.usage)


class _IdleDeadline:
    """The idle timeout of a stream's reads: each read must end within ``timeout_s`` of its start.

    ``asyncio.timeout`` around every read arms and cancels a timer per chunk, a tenth of the balancer's CPU on a
    streamed answer (one chunk per token). Here one timer is armed per ``timeout_s``: when it fires during a read
    that has lasted ``timeout_s`` the read is cancelled, else it is armed again for the current read's deadline.
    Time spent writing to the client between reads never counts (a slow client is not the target's stall).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self._loop, self._timeout_s = loop, timeout_s
        self._read_started: float | None = None
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def read(self, content: aiohttp.StreamReader) -> bytes:
        """``content.readany()``; TimeoutError when it lasts ``timeout_s``."""
        self._read_started = self._loop.time()
        if self._timer is None:
            self._task = asyncio.current_task()
            self._timer = self._loop.call_at(self._read_started + self._timeout_s, self._check)
        try:
            return await content.readany()
        except asyncio.CancelledError:
            if self._expired:  # this deadline's cancellation, not the handler's: undo it, as asyncio.timeout does
                self._expired = False
                self._task.uncancel()
                raise TimeoutError from None
            raise
        finally:
            self._read_started = None

    def _check(self) -> None:
        started = self._read_started
        if started is not None and self._loop.time() - started >= self._timeout_s:
            self._timer, self._expired = None, True
            self._task.cancel()
            return
        base = self._loop.time() if started is None else started
        self._timer = self._loop.call_at(base + self._timeout_s, self._check)

    def close(self) -> None:
        """Disarm the timer (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _read_to_the_end(framer: StreamFramer, content: aiohttp.StreamReader) -> bool:
    """The events just framed end the upstream's stream: its last event went by, no event is open and the upstream's
    end was read with them (usually: both come in one read), so nothing can follow and the client's end goes in the
    same send as those events (``write_eof(events)``: one send instead of two)."""
    return framer.done and not framer.pending and content.at_eof()


def _disconnected(request: web.Request) -> str | None:
    """The error of a stream whose client went away: none once its last event was on its way (the client has its
    answer, as protocol.answer_complete says for logs and spans), else "client disconnected"."""
    return None if ANSWER_COMPLETE in request else "client disconnected"


def _answer_complete(request: web.Request, status: int, usage, on_complete: Callable[[], None] | None) -> None:
    """A stream's last event is about to go to the client: record its status and usage on the client's request (a
    client that closes once it reads it has its answer: protocol.answer_complete, spans.py) and, the first time,
    call ``on_complete``."""
    first = ANSWER_COMPLETE not in request
    request[ANSWER_COMPLETE], request[ANSWER_USAGE] = status, usage
    if first and on_complete is not None:
        on_complete()


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


async def _read_until_first_event(upstream: aiohttp.ClientResponse
                                  ) -> tuple[StreamFramer | None, bytes, bytes, bool]:
    """Read the target's answer up to what the client's first byte will be: ``(framer, first, data, eof)``.

    A whole answer (not SSE or NDJSON): ``(None, b"", body, False)``. A stream: its framer, its first whole event
    ``first`` (empty when the stream ended before one: ``eof`` True). Raises what the read raises (FramingError,
    aiohttp.ClientError, OSError); the caller's first-byte timeout applies around it.
    """
    kind = stream_kind(upstream.headers.get("Content-Type", ""))
    if kind is None:
        return None, b"", await upstream.read(), False
    framer = StreamFramer(kind)
    first, eof = b"", False
    while not first and not eof:  # the client's first byte is the target's first whole event
        chunk = await upstream.content.readany()
        if chunk:
            first = framer.feed(chunk)
        else:
            eof, first = True, framer.finish()
    return framer, first, b"", eof


class _StreamedAnswer(web.StreamResponse):
    """A streamed answer whose headers leave with its first event, in one send instead of two: aiohttp's own switch
    to buffered headers (a private class attribute, which its web.Response sets; an aiohttp without it sends them at
    ``prepare``, as before). The relay writes the first event right after ``prepare``, so nothing waits for them."""

    _send_headers_immediately = False


async def _start_stream(request: web.Request, status: int, headers: dict) -> web.StreamResponse:
    request[STREAM_STARTED] = True
    response = _StreamedAnswer(status=status, headers=headers)
    await response.prepare(request)
    return response


def _stream_error_event(kind: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    if kind == "ndjson":
        return (json.dumps({"error": message, "done": True}) + "\n").encode()
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
