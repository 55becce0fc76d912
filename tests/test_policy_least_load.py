"""The ``least-load`` baseline (blind pushing): its choices pinned in a table."""

from __future__ import annotations

from tests.policy_table import picks


def test_least_load_takes_the_fewest_outstanding_and_rotates_ties():
    """Fewest outstanding requests from this balancer; equal ones take turns."""
    assert picks("least-load", {}, [], {"r1": 2, "r2": 0, "r3": 0}, [("a", None)] * 4) == ["r2", "r3", "r2", "r3"]
