"""``--engine auto``: tell which engine serves a URL by probing it once, remember the answer, then delegate.

Detection, first conclusive answer wins (sources: each engine's documentation, cited in its adapter module):

1. ``GET /metrics``: metric names starting ``vllm:``, ``sglang:``, ``llamacpp:`` or ``tgi_``; llama.cpp also
   answers 501 "... Start it with `--metrics`" (metrics off) or 503 "Loading model".
2. ``GET /``: Ollama answers "Ollama is running".
3. ``GET /get_model_info``: SGLang (metrics off) answers JSON with ``model_path``.
4. ``GET /info``: TGI answers JSON with ``router`` "text-generation-router".
5. ``GET /props``: llama.cpp answers JSON with ``total_slots``.
6. Otherwise a generic OpenAI-compatible server: ``openai``.

The answer is cached per URL for the life of the process (an engine does not change under a URL; a new replica
gets a new URL). A network failure during detection caches nothing, so the next probe tries again.
"""

from __future__ import annotations

import re

from skylb.engines.base import ADAPTERS, EngineAdapter, ProbeResult
from skylb.engines.fetch import FetchError, get, json_or_none

__all__ = ["AutoAdapter", "detect_engine", "detected_engine"]

#: Metric-name prefix at a line start (after an optional "# HELP "/"# TYPE ") -> engine.
_METRIC_PREFIX = re.compile(r"^(?:# (?:HELP|TYPE) )?(vllm:|sglang:|llamacpp:|tgi_)", re.MULTILINE)
_PREFIX_ENGINE = {"vllm:": "vllm", "sglang:": "sglang", "llamacpp:": "llamacpp", "tgi_": "tgi"}

#: (status, says "--metrics", says "Loading model") of llama.cpp's /metrics when off (501) or loading (503).
_LLAMACPP_NO_METRICS = {(501, True, False), (503, False, True)}

#: url -> detected engine name (process-wide: the balancer makes a new adapter object for every probe).
_DETECTED: dict[str, str] = {}


def detected_engine(url: str) -> str | None:
    """The engine detected earlier at ``url``, or None when not (yet) known."""
    return _DETECTED.get(url)


async def detect_engine(session, url: str, *, timeout_s: float) -> str:
    """The engine name serving base ``url`` (an adapter name; "openai" when nothing more specific answers).

    Cached per URL after the first success. Each GET is bounded by ``timeout_s`` seconds. Raises FetchError (an
    aiohttp.ClientError) when the server does not answer, so an unreachable replica is not mistaken for a
    generic one.
    """
    if url in _DETECTED:
        return _DETECTED[url]
    engine = await _detect(session, url, timeout_s)
    _DETECTED[url] = engine
    return engine


async def _detect(session, url: str, timeout_s: float) -> str:
    answer = await get(session, url, "/metrics", timeout_s=timeout_s)
    if answer.status == 200:
        match = _METRIC_PREFIX.search(answer.text)
        if match:
            return _PREFIX_ENGINE[match.group(1)]
    elif (answer.status, "--metrics" in answer.text, "Loading model" in answer.text) in _LLAMACPP_NO_METRICS:
        return "llamacpp"
    answer = await get(session, url, "/", timeout_s=timeout_s)
    if answer.status == 200 and "Ollama is running" in answer.text:
        return "ollama"
    body = await _json(session, url, "/get_model_info", timeout_s)
    if isinstance(body, dict) and "model_path" in body:
        return "sglang"
    body = await _json(session, url, "/info", timeout_s)
    if isinstance(body, dict) and body.get("router") == "text-generation-router":
        return "tgi"
    body = await _json(session, url, "/props", timeout_s)
    if isinstance(body, dict) and "total_slots" in body:
        return "llamacpp"
    return "openai"


async def _json(session, url: str, path: str, timeout_s: float):
    answer = await get(session, url, path, timeout_s=timeout_s)
    return json_or_none(answer.text) if answer.status == 200 else None


class AutoAdapter(EngineAdapter, engine="auto"):
    """Detect the engine once per URL, then probe and list models with that engine's adapter."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            engine = await detect_engine(session, url, timeout_s=timeout_s)
        except FetchError as exc:
            return ProbeResult(False, error=f"engine detection failed: {exc.reason}")
        return await ADAPTERS[engine]().probe(session, url, timeout_s=timeout_s, outstanding=outstanding,
                                              max_concurrency=max_concurrency)

    async def model_cards(self, session, url, *, timeout_s):
        """The detected engine's model entries (``models`` reads their ids); raises FetchError when detection
        cannot reach the server."""
        engine = await detect_engine(session, url, timeout_s=timeout_s)
        return await ADAPTERS[engine]().model_cards(session, url, timeout_s=timeout_s)
