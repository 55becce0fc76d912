"""The retry budget and backoff (skylb/balancer/retry.py): Envoy's budget_percent / min_retry_concurrency and
full-jitter backoff between base_interval_ms and max_interval_ms."""

from __future__ import annotations

import random

import pytest

from skylb.balancer.retry import RetryBudget, backoff_s
from skylb.config import RetryPolicy


@pytest.mark.parametrize("in_flight, allowed", [(0, 3), (10, 3), (15, 3), (20, 4), (100, 20)])
def test_the_budget_is_a_share_of_the_load_with_a_floor(in_flight, allowed):
    """At most budget_percent (20) of the requests held may be retrying at once, never fewer than 3."""
    budget = RetryBudget(RetryPolicy())
    taken = sum(budget.try_acquire(in_flight) for _ in range(50))
    assert taken == allowed
    budget.release()
    assert budget.try_acquire(in_flight) and not budget.try_acquire(in_flight)


def test_a_zero_budget_allows_no_retry_and_release_never_goes_negative():
    """budget_percent 0 and min_retry_concurrency 0: no retry at all; releasing more than taken stays at 0."""
    budget = RetryBudget(RetryPolicy(budget_percent=0, min_retry_concurrency=0))
    assert not budget.try_acquire(1000)
    budget.release()
    assert budget.active == 0


@pytest.mark.parametrize("retry, cap_ms", [(1, 25), (2, 50), (3, 100), (4, 200), (5, 250), (9, 250)])
def test_backoff_is_full_jitter_under_a_doubling_cap(retry, cap_ms):
    """Retry n waits uniformly in [0, min(25 ms x 2^(n-1), 250 ms)] (Envoy's defaults)."""
    rng = random.Random(7)
    waits = [backoff_s(RetryPolicy(), retry, rng=rng) * 1000 for _ in range(2000)]
    assert 0 <= min(waits) < cap_ms * 0.05 and cap_ms * 0.95 < max(waits) <= cap_ms


def test_max_interval_below_base_is_a_config_error():
    """max_interval_ms below base_interval_ms is rejected."""
    with pytest.raises(ValueError):
        RetryPolicy(base_interval_ms=100, max_interval_ms=50)
