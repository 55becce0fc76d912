"""The Retry-After of a 503 from the queue (queue full, queue timeout): when a request sent again would likely be
placed, estimated from the dispatch rate.

A new request waits behind the ``q`` requests queued; the router places about ``r`` requests per second (its recent
dispatch rate), so it would be placed in about (q + 1) / r seconds. Jittered +-10 % and rounded up to whole
seconds, at least 1 (LLM-Load-Balancer README, "Iteration 2", "Smarter waits"), at most ``max_s``; the configured
``retry_after_s`` when nothing was placed lately (no rate to go by).
"""

from __future__ import annotations

import random

from skylb.core import Router
from skylb.quota.gate import retry_after_s

__all__ = ["queue_retry_after_s"]

_rng = random.Random()


def queue_retry_after_s(router: Router, now: float, *, default_s: int, max_s: float,
                        rng: random.Random = _rng) -> int:
    """Seconds for the Retry-After header of a queue 503 (see the module docstring); ``now``: the router's clock."""
    rate = router.dispatch_rate(now)
    if not rate:
        return default_s
    return min(max(1, int(max_s)), retry_after_s((len(router.queue) + 1) / rate, rng))
