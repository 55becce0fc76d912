"""Ollama: no load metric at all, so pending comes from the balancer's own in-flight count at the replica.

pending = max(0, outstanding - slots) and running = min(outstanding, slots), where slots = the replica's
``max_concurrency`` (its ``OLLAMA_NUM_PARALLEL``) or 1, Ollama's default. Health is ``GET /`` answering
"Ollama is running"; served models come from ``GET /api/tags`` (``models[].name``, ``size`` in bytes) and loaded
ones from ``GET /api/ps`` (``models[].name``, ``size``, ``size_vram``, ``expires_at``), read on every probe round
(the model thermal state, skylb/core/fleet_rules.py).

Sources: the Ollama documentation, "API" (``docs/api.md``) and "FAQ" (no queue or load metric, ollama/ollama
issue #3144 still open; ``OLLAMA_NUM_PARALLEL`` default 1); ollama/ollama ``server/routes.go`` (``GET /`` and
``HEAD /`` answer "Ollama is running"; ``ListHandler`` for /api/tags).
"""

from __future__ import annotations

from skylb.core.fleet_rules import ModelSlot, canonical
from skylb.core.state import load_from_outstanding
from skylb.engines.base import EngineAdapter, ProbeResult
from skylb.engines.fetch import FetchError, get, json_or_none

__all__ = ["OllamaAdapter", "DEFAULT_SLOTS", "RUNNING_TEXT"]

#: OLLAMA_NUM_PARALLEL's default: one request at a time per loaded model.
DEFAULT_SLOTS = 1
RUNNING_TEXT = "Ollama is running"


class OllamaAdapter(EngineAdapter, engine="ollama"):
    """Probe an Ollama server: liveness from ``GET /``, load from the balancer's own count."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            answer = await get(session, url, "/", timeout_s=timeout_s)
        except FetchError as exc:
            return ProbeResult(False, error=exc.reason)
        if answer.status != 200:
            return ProbeResult(False, error=f"GET / answered HTTP {answer.status}")
        if RUNNING_TEXT not in answer.text:
            return ProbeResult(False, error=f"GET / did not say {RUNNING_TEXT!r}: not an Ollama server?")
        pending, running = load_from_outstanding(outstanding, max_concurrency or DEFAULT_SLOTS)
        return ProbeResult(True, pending=pending, running=running)

    async def models(self, session, url, *, timeout_s):
        """Model names from ``GET /api/tags``; raises FetchError (an aiohttp.ClientError), ValueError if malformed."""
        answer = await get(session, url, "/api/tags", timeout_s=timeout_s)
        if answer.status != 200:
            raise FetchError(f"GET /api/tags answered HTTP {answer.status}")
        body = json_or_none(answer.text)
        if not isinstance(body, dict) or not isinstance(body.get("models"), list):
            raise ValueError("malformed /api/tags answer: expected {\"models\": [...]}")
        return [m.get("name") or m.get("model") for m in body["models"]
                if isinstance(m, dict) and (m.get("name") or m.get("model"))]

    async def model_cards(self, session, url, *, timeout_s):
        """``{"id": name}`` for each model of ``/api/tags`` (its other fields are not OpenAI's); raises as
        ``models``."""
        return [{"id": name} for name in await self.models(session, url, timeout_s=timeout_s)]

    async def model_slots(self, session, url, path, *, timeout_s) -> dict[str, ModelSlot]:
        """``GET /api/tags`` or ``/api/ps`` as canonical name -> ModelSlot (size in bytes, expires_at); raises
        FetchError (an aiohttp.ClientError) or ValueError if malformed."""
        answer = await get(session, url, path, timeout_s=timeout_s)
        if answer.status != 200:
            raise FetchError(f"GET {path} answered HTTP {answer.status}")
        body = json_or_none(answer.text)
        if not isinstance(body, dict) or not isinstance(body.get("models"), list):
            raise ValueError(f"malformed {path} answer: expected {{\"models\": [...]}}")
        out = {}
        for m in body["models"]:
            name = isinstance(m, dict) and (m.get("name") or m.get("model"))
            if isinstance(name, str) and name:
                size = m.get("size")
                out[canonical(name)] = ModelSlot(size if type(size) is int and size > 0 else None,
                                                 m.get("expires_at") if isinstance(m.get("expires_at"), str) else None)
        return out
