"""Closed-loop clients for a chaos run that behave as real ones: DNS through BIND, one retry on a connection error.

Each region has ``clients`` clients; each takes the next session of its region (bench/replay/workload.py
``trace_sessions``) and sends its turns one after another (``think_s`` apart), streamed ``/v1/completions``, until
the run's send window closes. Each client is one user's HTTP client: it resolves the service name through BIND from
its region's source address (its region's view; answers kept for their TTL) and keeps its connections alive, so a
connection it holds keeps reaching the balancer it reached (as an SDK's connection pool does) while new connections
follow DNS. When an attempt fails to connect, or the connection drops before any response byte, it forgets its DNS
answers, resolves the name again and retries once. Each
attempt carries its own ``X-Request-Id`` (``<id>`` and ``<id>.retry``), which the balancer logs and passes on, so a
retry is never mistaken for a duplicate execution.

A request's outcome, as its client sees it (:class:`Outcome` values):

- ``ok``: 200, a stream with one completion id, one ``finish_reason`` and one ``[DONE]``;
- ``error_event``: the stream ended with a ``data: {"error": ...}`` chunk (its replica or balancer died mid-stream);
- ``http_<status>``: an error answer in the API's shape (``{"error": {"message": ...}}``);
- ``unreachable``: both attempts failed to connect (a visible error: the client knows it was not served);
- ``stream_cut``: the connection broke after the response began (an incomplete chunked body: the balancer the
  client was connected to died); the client's HTTP library raises, so this too is visible;
- ``lost``: anything else: a timeout, a stream cut without an error, an unparseable body;
- ``duplicated``: a stream with two completion ids, two ``finish_reason`` or two ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import aiohttp

from bench.dns.resolver import SourceResolver
from bench.replay.workload import Request

__all__ = ["Attempt", "Record", "ClientPlan", "run_clients"]


@dataclass
class Attempt:
    """One HTTP attempt: its X-Request-Id, the address dialled, the balancer's request id, the error if any."""

    request_id: str
    address: str = ""
    balancer_request_id: str | None = None
    error: str | None = None


@dataclass
class Record:
    """One client request (times in s since the run's start; ``ttft_s`` from its first attempt)."""

    id: str
    region: str
    session_id: str
    sent_s: float
    ended_s: float = 0.0
    ttft_s: float | None = None
    headers_s: float | None = None
    outcome: str = "lost"
    status: int | None = None
    response_id: str | None = None
    error: str | None = None
    attempts: list[Attempt] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)


@dataclass
class ClientPlan:
    """Where clients go: BIND's address and port, the service name and the balancers' port; ``dial`` maps a DNS
    answer to the address to connect to; ``sources`` gives each region's client source address."""

    dns_server: str
    dns_port: int
    name: str
    port: int
    dial: Callable[[str], str]
    sources: dict[str, str]
    model: str
    request_timeout_s: float = 60.0


class _ConnectFailed(Exception):
    """The attempt failed before any response byte (worth one retry)."""


def classify(status: int, body: bytes) -> tuple[str, str | None, str | None]:
    """(outcome, completion id, error text) of one response from its status and raw body."""
    if status != 200:
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return "lost", None, f"HTTP {status} with a body that is not an error object"
        message = error.get("message") if isinstance(error, dict) else error
        return (f"http_{status}", None, str(message)[:300]) if message else ("lost", None, f"HTTP {status}")
    ids, finishes, done, error = [], 0, 0, None
    for line in body.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done += 1
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return "lost", None, "malformed SSE data"
        if "error" in chunk:
            err = chunk["error"]
            error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            continue
        if chunk.get("id") not in ids:
            ids.append(chunk.get("id"))
        finishes += sum(1 for c in chunk.get("choices", []) if c.get("finish_reason"))
    first = ids[0] if ids else None
    if len(ids) > 1 or finishes > 1 or done > 1:
        return "duplicated", first, f"{len(ids)} completion ids, {finishes} finish reasons, {done} [DONE]"
    if error is not None:
        return "error_event", first, error
    return ("ok", first, None) if done == 1 and finishes == 1 else ("lost", first, "stream ended without [DONE]")


class _Resolver(SourceResolver):
    """SourceResolver whose answers go through ``dial`` (see ClientPlan), and whose cache can be dropped."""

    def __init__(self, plan: ClientPlan, region: str):
        super().__init__(plan.dns_server, plan.dns_port, source=plan.sources[region], timeout_s=1.0)
        self.dial = plan.dial
        self.last = ""

    async def addresses(self, host: str, family: int = socket.AF_INET) -> list[str]:
        """The server's answer (cached for its TTL), each address mapped by ``dial``."""
        found = [self.dial(a) for a in await super().addresses(host, family)]
        self.last = found[0] if found else ""
        return found

    def forget(self) -> None:
        """Drop every cached answer: the next connection asks the DNS server again."""
        self._cache.clear()


async def _attempt(http: aiohttp.ClientSession, plan: ClientPlan, rec: Record, request: Request, attempt: Attempt,
                   t0: float) -> None:
    body = {"model": plan.model, "prompt": request.prompt, "max_tokens": request.output_tokens,
            "ignore_eos": True, "stream": True, "user": request.session_id}
    url = f"http://{plan.name.rstrip('.')}:{plan.port}/v1/completions"
    headers = {"X-Request-Id": attempt.request_id, "X-Session-ID": request.session_id}
    try:
        async with http.post(url, json=body, headers=headers) as resp:
            attempt.address = _peer(resp)
            rec.status = resp.status
            rec.headers_s = time.monotonic() - t0
            attempt.balancer_request_id = resp.headers.get("X-SkyLB-Request-Id")
            chunks = []
            async for line in resp.content:
                if rec.ttft_s is None and line.startswith(b"data: ") and b'"text"' in line:
                    rec.ttft_s = time.monotonic() - t0 - rec.sent_s
                chunks.append(line)
            rec.outcome, rec.response_id, rec.error = classify(resp.status, b"".join(chunks))
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, OSError) as exc:
        if rec.headers_s is None:
            raise _ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        # The connection broke mid-response (the process serving it died): the client's HTTP library raises, so
        # the client knows it was not served; a body that ends cleanly but short is classified (lost) instead.
        rec.outcome, rec.error = "stream_cut", f"{type(exc).__name__} after the response began: {exc}"[:300]


async def send(http: aiohttp.ClientSession, resolver: _Resolver, plan: ClientPlan, request: Request, *,
               run_id: str, t0: float) -> Record:
    """Send one request (with at most one retry, see the module docstring); never raises Exception."""
    rec = Record(f"{run_id}-{request.id}", request.region, request.session_id, time.monotonic() - t0)
    try:
        async with asyncio.timeout(plan.request_timeout_s):
            for suffix in ("", ".retry"):
                attempt = Attempt(rec.id + suffix)
                rec.attempts.append(attempt)
                try:
                    await _attempt(http, plan, rec, request, attempt, t0)
                    break
                except _ConnectFailed as exc:
                    attempt.error, attempt.address = str(exc)[:300], attempt.address or resolver.last
                    rec.outcome, rec.error = "unreachable", attempt.error
                    resolver.forget()  # the retry resolves the name again
    except TimeoutError:
        rec.outcome, rec.error = "lost", f"no answer within {plan.request_timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - a client bug must show in a record, not vanish
        rec.outcome, rec.error = "lost", f"client error {type(exc).__name__}: {exc}"[:300]
    rec.ended_s = time.monotonic() - t0
    return rec


async def run_clients(plan: ClientPlan, sessions: Sequence[Sequence[Request]], clients: dict[str, int], *,
                      run_id: str, t0: float, stop_s: float) -> list[Record]:
    """Drive the closed loop until ``stop_s`` s after ``t0`` (monotonic); returns every request's record. A client
    sends nothing after ``stop_s`` and returns when its request in flight ends (bounded by the request timeout)."""
    pools: dict[str, deque] = defaultdict(deque)
    for s in sessions:
        if s:
            pools[s[0].region].append(list(s))
    records: list[Record] = []

    async def client(region: str) -> None:
        # One HTTP client per user, as an SDK instance: its own pool of keep-alive connections to the service name
        # (a live connection keeps going to the balancer it reached, whatever DNS answers now) and its own resolver.
        resolver = _Resolver(plan, region)
        connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, limit=0,
                                         local_addr=(plan.sources[region], 0))
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=3.0)) as http:
            while pools[region] and time.monotonic() - t0 < stop_s:
                for request in pools[region].popleft():
                    if time.monotonic() - t0 >= stop_s:
                        return
                    records.append(await send(http, resolver, plan, request, run_id=run_id, t0=t0))
                    await asyncio.sleep(request.think_s)

    await asyncio.gather(*(client(r) for r, n in clients.items() for _ in range(n)))
    return records


def _peer(resp: aiohttp.ClientResponse) -> str:
    """The address the response came from (the balancer this attempt reached)."""
    peer = resp.connection.transport.get_extra_info("peername") if resp.connection else None
    return peer[0] if peer else ""
