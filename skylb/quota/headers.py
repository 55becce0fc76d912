"""OpenAI's rate-limit headers from the quota buckets a request draws on.

Source: OpenAI's API docs, "Rate limits", section "Rate limits in headers": ``x-ratelimit-limit-requests`` and
``-tokens`` (the most requests / tokens permitted before exhausting the limit), ``x-ratelimit-remaining-requests``
and ``-tokens`` (what remains now), ``x-ratelimit-reset-requests`` and ``-tokens`` (the time until the limit resets
to its initial state, as a duration such as ``1s``, ``6m0s``, ``17ms``).

A request draws on several buckets at once (skylb/quota/limits.py ``Quotas.limits_for``); the headers describe the
most restrictive one, for requests and for tokens separately: the bucket with the fewest remaining (the longest reset
on a tie). The limit is the capacity this balancer enforces: a bucket's per-minute figure times its share here
(1 with Redis; the region's share when each balancer counts alone: skylb/quota/buckets.py). Buckets refill
continuously (``per_minute / 60`` per second), so the reset is the time to refill to full: ``(limit - level) * 60 /
limit`` seconds, at most one minute. A bucket kind no quota sets (only a concurrency cap) gets no headers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from skylb.quota.buckets import LimitBackend
from skylb.quota.limits import Limit

__all__ = ["rate_limit_headers", "duration_text"]

#: Header kind -> (the Limit field, the level's key in ``LimitBackend.levels()``).
_KINDS = {"requests": "requests_per_minute", "tokens": "tokens_per_minute"}


def duration_text(seconds: float) -> str:
    """``seconds`` (>= 0) as OpenAI writes a reset (Go's ``time.Duration`` format, to the millisecond, rounded
    up so a client that waits that long finds the bucket reset): ``0s``, ``17ms``, ``1s``, ``1.5s``, ``6m0s``,
    ``1h2m3.25s``."""
    ms = math.ceil(max(0.0, seconds) * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _share(limits: LimitBackend, key: str) -> float:
    """The fraction of ``key``'s limit ``limits`` enforces now: the in-process buckets' share (also a Redis
    backend's while it falls back), else 1 (Redis counts the whole limit)."""
    if getattr(limits, "falling_back", False):
        limits = limits.fallback
    share_for = getattr(limits, "share_for", None)
    return share_for(key) if share_for is not None else 1.0


def rate_limit_headers(buckets: Sequence[tuple[str, Limit]], limits: LimitBackend) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers for a request that drew on ``buckets`` ((key, Limit) pairs), from the levels
    ``limits`` computed last (after this request's charge when it was admitted). Empty when no bucket limits
    requests or tokens."""
    levels = limits.levels()
    headers: dict[str, str] = {}
    for kind, field in _KINDS.items():
        tightest = None
        for key, limit in buckets:
            per_minute, level = getattr(limit, field), levels.get(key, {}).get(kind)
            if per_minute is None or level is None:
                continue
            capacity = per_minute * _share(limits, key)
            remaining = max(0, math.floor(level + 1e-9))
            reset_s = max(0.0, capacity - level) * 60.0 / capacity
            candidate = (remaining, -reset_s, capacity)
            if tightest is None or candidate < tightest:
                tightest = candidate
        if tightest is not None:
            remaining, reset_s, capacity = tightest
            headers[f"x-ratelimit-limit-{kind}"] = str(max(1, math.floor(capacity + 1e-9)))
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration_text(-reset_s)
    return headers
