"""Retry-After on every 503 and 429 the balancer answers: when a request sent again would likely be served.

Each value is jittered uniformly in [base, 1.5 x base] and rounded up to whole seconds, at least 1
(:func:`skylb.quota.gate.retry_after_s`; RFC 9110 §10.2.3, delay-seconds), so clients told to come back do not
all return in the same second, and none before the base. The base is:

- a queue 503 (queue full, queue timeout): a new request waits behind the ``q`` requests queued; the router places
  about ``r`` requests per second (its recent dispatch rate), so it would be placed in about (q + 1) / r seconds
  (LLM-Load-Balancer README, "Iteration 2", "Smarter waits"), capped at ``max_s``; the configured ``retry_after_s``
  when nothing was placed lately (no rate to go by);
- a quota 429: the time until the refusing bucket has room (skylb/quota/gate.py, skylb/quota/groups.py);
- any other 503 (a model served nowhere right now, no model of a group served, too many admission leases, the
  drain after SIGTERM, a replica's or peer's own 503 or 429 passed on): the configured ``retry_after_s``.
  :func:`retry_after_hook` adds that one to any 503 or 429 leaving the balancer without a Retry-After.
"""

from __future__ import annotations

import random

from aiohttp import web

from skylb.core import Router
from skylb.quota.gate import retry_after_s

__all__ = ["queue_retry_after_s", "retry_after_s", "retry_after_hook", "OVERLOAD_STATUSES"]

#: The statuses that tell a client to come back later, each with a Retry-After (RFC 9110 §15.6.4; RFC 6585 §4).
OVERLOAD_STATUSES = frozenset({429, 503})


def queue_retry_after_s(router: Router, now: float, *, default_s: int, max_s: float,
                        rng: random.Random | None = None) -> int:
    """Seconds for the Retry-After header of a queue 503 (see the module docstring); ``now``: the router's clock."""
    rate = router.dispatch_rate(now)
    if not rate:
        return retry_after_s(default_s, rng)
    return min(max(1, int(max_s)), retry_after_s((len(router.queue) + 1) / rate, rng))


def retry_after_hook(base_s: int):
    """An ``on_response_prepare`` hook: a 503 or 429 without a Retry-After gets one from ``base_s`` (s, jittered as
    the module docstring says); any other response, or one that has its own, is left as it is."""

    async def add_retry_after(_request: web.Request, response: web.StreamResponse) -> None:
        if response.status in OVERLOAD_STATUSES and "Retry-After" not in response.headers:
            response.headers["Retry-After"] = str(retry_after_s(base_s))

    return add_retry_after
