"""The engine adapter interface and the Prometheus-text helper adapters share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EngineAdapter", "ProbeResult", "ADAPTERS", "adapter_for", "sum_gauges", "max_gauges", "gauges",
           "info_labels"]

#: engine name -> adapter class, filled by ``EngineAdapter.__init_subclass__``.
ADAPTERS: dict[str, type["EngineAdapter"]] = {}


@dataclass
class ProbeResult:
    """One probe of one replica.

    Attributes:
        healthy: the replica answered and is serving.
        pending: requests accepted but not yet in the running batch (the selective-pushing signal).
        running: requests in the running batch, or None if the engine does not say.
        error: why the probe failed (healthy False).
        slots: the engine's parallel slots (the most requests it runs at once), when it says (llama.cpp's
            ``total_slots``), else None.
        kv_usage: the fraction of the KV cache in use, 0-1, when the engine says (vLLM ``kv_cache_usage_perc``,
            SGLang ``token_usage``), else None.
        kv_capacity_tokens: the tokens the KV cache holds in all, when the engine says (vLLM
            ``cache_config_info``'s ``num_gpu_blocks`` x ``block_size``, SGLang ``max_total_num_tokens``), else None.
        output_reserve_tokens: the most output tokens the engine reserves in its KV cache for a request it admits,
            beyond the prompt (SGLang: the request's ``max_tokens`` clipped at 4096); None for an engine that admits
            on the prompt's blocks alone (vLLM V1) or one that reports no KV cache.
        output_reserve_ratio: the share of its running requests' remaining output such an engine keeps reserved
            against new admissions (SGLang's ``new_token_ratio``, 0-1); None for an engine that reserves none.
    """

    healthy: bool
    pending: int = 0
    running: int | None = None
    error: str | None = None
    models: list[str] = field(default_factory=list)
    slots: int | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    output_reserve_tokens: int | None = None
    output_reserve_ratio: float | None = None


class EngineAdapter:
    """Reads one engine's load signal; subclasses register with ``class X(EngineAdapter, engine="name")``."""

    engine: ClassVar[str]

    def __init_subclass__(cls, *, engine: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if engine:
            cls.engine = engine
            ADAPTERS[engine] = cls

    async def probe(self, session: aiohttp.ClientSession, url: str, *, timeout_s: float, outstanding: int = 0,
                    max_concurrency: int | None = None) -> ProbeResult:
        """Probe the replica at base ``url``; never raises for network errors (returns healthy=False).

        ``outstanding`` is the number of requests this balancer has in flight there and ``max_concurrency`` the
        replica's configured parallel slots (None: not configured); engines without a pending metric (Ollama, a
        generic OpenAI server) derive pending from them: pending = max(0, outstanding - max_concurrency).
        """
        raise NotImplementedError

    async def models(self, session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> list[str]:
        """The model ids the replica serves (``model_cards``' ids); raises aiohttp.ClientError on failure."""
        return [card["id"] for card in await self.model_cards(session, url, timeout_s=timeout_s)]

    async def model_cards(self, session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> list[dict]:
        """The replica's model list (OpenAI ``GET /v1/models``), each entry as the engine sent it (a JSON object with
        an ``id``; vLLM and SGLang add ``max_model_len``, ``root``, ``parent``); raises aiohttp.ClientError on
        failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{url}/v1/models", timeout=timeout) as resp:
            resp.raise_for_status()
            body = await resp.json(content_type=None)
        return [m for m in body.get("data", []) if isinstance(m, dict) and "id" in m]


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter for ``engine``; raises ValueError naming the known engines otherwise."""
    try:
        return ADAPTERS[engine]()
    except KeyError:
        raise ValueError(f"no adapter for engine {engine!r}; known: {', '.join(sorted(ADAPTERS))}") from None


def _samples(text: str, names: tuple[str, ...]):
    """(name, value) of every sample of the metrics ``names`` in Prometheus exposition ``text``."""
    wanted = tuple(f"{n}{sep}" for n in names for sep in ("{", " "))
    lines = [ln for ln in text.splitlines() if ln.startswith(wanted)]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in names:
                if not math.isfinite(sample.value):
                    raise ValueError(f"{sample.name} is {sample.value}")
                yield sample.name, sample.value


def sum_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum each metric in ``names`` over all its label sets, from Prometheus exposition ``text``.

    Names match exactly (``vllm:num_requests_waiting`` does not match ``vllm:num_requests_waiting_by_reason``).
    Lines of other metrics are dropped before parsing, because engines expose large histograms we do not need and
    probes run every 100 ms. Parsing is prometheus_client's. Missing metrics are absent from the result.
    Raises ValueError for text that does not parse, or a wanted sample that is NaN or infinite (no count).
    """
    totals: dict[str, float] = {}
    for name, value in _samples(text, names):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def gauges(text: str, summed: tuple[str, ...], highest: tuple[str, ...]) -> tuple[dict[str, float], dict[str, float]]:
    """``(sum_gauges(text, summed), max_gauges(text, highest))`` in one pass over ``text``: the probe of an engine
    that reports both kinds (vLLM, SGLang) splits and parses its exposition once, not twice (half of a probe's
    parsing time, every 100 ms per replica). Raises ValueError as ``sum_gauges``."""
    totals: dict[str, float] = {}
    tops: dict[str, float] = {}
    for name, value in _samples(text, summed + highest):
        if name in summed:
            totals[name] = totals.get(name, 0.0) + value
        if name in highest:
            tops[name] = max(value, tops.get(name, value))
    return totals, tops


def max_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The largest sample of each metric in ``names`` over its label sets (a ratio such as KV usage, where the
    fullest engine of a data-parallel replica is the one that limits it); as ``sum_gauges`` otherwise."""
    highest: dict[str, float] = {}
    for name, value in _samples(text, names):
        highest[name] = max(value, highest.get(name, value))
    return highest


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of info metric ``name`` (a gauge of value 1 whose labels carry a
    configuration, as vLLM's ``vllm:cache_config_info``) in Prometheus exposition ``text``; None when it is absent
    or does not parse. Only that sample's line is parsed (found by a substring search: the exposition is read on
    every probe)."""
    start = text.find(name + "{")
    if start < 0 or (start > 0 and text[start - 1] != "\n"):
        return None
    end = text.find("\n", start)
    line = text[start:] if end < 0 else text[start:end]
    try:
        for family in text_string_to_metric_families(line + "\n"):
            for sample in family.samples:
                return dict(sample.labels)
    except ValueError:
        return None
    return None
