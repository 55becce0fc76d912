"""Hugging Face TGI: pending = ``tgi_queue_size``, running = ``tgi_batch_current_size``, from ``GET /metrics``.

Sources: the TGI documentation, "Metrics" reference; huggingface/text-generation-inference ``router/src``: the
router's gauges ``tgi_queue_size`` (requests waiting for a batch) and ``tgi_batch_current_size`` (requests in the
running batch), unlabelled, exported by metrics-exporter-prometheus. Overload shows as 429 "Model is overloaded" on
requests, not in /metrics.
"""

from __future__ import annotations

from skylb.engines.base import EngineAdapter, ProbeResult, sum_gauges
from skylb.engines.fetch import FetchError, get

__all__ = ["TGIAdapter", "QUEUE", "BATCH"]

QUEUE = "tgi_queue_size"
BATCH = "tgi_batch_current_size"


class TGIAdapter(EngineAdapter, engine="tgi"):
    """Probe a TGI router through its Prometheus endpoint."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            answer = await get(session, url, "/metrics", timeout_s=timeout_s)
        except FetchError as exc:
            return ProbeResult(False, error=exc.reason)
        if answer.status != 200:
            return ProbeResult(False, error=f"/metrics answered HTTP {answer.status}")
        try:
            values = sum_gauges(answer.text, (QUEUE, BATCH))
        except ValueError as exc:
            return ProbeResult(False, error=f"malformed /metrics: {exc}"[:200])
        if QUEUE not in values:
            return ProbeResult(False, error=f"/metrics has no {QUEUE}")
        running = values.get(BATCH)
        return ProbeResult(True, pending=int(values[QUEUE]), running=None if running is None else int(running))
