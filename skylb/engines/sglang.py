"""SGLang: pending = ``sglang:num_queue_reqs`` from ``GET /metrics`` (summed over rank labels), else the JSON load
endpoints ``GET /v1/loads`` (``loads[].num_waiting_reqs``) and the legacy ``GET /get_load`` (a list of
``{"dp_rank", "num_reqs", "num_waiting_reqs", ...}``).

Sources: the SGLang documentation, "Production Metrics"; sgl-project/sglang ``python/sglang/srt/metrics/collector.py``
("sglang:num_queue_reqs: The number of requests in the waiting queue", labels ``model_name``, ``engine_type``,
``tp_rank``, ``pp_rank`` and ``dp_rank`` with data parallelism), ``entrypoints/v1_loads.py`` and
``entrypoints/http_server.py`` (``/get_load``). /metrics exists only with ``--enable-metrics``; /v1/loads only in
recent releases. The source that worked is remembered per URL, so a healthy replica costs one request a probe;
when it stops answering 200 the others are tried again. KV-cache usage and size come from /metrics
(``sglang:token_usage``, ``sglang:max_total_num_tokens``) or /v1/loads (``loads[].token_usage``,
``max_total_num_tokens``: ``managers/io_struct.py`` ``GetLoadsReqOutput``); /get_load has neither.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable

from skylb.engines.base import EngineAdapter, ProbeResult, gauges
from skylb.engines.fetch import FetchError, get, json_or_none

__all__ = ["SGLangAdapter", "WAITING", "RUNNING"]

WAITING = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
#: KV pool usage, 0-1 (collector.py: "sglang:token_usage: The token usage"); the fullest rank is taken.
KV_USAGE = "sglang:token_usage"
#: The KV pool's size in tokens (collector.py: "sglang:max_total_num_tokens"), per rank: the largest is taken.
KV_CAPACITY = "sglang:max_total_num_tokens"
#: The most output tokens SGLang reserves in its KV pool for a request it admits (``schedule_policy.py``
#: ``CLIP_MAX_NEW_TOKENS_ESTIMATION``, env ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, default 4096): ``PrefillAdder``
#: admits a request only while its prompt plus ``min(max_new_tokens, clip)`` fits beside the running batch's
#: reservations; a request without ``max_tokens`` gets the rest of the context (``Scheduler.handle_generate_request``),
#: so the clip.
OUTPUT_RESERVE_CLIP = 4096
#: The share of the running requests' remaining output (``max_new_tokens`` less tokens generated, clipped as above)
#: that ``PrefillAdder`` keeps reserved (collector.py: "sglang:new_token_ratio: The new token ratio"; recent
#: releases export it; the fullest rank is taken). It starts at ``init_new_token_ratio`` (0.7), falls towards
#: ``init x min_new_token_ratio_factor`` over ``new_token_ratio_decay_steps`` decode steps and rises again when the
#: engine retracts requests for want of KV memory (``global_config.py``, ``Scheduler.update_running_batch``).
NEW_TOKEN_RATIO = "sglang:new_token_ratio"
#: The ratio assumed when the engine does not export it: the floor it falls to on a busy engine without retractions
#: (0.7 x 0.14), so that an older SGLang's reserve is never priced above what it keeps.
NEW_TOKEN_RATIO_FLOOR = 0.098
#: HTTP statuses meaning "this server has no such endpoint" (FastAPI's 404 and 405).
_ABSENT = (404, 405)

#: url -> the source ("metrics", "loads", "get_load") that answered last; process-wide because the balancer
#: makes a new adapter object for every probe.
_SOURCE_BY_URL: dict[str, str] = {}

# A reader returns a ProbeResult (a load was read), None (this source is absent: try the next), or a string
# (the source answered, but wrongly: that is the probe's failure reason).
Reader = Callable[..., Awaitable["ProbeResult | str | None"]]


async def _from_metrics(session, url: str, timeout_s: float) -> ProbeResult | str | None:
    answer = await get(session, url, "/metrics", timeout_s=timeout_s)
    if answer.status in _ABSENT:
        return None
    if answer.status != 200:
        return f"/metrics answered HTTP {answer.status}"
    try:
        values, kv = gauges(answer.text, (WAITING, RUNNING), (KV_USAGE, KV_CAPACITY, NEW_TOKEN_RATIO))
    except ValueError as exc:
        return f"malformed /metrics: {exc}"[:200]
    if WAITING not in values:
        return None  # metrics on, but this gauge not (yet) exported: the JSON endpoints may still say
    running = values.get(RUNNING)
    capacity = kv.get(KV_CAPACITY)
    return ProbeResult(True, pending=int(values[WAITING]), running=None if running is None else int(running),
                       kv_usage=kv.get(KV_USAGE), kv_capacity_tokens=int(capacity) if capacity else None,
                       output_reserve_tokens=OUTPUT_RESERVE_CLIP,
                       output_reserve_ratio=min(1.0, max(0.0, kv.get(NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_FLOOR))))


def _sum_ranks(ranks: Any, path: str, *, running_of: Callable[[dict], int | None]) -> ProbeResult | str:
    """Sum ``num_waiting_reqs`` (and the running count) over a list of per-rank dicts."""
    if isinstance(ranks, dict):
        ranks = [ranks]
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return f"malformed {path} answer: expected a list of per-rank loads"
    pending, running = 0, 0
    for rank in ranks:
        waiting = rank.get("num_waiting_reqs")
        if type(waiting) is not int or waiting < 0:
            return f"malformed {path} answer: num_waiting_reqs is {waiting!r}"
        pending += waiting
        r = running_of(rank)
        running = None if r is None or running is None else running + r
    return ProbeResult(True, pending=pending, running=running)


async def _from_loads(session, url: str, timeout_s: float) -> ProbeResult | str | None:
    answer = await get(session, url, "/v1/loads", timeout_s=timeout_s)
    if answer.status in _ABSENT:
        return None
    if answer.status != 200:
        return f"/v1/loads answered HTTP {answer.status}"
    body = json_or_none(answer.text)
    loads = body.get("loads") if isinstance(body, dict) else None

    def running_of(rank: dict) -> int | None:
        value = rank.get("num_running_reqs")
        return value if type(value) is int else None

    result = _sum_ranks(loads, "/v1/loads", running_of=running_of)
    if isinstance(result, ProbeResult):
        _kv_from_loads(result, loads if isinstance(loads, list) else [loads])
    return result


def _number(value: Any) -> float | None:
    """``value`` when it is a finite JSON number (not a bool), else None."""
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    return None


def _kv_from_loads(result: ProbeResult, ranks: list[dict]) -> None:
    """Fill ``result``'s KV-cache fields from /v1/loads' ranks (``token_usage``: the fullest rank's;
    ``max_total_num_tokens``: the largest), as ``/metrics`` gives them, when every rank reports both; the engine's
    output reserve as there, its ratio at the floor (/v1/loads does not carry ``new_token_ratio``). SGLang serves
    /metrics only with ``--enable-metrics``; without it, this is where its KV cache is seen."""
    usages = [_number(rank.get("token_usage")) for rank in ranks]
    sizes = [_number(rank.get("max_total_num_tokens")) for rank in ranks]
    if not ranks or None in usages or None in sizes or max(sizes) <= 0:
        return
    result.kv_usage = max(usages)
    result.kv_capacity_tokens = int(max(sizes))
    result.output_reserve_tokens = OUTPUT_RESERVE_CLIP
    result.output_reserve_ratio = NEW_TOKEN_RATIO_FLOOR


async def _from_get_load(session, url: str, timeout_s: float) -> ProbeResult | str | None:
    answer = await get(session, url, "/get_load", timeout_s=timeout_s)
    if answer.status in _ABSENT:
        return None
    if answer.status != 200:
        return f"/get_load answered HTTP {answer.status}"

    def running_of(rank: dict) -> int | None:  # num_reqs counts running and waiting requests
        total, waiting = rank.get("num_reqs"), rank.get("num_waiting_reqs")
        return total - waiting if type(total) is int and type(waiting) is int else None

    return _sum_ranks(json_or_none(answer.text), "/get_load", running_of=running_of)


_READERS: dict[str, Reader] = {"metrics": _from_metrics, "loads": _from_loads, "get_load": _from_get_load}


class SGLangAdapter(EngineAdapter, engine="sglang"):
    """Probe an SGLang replica: /metrics, else /v1/loads, else /get_load (the one that worked is tried first)."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        remembered = _SOURCE_BY_URL.get(url)
        order = sorted(_READERS, key=lambda s: s != remembered)  # stable: the remembered one first
        for source in order:
            try:
                outcome = await _READERS[source](session, url, timeout_s)
            except FetchError as exc:
                return ProbeResult(False, error=exc.reason)
            if outcome is None:
                continue
            if isinstance(outcome, str):
                return ProbeResult(False, error=outcome)
            _SOURCE_BY_URL[url] = source
            return outcome
        _SOURCE_BY_URL.pop(url, None)
        return ProbeResult(False, error=f"no load signal: /metrics has no {WAITING} (start SGLang with "
                                        "--enable-metrics) and /v1/loads and /get_load are absent")
