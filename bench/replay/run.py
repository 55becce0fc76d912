"""Replay a workload (Mooncake trace or synthetic conversations) against running balancers, one per region.

`skylb replay --balancer us=http://127.0.0.1:8081 --balancer eu=http://127.0.0.1:8082 ...` sends each request to
its own region's balancer (``POST /v1/completions``, streamed, OpenAI API) at its arrival time (open loop), or
``think_s`` after the previous turn of its conversation completed (closed loop, synthetic conversations), records
TTFT, end-to-end latency, usage and the balancer's routing headers, and writes the records and the report
(bench/replay/report.py) as JSON. Every request ends in exactly one record: completed, or failed with the reason.

:func:`replay_sessions` drives closed-loop clients instead: a fixed number of clients per region, each running its
region's sessions (e.g. the trace's, bench/replay/workload.py ``trace_sessions``) one request at a time, so the offered
load follows what the system serves rather than a clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import aiohttp
from tqdm import tqdm

from bench.sim.ideal import replay_ideal_hit_rate
from bench.replay.report import RequestRecord, build_report, format_table, write_json
from bench.replay.workload import (THINK_S, Request, TraceError, WorkloadConfig, describe, load_workload,
                            workload_settings)
from skylb.config import ConfigError, load_config

__all__ = [
    "ROUTE_HEADER",
    "SERVED_BY_HEADER",
    "SESSION_HEADER",
    "ReplayError",
    "ReplayResult",
    "parse_balancers",
    "fetch_model",
    "send_request",
    "default_deadline_s",
    "replay",
    "replay_sessions",
    "replay_and_report",
    "add_arguments",
    "main",
]

ROUTE_HEADER = "X-SkyLB-Route"
SERVED_BY_HEADER = "X-SkyLB-Served-By"
RULE_HEADER = "X-SkyLB-Rule"
SESSION_HEADER = "X-Session-ID"
#: How much of a failed response's body goes into the record (characters).
ERROR_BODY_CHARS = 500
MODELS_TIMEOUT_S = 10.0


class ReplayError(RuntimeError):
    """The replay cannot start: a request's region has no balancer, or a balancer's model list is unreadable."""


@dataclass(slots=True)
class ReplayResult:
    """What :func:`replay` returns: one record per request (workload order) and the replay's wall time (s)."""

    records: list[RequestRecord]
    wall_s: float


def parse_balancers(specs: Iterable[str]) -> dict[str, str]:
    """``["us=http://h:1", ...]`` -> ``{"us": "http://h:1"}`` (trailing "/" dropped); ValueError for a bad spec."""
    out: dict[str, str] = {}
    for spec in specs:
        region, sep, url = spec.partition("=")
        region, url = region.strip(), url.strip().rstrip("/")
        if not sep or not region or not url.startswith(("http://", "https://")):
            raise ValueError(f"--balancer {spec!r}: expected REGION=http://HOST:PORT")
        if region in out:
            raise ValueError(f"--balancer: region {region!r} given twice")
        out[region] = url
    if not out:
        raise ValueError("at least one --balancer REGION=URL is needed")
    return out


async def fetch_model(session: aiohttp.ClientSession, base_url: str, *, timeout_s: float = MODELS_TIMEOUT_S) -> str:
    """The first model id of ``GET {base_url}/v1/models``; ReplayError when the list cannot be had."""
    url = f"{base_url}/v1/models"
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise ReplayError(f"GET {url}: HTTP {resp.status}")
                data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except ReplayError:
        raise
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ReplayError(f"cannot read the model list at {url}: {type(exc).__name__}: {exc}") from exc


class _Stream:
    """Running state of one streamed response: TTFT, usage, received words, error, whether [DONE] came, and the
    completion's ``id``."""

    __slots__ = ("start", "ttft_s", "usage", "words", "error", "done", "response_id")

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft_s: float | None = None
        self.usage: dict | None = None
        self.words = 0
        self.error: str | None = None
        self.done = False
        self.response_id: str | None = None

    def feed(self, obj: Any, now: float) -> None:
        """Apply one decoded completion object (an SSE ``data:`` payload or a whole non-streamed body)."""
        if not isinstance(obj, dict):
            self.error = f"unexpected chunk: {str(obj)[:ERROR_BODY_CHARS]}"
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:ERROR_BODY_CHARS]
            return
        for choice in obj.get("choices") or ():
            text = choice.get("text") if isinstance(choice, dict) else None
            if text:
                if self.ttft_s is None:
                    self.ttft_s = now - self.start
                self.words += len(text.split())  # one word = one token (workload.py token convention)
        if obj.get("usage"):
            self.usage = obj["usage"]


async def _error_body(resp: aiohttp.ClientResponse) -> str:
    """A short message from a non-2xx body: the OpenAI-shaped ``error.message`` when there is one, else the text."""
    raw = (await resp.content.read(64 * 1024)).decode("utf-8", "replace")
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)[:ERROR_BODY_CHARS]
    except (ValueError, KeyError, TypeError):
        return raw.strip()[:ERROR_BODY_CHARS]


async def _read_response(resp: aiohttp.ClientResponse, stream: _Stream, loop: asyncio.AbstractEventLoop) -> None:
    """Read a 2xx response into ``stream``: SSE lines until ``[DONE]`` or an error chunk, or one JSON body."""
    if "text/event-stream" not in resp.headers.get("Content-Type", "text/event-stream"):
        stream.feed(await resp.json(content_type=None), loop.time())
        stream.done = stream.error is None
        return
    async for raw in resp.content:  # one line at a time
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            stream.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            stream.error = f"malformed SSE data: {payload[:ERROR_BODY_CHARS]}"
            return
        stream.feed(obj, loop.time())
        if stream.error is not None:
            return  # an error chunk ends the request (vLLM sends it mid-stream, e.g. on an engine failure)


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    request: Request,
    *,
    timeout_s: float,
    clock_zero: float,
) -> RequestRecord:
    """Send one request to ``{base_url}/v1/completions`` (streamed) and return its record; never raises Exception.

    ``timeout_s`` bounds the whole request (s); ``clock_zero`` is the loop time the replay started at, so that
    ``sent_s`` is relative to it. Failed: a non-2xx status, an SSE ``data: {"error": ...}`` chunk, a stream that
    ends without ``[DONE]``, a connection error, or the timeout.
    """
    loop = asyncio.get_running_loop()
    record = RequestRecord(
        id=request.id,
        region=request.region,
        session_id=request.session_id,
        turn=request.turn,
        prompt_tokens=request.prompt_tokens,
    )
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": request.session_id,
    }
    start = loop.time()
    record.sent_s = start - clock_zero
    stream = _Stream(start)
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                f"{base_url}/v1/completions", json=body, headers={SESSION_HEADER: request.session_id}
            ) as resp:
                record.status = resp.status
                record.route = resp.headers.get(ROUTE_HEADER)
                record.served_by = resp.headers.get(SERVED_BY_HEADER)
                record.rule = resp.headers.get(RULE_HEADER)
                if 200 <= resp.status < 300:
                    await _read_response(resp, stream, loop)
                    if stream.error is None and not stream.done:
                        stream.error = "stream ended without [DONE]"
                else:
                    stream.error = f"HTTP {resp.status}: {await _error_body(resp)}"
    except TimeoutError:
        stream.error = f"timeout after {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
    except Exception as exc:  # noqa: BLE001 - a client bug must fail one record, not lose it
        stream.error = f"client error: {type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
    record.e2e_ms = (loop.time() - start) * 1000.0
    record.ttft_ms = None if stream.ttft_s is None else stream.ttft_s * 1000.0
    record.error = stream.error
    record.response_id = stream.response_id
    usage = stream.usage or {}
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.cached_tokens = details["cached_tokens"]
    completion = usage.get("completion_tokens")
    record.completion_tokens = completion if isinstance(completion, int) else stream.words
    return record


def default_deadline_s(requests: Iterable[Request], request_timeout_s: float) -> float:
    """A replay deadline (s after start) every request can meet: the last arrival plus, for the longest
    closed-loop chain of n turns, n x (request timeout + the longest think time), plus 30 s of slack."""
    requests = list(requests)
    by_id = {r.id: r for r in requests}
    depth: dict[str, int] = {}  # request id -> turns in its chain up to and including it
    for r in requests:
        n, cur, steps = 0, r, 0
        while cur is not None and steps <= len(requests):  # bounded: an `after` cycle cannot loop forever
            if cur.id in depth:
                n += depth[cur.id]
                break
            n, steps = n + 1, steps + 1
            cur = by_id.get(cur.after) if cur.after else None
        depth[r.id] = n
    last = max((r.arrival_s for r in requests), default=0.0)
    longest = max(depth.values(), default=1)
    return last + longest * (request_timeout_s + max(THINK_S[1], max((r.think_s for r in requests), default=0))) + 30


def _balancer_for(urls: list[str], request_id: str) -> str:
    """One of a region's balancer URLs for a request, fixed by its id (CRC-32, the same in every run)."""
    return urls[0] if len(urls) == 1 else urls[zlib.crc32(request_id.encode()) % len(urls)]


async def replay(
    requests: Iterable[Request],
    balancers: Mapping[str, str | Sequence[str]],
    *,
    model: str | None = None,
    request_timeout_s: float = 300.0,
    deadline_s: float | None = None,
    progress: bool | None = None,
    connector_for: Callable[[str], aiohttp.BaseConnector] | None = None,
    api_key: str | None = None,
) -> ReplayResult:
    """Replay ``requests`` against ``balancers`` ({region: base URL, or a list of the region's balancers' URLs});
    returns one record per request. With several balancers in a region each request goes to one of them by a hash of
    its id, so a conversation's turns land on different balancers, as when DNS answers with every balancer of the
    region and clients resolve per connection (the hard case for prefix locality).

    Open loop: a request is sent at ``arrival_s`` s after the start; a closed-loop turn (``after`` set, and that
    request in the workload) ``think_s`` s after its predecessor ended, completed or failed. ``model``: the model
    name to send; None asks each region's balancer (``GET /v1/models``, first id). ``request_timeout_s`` bounds
    each request, ``deadline_s`` the whole replay (default :func:`default_deadline_s`); requests still in flight
    or unsent at the deadline get failed records. ``progress``: show a tqdm bar (None: only on a TTY).
    ``connector_for``: region -> a new connector for that region's clients, each region then with its own session
    (``skylb local --dns``: bench.dns.resolver.region_connector, which resolves the balancers' one service name from
    the region's source address; give it ``limit=0``); None: one connector without a pool limit for all regions.
    ``api_key``: sent as ``Authorization: Bearer`` on every request (balancers with client API keys).
    Raises ReplayError before sending anything when a region has no balancer or the model list is unreadable.
    """
    requests = list(requests)
    missing = sorted({r.region for r in requests} - set(balancers))
    if missing:
        raise ReplayError(f"requests for region(s) {', '.join(missing)} but no --balancer for them")
    ids = {r.id for r in requests}
    if len(ids) != len(requests):
        raise ReplayError("request ids are not unique")
    if not requests:
        return ReplayResult([], 0.0)
    children: dict[str, list[Request]] = defaultdict(list)
    roots = []
    for r in requests:
        (children[r.after] if r.after in ids and r.after != r.id else roots).append(r)
    if deadline_s is None:
        deadline_s = default_deadline_s(requests, request_timeout_s)
    if progress is None:
        progress = sys.stderr.isatty()

    records: dict[str, RequestRecord] = {}
    in_flight: dict[str, float] = {}  # request id -> sent_s, for the records of requests cut by the deadline
    all_done = asyncio.Event()
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    # No pool limit (open loop: a full pool would delay sends and distort arrival times); no aiohttp total
    # timeout, because send_request bounds each request itself.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, request_timeout_s))
    regions = sorted({r.region for r in requests})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with contextlib.AsyncExitStack() as stack:
        if connector_for is None:
            shared = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                           headers=headers)
            sessions = dict.fromkeys(regions, await stack.enter_async_context(shared))
        else:
            sessions = {g: await stack.enter_async_context(
                aiohttp.ClientSession(connector=connector_for(g), timeout=timeout, headers=headers))
                for g in regions}
        urls = {g: [balancers[g]] if isinstance(balancers[g], str) else list(balancers[g]) for g in regions}
        models = {g: model or await fetch_model(sessions[g], urls[g][0]) for g in regions}
        bar = tqdm(total=len(requests), desc="replay", unit="req", disable=not progress, file=sys.stderr)
        t0 = loop.time()

        def finish(record: RequestRecord) -> None:
            records[record.id] = record
            bar.update(1)
            if len(records) == len(requests):
                all_done.set()

        def spawn(request: Request, not_before: float) -> None:
            task = asyncio.create_task(run(request, not_before))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def run(request: Request, not_before: float) -> None:
            delay = max(not_before, t0 + request.arrival_s) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            in_flight[request.id] = loop.time() - t0
            record = await send_request(
                sessions[request.region], _balancer_for(urls[request.region], request.id), models[request.region],
                request,
                timeout_s=request_timeout_s, clock_zero=t0,
            )  # fmt: skip
            in_flight.pop(request.id, None)
            finish(record)
            ended = loop.time()
            for child in children.get(request.id, ()):
                spawn(child, ended + child.think_s)

        try:
            for r in roots:
                spawn(r, t0)
            try:
                await asyncio.wait_for(all_done.wait(), timeout=max(0.0, deadline_s))
            except TimeoutError:
                pass
            wall_s = loop.time() - t0
        finally:
            pending = list(tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for r in requests:
                if r.id not in records:
                    sent = in_flight.get(r.id)
                    why = "in flight" if sent is not None else "not sent"
                    finish(RequestRecord(r.id, r.region, r.session_id, r.turn, sent_s=sent,
                                         prompt_tokens=r.prompt_tokens,
                                         error=f"replay deadline of {deadline_s:g} s reached ({why})"))  # fmt: skip
            bar.close()
    return ReplayResult([records[r.id] for r in requests], wall_s)


async def replay_sessions(
    sessions: Sequence[Sequence[Request]],
    clients: Mapping[str, int],
    balancers: Mapping[str, str],
    *,
    model: str,
    request_timeout_s: float = 300.0,
    issue_s: float | None = None,
    deadline_s: float | None = None,
    ramp_s: float = 0.0,
    progress: bool | None = None,
) -> ReplayResult:
    """Closed-loop clients: ``clients[region]`` clients per region, each with at most one request in flight.

    A client takes the next session of its region (in ``sessions`` order; a session's region is its first
    request's) and sends the session's requests one after another, each ``think_s`` after the client's previous
    request ended (completed or failed; the client's very first request goes without a pause), then takes the next
    session, until its region has none left or, with ``issue_s``, until ``issue_s`` s after the start: a client
    sends nothing later than that and stops when its request in flight ends, so a run of fixed length measures what
    a system serves in it (the requests not sent by then are left out of the result, not failed). Client k of a
    region's n starts ``ramp_s * k / n`` s after the start, so the clients do not all arrive in the same
    millisecond. Which client runs a session depends on timing, but every system is sent the same sessions in the
    same order per region, and the offered load is closed: a system that serves faster is sent more per second (an
    open-loop replay fixes the rate instead, so its throughput only echoes the offered load).

    ``balancers``: region -> the base URL that region's clients call. ``request_timeout_s`` bounds each request,
    ``deadline_s`` the whole replay (default: ``issue_s`` plus one request timeout, or without ``issue_s`` every
    client's share of requests plus the longest session, at the request timeout and the longest think time each);
    requests in flight at the deadline get failed records, and so do unsent ones when there is no ``issue_s``.
    Returns the records of the requests sent (all of them without ``issue_s``), in ``sessions`` order, and the
    wall time until the last client stopped (s). Raises ReplayError before sending anything when a region with
    sessions has no balancer or no client, a session mixes regions, or request ids repeat.
    """
    sessions = [list(s) for s in sessions if s]
    requests = [r for s in sessions for r in s]
    if len({r.id for r in requests}) != len(requests):
        raise ReplayError("request ids are not unique")
    pools: dict[str, deque[list[Request]]] = defaultdict(deque)
    for s in sessions:
        if any(r.region != s[0].region for r in s):
            raise ReplayError(f"session {s[0].session_id} mixes regions")
        pools[s[0].region].append(s)
    missing = sorted(g for g in pools if g not in balancers or clients.get(g, 0) < 1)
    if missing:
        raise ReplayError(f"sessions for region(s) {', '.join(missing)} but no balancer or no client there")
    if not requests:
        return ReplayResult([], 0.0)
    if deadline_s is None:
        deadline_s = _sessions_deadline_s(sessions, clients, request_timeout_s, issue_s=issue_s, ramp_s=ramp_s)
    if progress is None:
        progress = sys.stderr.isatty()

    records: dict[str, RequestRecord] = {}
    in_flight: dict[str, float] = {}  # request id -> sent_s, for the records of requests cut by the deadline
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, request_timeout_s))
    bar = tqdm(total=None if issue_s else len(requests), desc="replay", unit="req", disable=not progress,
               file=sys.stderr)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        t0 = loop.time()
        stop_at = math.inf if issue_s is None else t0 + issue_s

        async def client(region: str, k: int, n: int) -> None:
            await asyncio.sleep(ramp_s * k / n)
            first = True
            while pools[region]:
                for request in pools[region].popleft():
                    if not first and request.think_s > 0:
                        await asyncio.sleep(request.think_s)
                    first = False
                    if loop.time() >= stop_at:
                        return
                    in_flight[request.id] = loop.time() - t0
                    record = await send_request(http, balancers[region], model, request,
                                                timeout_s=request_timeout_s, clock_zero=t0)
                    in_flight.pop(request.id, None)
                    records[record.id] = record
                    bar.update(1)

        tasks = [asyncio.create_task(client(g, k, clients[g])) for g in pools for k in range(clients[g])]
        try:
            await asyncio.wait(tasks, timeout=max(0.0, deadline_s))
            wall_s = loop.time() - t0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()
    for r in requests:
        sent = in_flight.get(r.id)
        if r.id not in records and (sent is not None or issue_s is None):
            why = "in flight" if sent is not None else "not sent"
            records[r.id] = RequestRecord(r.id, r.region, r.session_id, r.turn, sent_s=sent,
                                          prompt_tokens=r.prompt_tokens,
                                          error=f"replay deadline of {deadline_s:g} s reached ({why})")
    return ReplayResult([records[r.id] for r in requests if r.id in records], wall_s)


def _sessions_deadline_s(sessions: list[list[Request]], clients: Mapping[str, int], request_timeout_s: float, *,
                         issue_s: float | None, ramp_s: float) -> float:
    """The default deadline of :func:`replay_sessions` (s): one request timeout (and think time) after the send
    window, or without one, every client's share of the requests plus the longest session at that much each."""
    requests = [r for s in sessions for r in s]
    longest_think = max(max(r.think_s for r in requests), THINK_S[1])
    if issue_s is not None:
        return issue_s + longest_think + request_timeout_s + 30.0
    share = -(-len(requests) // sum(clients.get(g, 0) for g in {s[0].region for s in sessions}))
    return ramp_s + (share + max(len(s) for s in sessions)) * (request_timeout_s + longest_think) + 30.0


async def replay_and_report(
    cfg: WorkloadConfig,
    balancers: Mapping[str, str],
    *,
    model: str | None = None,
    deadline_s: float | None = None,
    progress: bool | None = None,
    out: str | Path | None = None,
    base_dir: str | Path | None = None,
    connector_for: Callable[[str], aiohttp.BaseConnector] | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Load the workload of ``cfg`` for the balancers' regions, replay it, build the report, write it to ``out``.

    Returns the JSON document: ``{"workload": {"summary", "config"}, "balancers", "report", "records"}``
    (report: :func:`bench.replay.report.build_report` plus ``ideal_prefix_hit_rate``, the trace window's ideal from
    :func:`bench.sim.ideal.replay_ideal_hit_rate`, None for a closed-loop workload; records:
    :meth:`RequestRecord.to_dict`). ``connector_for``, ``api_key``: as in :func:`replay`. Used by `skylb replay` and by
    `skylb local`. Raises TraceError, ValueError or
    ReplayError before anything is sent.
    """
    requests = load_workload(cfg, list(balancers), base_dir=base_dir)
    result = await replay(
        requests, balancers, model=model, request_timeout_s=cfg.request_timeout_s,
        deadline_s=deadline_s, progress=progress, connector_for=connector_for, api_key=api_key,
    )  # fmt: skip
    report = build_report(result.records, result.wall_s)
    report["ideal_prefix_hit_rate"] = replay_ideal_hit_rate(requests)
    doc = {
        "workload": {"summary": describe(requests), "config": cfg.model_dump()},
        "balancers": dict(balancers),
        "report": report,
        "records": [r.to_dict() for r in result.records],
    }
    if out is not None:
        write_json(doc, out)
    return doc


# ---------------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `skylb replay`; workload options override the ``workload`` section of the config."""
    parser.add_argument("--balancer", action="append", default=[], metavar="REGION=URL", required=True,
                        help="a region's balancer, e.g. us=http://127.0.0.1:8081 (repeat per region)")
    parser.add_argument("--config", metavar="FILE", help="deployment YAML (default: the embedded default config)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="PATH", help="Mooncake trace (JSONL); default: workload.trace of the config")
    src.add_argument("--synthetic", action="store_true", help="use the synthetic multi-turn conversations")
    parser.add_argument("--start-s", type=float, help="start of the trace window (trace time, s)")
    parser.add_argument("--window-s", type=float, help="length of the trace window (trace time, s)")
    parser.add_argument("--time-compression", type=float, help="divide trace time by this (2 = twice as fast)")
    parser.add_argument("--token-scale", type=float, help="scale prompt and output lengths (0.25 = a quarter)")
    parser.add_argument("--max-requests", type=int, help="send at most this many requests")
    parser.add_argument("--seed", type=int, help="seed of region assignment and synthetic text")
    parser.add_argument("--timeout-s", type=float, help="per-request timeout (s; default workload.request_timeout_s)")
    parser.add_argument("--deadline-s", type=float, help="deadline of the whole replay (s; default: derived)")
    parser.add_argument("--model", help="model name to send (default: first id of each balancer's /v1/models)")
    parser.add_argument("--out", metavar="PATH", help="where to write the JSON (default .skylb-run/replay-<time>.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")  # fmt: skip


def _workload_config(args: argparse.Namespace) -> tuple[WorkloadConfig, Path | None]:
    """The workload section of the config (given or embedded default) with the command line's overrides."""
    base_dir = None
    if args.config:
        cfg = workload_settings(load_config(args.config), source=args.config)
        base_dir = Path(args.config).resolve().parent
    else:
        try:
            cfg = workload_settings(load_config(None))
        except ConfigError:  # no embedded default shipped (yet): the built-in defaults are the same
            cfg = WorkloadConfig()
    overrides = {
        "trace": None if args.synthetic else args.trace,
        "start_s": args.start_s,
        "window_s": args.window_s,
        "time_compression": args.time_compression,
        "token_scale": args.token_scale,
        "max_requests": args.max_requests,
        "seed": args.seed,
        "request_timeout_s": args.timeout_s,
    }
    changed = {k: v for k, v in overrides.items() if v is not None or (k == "trace" and args.synthetic)}
    try:
        return WorkloadConfig.model_validate(cfg.model_dump() | changed), base_dir
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"workload options: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    """Run `skylb replay`: 0 when the replay ran and some request completed, 1 when none did, 2 on bad input."""
    try:
        balancers = parse_balancers(args.balancer)
        cfg, base_dir = _workload_config(args)
    except (ValueError, ConfigError) as exc:
        print(f"skylb replay: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f".skylb-run/replay-{time.strftime('%Y%m%d-%H%M%S')}.json")
    try:
        doc = asyncio.run(
            replay_and_report(
                cfg, balancers, model=args.model, deadline_s=args.deadline_s,
                progress=False if args.no_progress else None, out=out, base_dir=base_dir,
            )  # fmt: skip
        )
    except (TraceError, ValueError) as exc:
        print(f"skylb replay: {exc}", file=sys.stderr)
        return 2
    except ReplayError as exc:
        print(f"skylb replay: {exc}", file=sys.stderr)
        return 1
    print(doc["workload"]["summary"])
    print(format_table(doc["report"]))
    print(f"wrote {out}")
    total = doc["report"]["total"]
    return 0 if total["completed"] or not total["sent"] else 1
