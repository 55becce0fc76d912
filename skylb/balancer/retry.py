"""Retry budget and backoff (Envoy's ``retry_budget`` and ``retry_back_off``: Envoy docs,
"Retry semantics" and the ``config.route.v3.RetryPolicy`` / ``config.cluster.v3.CircuitBreakers`` API reference).

A retry budget bounds retries as a share of the load instead of per request, so a failing region does not multiply
its own load: at most ``budget_percent`` of the requests a balancer holds may be in a retry at once, and never fewer
than ``min_retry_concurrency``. Backoff before retry n is "full jitter" (AWS architecture blog, "Exponential Backoff
And Jitter"; Envoy's default): uniformly random in [0, min(base x 2^(n-1), max)].
"""

from __future__ import annotations

import random

from skylb.config import RetryPolicy

__all__ = ["RetryBudget", "backoff_s"]


class RetryBudget:
    """Counts the retries running now and says whether one more fits.

    Args:
        policy: the retry settings (budget_percent, min_retry_concurrency).
    """

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        #: Requests between a failed attempt and the end of their retry (backoff included).
        self.active = 0

    def limit(self, in_flight: int) -> int:
        """The most retries allowed at once while the balancer holds ``in_flight`` requests (queued or sent)."""
        return max(self.policy.min_retry_concurrency, int(in_flight * self.policy.budget_percent / 100.0))

    def try_acquire(self, in_flight: int) -> bool:
        """Take a place for one retry; False when the budget is spent (the request then fails instead)."""
        if self.active >= self.limit(in_flight):
            return False
        self.active += 1
        return True

    def release(self) -> None:
        """A retry ended (any outcome)."""
        self.active = max(0, self.active - 1)


def backoff_s(policy: RetryPolicy, retry: int, *, rng: random.Random | None = None) -> float:
    """The wait before retry number ``retry`` (1 for the first), s: full jitter up to min(base x 2^(retry-1), max)."""
    cap_ms = min(policy.base_interval_ms * 2 ** max(0, retry - 1), policy.max_interval_ms)
    return (rng or random).uniform(0.0, cap_ms) / 1000.0
