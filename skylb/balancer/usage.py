"""Token counts and engine durations read from responses as the relay passes them on, for measured speed
(skylb/core/rates.py; OllamaRouter paper, "Adaptive Load Balancing for Distributed LLM Inference Using Ollama",
§4.3 "Parameter Updating").

Where they are (Ollama's API docs, "Generate a completion" response; Ollama ``api/types.go`` Metrics; OpenAI's chat
completion object):

* Ollama native (``/api/generate``, ``/api/chat``): the non-streamed body, or the last NDJSON object of a stream
  (``"done": true``), carries ``prompt_eval_count``, ``eval_count`` and ``prompt_eval_duration``, ``eval_duration``
  (nanoseconds).
* OpenAI (every engine's ``/v1/*``): ``usage`` {``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``} in the non-streamed body; in a stream, in the last chunk when the client
  asked for ``stream_options.include_usage`` (or the engine sends it anyway, as llama.cpp does). No durations: the
  balancer's measured TTFT and end-to-end time stand in (RateBook.observe).
* OpenAI Responses API (``/v1/responses``): ``usage`` {``input_tokens``, ``output_tokens``,
  ``input_tokens_details.cached_tokens``} in the response object: the body, or a stream's ``response.completed``
  event (under ``response``).

Streams are scanned cheaply: the relay's framer hands over each event's object it decoded anyway
(``UsageTap.see``), and bytes fed to the tap are parsed only for events that mention ``usage`` or ``eval_count``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from skylb.core.rates import Usage

__all__ = ["usage_of", "usage_of_body", "UsageTap", "observe"]

_MARKERS = (b'"usage"', b'"eval_count"', b'"prompt_eval_count"')
_SSE_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def _count(value: Any) -> int | None:
    """A token count: a non-negative int (bool is not one), else None."""
    return value if type(value) is int and value >= 0 else None


def _ns(value: Any) -> float | None:
    """A duration in ns (a non-negative number) as seconds, else None."""
    if type(value) in (int, float) and value >= 0:
        return value / 1e9
    return None


def usage_of(obj: Any) -> Usage | None:
    """The Usage in one decoded response object (Ollama's final object or an OpenAI body / chunk), or None when it
    carries no token counts (or they are malformed)."""
    if not isinstance(obj, dict):
        return None
    if "eval_count" in obj or "prompt_eval_count" in obj:
        prompt, out = _count(obj.get("prompt_eval_count")), _count(obj.get("eval_count"))
        if prompt is None and out is None:
            return None
        return Usage(prompt_tokens=prompt, prefilled_tokens=prompt, output_tokens=out,
                     prompt_s=_ns(obj.get("prompt_eval_duration")), decode_s=_ns(obj.get("eval_duration")))
    if isinstance(obj.get("response"), dict):  # a Responses API stream event
        obj = obj["response"]
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    responses_api = "input_tokens" in u
    prompt = _count(u.get("input_tokens" if responses_api else "prompt_tokens"))
    out = _count(u.get("output_tokens" if responses_api else "completion_tokens"))
    if prompt is None or out is None:
        return None
    details = u.get("input_tokens_details" if responses_api else "prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt_tokens=prompt, prefilled_tokens=max(0, prompt - (cached or 0)), output_tokens=out)


def usage_of_body(data: bytes) -> Usage | None:
    """The Usage of a whole (not streamed) JSON answer, or None."""
    if not any(m in data for m in _MARKERS):
        return None
    try:
        return usage_of(json.loads(data))
    except (ValueError, RecursionError):
        return None


class UsageTap:
    """Watches a relayed stream's whole events and keeps the last Usage: ``see`` each event's decoded object
    (StreamFramer's ``on_object``), or ``feed`` the bytes StreamFramer returned.

    Args:
        kind: "sse" or "ndjson" (StreamFramer.kind).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.usage: Usage | None = None

    def see(self, obj: dict) -> None:
        """Look at one event's decoded object; cheap when it has none of the keys a Usage is read from."""
        if "usage" in obj or "response" in obj or "eval_count" in obj or "prompt_eval_count" in obj:
            found = usage_of(obj)
            if found is not None:
                self.usage = found

    def feed(self, events: bytes) -> None:
        """Look at whole events (one or several, as relayed); cheap when none mentions usage."""
        if not events or not any(m in events for m in _MARKERS):
            return
        parts = events.split(b"\n") if self.kind == "ndjson" else _SSE_END.split(events)
        for part in parts:
            if not any(m in part for m in _MARKERS):
                continue
            payload = part if self.kind == "ndjson" else b"\n".join(
                line[5:].lstrip(b" ") for line in part.splitlines() if line.startswith(b"data:"))
            found = usage_of_body(payload)
            if found is not None:
                self.usage = found


def observe(router, decision, outcome, now: float) -> bool:
    """Feed ``outcome``'s usage (RelayOutcome.usage) to ``router``'s measured speed for ``decision``'s replica,
    with the TTFT and end-to-end time measured from dispatch (``now``: the balancer's clock, s). Only whole,
    successful answers count. Returns True when something was learned."""
    usage = getattr(outcome, "usage", None)
    if (usage is None or outcome.error is not None or outcome.status >= 400 or decision.route != "local"
            or decision.dispatched_at is None):
        return False
    ttft_s = None if outcome.ttft_s is None else max(0.0, outcome.ttft_s - decision.queued_s)
    return router.observe_response(decision, usage, ttft_s=ttft_s, e2e_s=max(0.0, now - decision.dispatched_at))
