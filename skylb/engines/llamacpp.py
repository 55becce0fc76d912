"""llama.cpp (``llama-server``): pending = ``llamacpp:requests_deferred``, running = ``llamacpp:requests_processing``,
both from ``GET /metrics`` (one unlabelled sample each).

Sources: the llama.cpp server README (``tools/server/README.md``, "GET /metrics"; checked on a real llama-server
with ``-np 4 --metrics``: 8 concurrent requests gave requests_processing 4 and requests_deferred 4);
ggml-org/llama.cpp ``tools/server``:
``/metrics`` answers 501 "This server does not support metrics endpoint. Start it with `--metrics`" when metrics
are off, and while the model loads every route but /models, /v1/models and /api/tags answers 503
``{"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}`` (so /metrics alone tells
"loading" apart from "down" in one request).
"""

from __future__ import annotations

from skylb.engines.base import EngineAdapter, ProbeResult, sum_gauges
from skylb.engines.fetch import FetchError, get, json_or_none

__all__ = ["LlamaCppAdapter", "DEFERRED", "PROCESSING"]

DEFERRED = "llamacpp:requests_deferred"
PROCESSING = "llamacpp:requests_processing"
#: KV cache usage, 0-1: exported by older llama-server builds only (removed with the unified KV cache in 2025).
KV_USAGE = "llamacpp:kv_cache_usage_ratio"
#: base URL -> the server's parallel slots (``GET /props`` -> ``total_slots``); they never change while it runs.
_SLOTS_BY_URL: dict[str, int] = {}


def _is_loading(text: str) -> bool:
    body = json_or_none(text)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("message") == "Loading model"


class LlamaCppAdapter(EngineAdapter, engine="llamacpp"):
    """Probe a llama-server through its Prometheus endpoint (it must run with ``--metrics``)."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            answer = await get(session, url, "/metrics", timeout_s=timeout_s)
        except FetchError as exc:
            return ProbeResult(False, error=exc.reason)
        if answer.status == 503 and _is_loading(answer.text):
            return ProbeResult(False, error="loading model")
        if answer.status in (404, 501):
            return ProbeResult(False, error=f"/metrics is disabled (HTTP {answer.status}): start llama-server "
                                            "with --metrics")
        if answer.status != 200:
            return ProbeResult(False, error=f"/metrics answered HTTP {answer.status}")
        try:
            values = sum_gauges(answer.text, (DEFERRED, PROCESSING, KV_USAGE))
        except ValueError as exc:
            return ProbeResult(False, error=f"malformed /metrics: {exc}"[:200])
        if DEFERRED not in values:
            return ProbeResult(False, error=f"/metrics has no {DEFERRED}")
        running = values.get(PROCESSING)
        # llama-server reports 0 deferred while every slot is busy, so "pending == 0" alone lets one more request
        # in to wait there; knowing the slot count, the balancer sees the batch is full before that happens.
        if url not in _SLOTS_BY_URL:
            try:
                props = await get(session, url, "/props", timeout_s=timeout_s)
                slots = (json_or_none(props.text) or {}).get("total_slots") if props.status == 200 else None
                if isinstance(slots, int) and slots > 0:
                    _SLOTS_BY_URL[url] = slots
            except FetchError:
                pass  # asked again at the next probe
        return ProbeResult(True, pending=int(values[DEFERRED]), running=None if running is None else int(running),
                           slots=_SLOTS_BY_URL.get(url), kv_usage=values.get(KV_USAGE))
