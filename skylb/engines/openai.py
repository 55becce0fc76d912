"""Any OpenAI-compatible server (LiteLLM, LM Studio, a hosted endpoint...): no load metric, so pending comes from
the balancer's own in-flight count against the replica's configured concurrency.

pending = max(0, outstanding - limit) and running = min(outstanding, limit), where limit = the replica's
``max_concurrency`` or :data:`DEFAULT_SLOTS` (8: a conservative guess for one GPU server; set the real
limit with ``skylb-ctl replica add --max-concurrency N``). Health is ``GET /v1/models`` answering 200 with an
OpenAI model list. Source: the OpenAI API reference, "Models: List models" (``GET /v1/models``).
"""

from __future__ import annotations

from skylb.core.state import load_from_outstanding
from skylb.engines.base import EngineAdapter, ProbeResult
from skylb.engines.fetch import FetchError, get, json_or_none

__all__ = ["OpenAIAdapter", "DEFAULT_SLOTS"]

#: Requests a generic server is assumed to run at once when the replica has no max_concurrency.
DEFAULT_SLOTS = 8


class OpenAIAdapter(EngineAdapter, engine="openai"):
    """Probe a generic OpenAI-compatible server: liveness from /v1/models, load from the balancer's own count."""

    async def probe(self, session, url, *, timeout_s, outstanding=0, max_concurrency=None):
        try:
            answer = await get(session, url, "/v1/models", timeout_s=timeout_s)
        except FetchError as exc:
            return ProbeResult(False, error=exc.reason)
        if answer.status != 200:
            return ProbeResult(False, error=f"/v1/models answered HTTP {answer.status}")
        body = json_or_none(answer.text)
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            return ProbeResult(False, error="/v1/models is not an OpenAI model list")
        pending, running = load_from_outstanding(outstanding, max_concurrency or DEFAULT_SLOTS)
        return ProbeResult(True, pending=pending, running=running)
