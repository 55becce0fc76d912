"""vLLM: pending = ``vllm:num_requests_waiting`` from ``GET /metrics``, summed over the ``engine`` label.

Source: the vLLM documentation, "Metrics" (V1 engine); vLLM's waiting queue is unbounded, so this gauge is the
only sign that its continuous batch is full. A replica whose /metrics does not answer 200, or answers text that
is not Prometheus exposition, is unhealthy.
"""

from __future__ import annotations

import asyncio

import aiohttp

from skylb.engines.base import EngineAdapter, ProbeResult, gauges, info_labels

__all__ = ["VLLMAdapter", "kv_capacity_tokens"]

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
#: KV cache usage, 0-1 (vllm/v1/metrics/loggers.py): ``kv_cache_usage_perc`` since 0.10, ``gpu_cache_usage_perc``
#: before (removed in 0.12). With data parallelism each engine reports its own: the fullest one is taken.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: The KV cache's configuration as labels of a gauge of value 1 (vllm/v1/metrics/loggers.py ``log_metrics_info``
#: of CacheConfig): ``num_gpu_blocks`` x ``block_size`` is the cache's size in tokens.
CACHE_CONFIG = "vllm:cache_config_info"


def kv_capacity_tokens(text: str) -> int | None:
    """The KV cache's size in tokens from ``vllm:cache_config_info`` in ``text``; None when absent or not numbers
    (``num_gpu_blocks`` is "None" before the engine has profiled its memory)."""
    labels = info_labels(text, CACHE_CONFIG)
    try:
        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"]) if labels else 0
    except (KeyError, ValueError):
        return None
    return tokens if tokens > 0 else None


class VLLMAdapter(EngineAdapter, engine="vllm"):
    """Probe a vLLM replica through its Prometheus endpoint."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return ProbeResult(False, error=f"/metrics answered {resp.status}")
                text = await resp.text(errors="replace")  # undecodable bytes then read as malformed, below
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return ProbeResult(False, error=f"/metrics unreachable: {type(exc).__name__}")
        try:
            values, kv = gauges(text, (WAITING, RUNNING), KV_USAGE)
        except ValueError as exc:  # the reason shows in the status, rather than a stale probe
            return ProbeResult(False, error=f"malformed /metrics: {exc}"[:200])
        if WAITING not in values:
            return ProbeResult(False, error=f"/metrics has no {WAITING}")
        running = values.get(RUNNING)
        kv_usage = next((kv[name] for name in KV_USAGE if name in kv), None)
        return ProbeResult(True, pending=int(values[WAITING]), running=None if running is None else int(running),
                           kv_usage=kv_usage, kv_capacity_tokens=kv_capacity_tokens(text))
