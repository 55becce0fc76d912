"""``least-load``: blind pushing to the healthy replica with the fewest outstanding requests (baseline LL, §5.1)."""

from __future__ import annotations

from skylb.core.policies.base import Policy

__all__ = ["LeastLoadPolicy"]


class LeastLoadPolicy(Policy, name="least-load"):
    """Fewest requests in flight from this balancer; ties take turns (``Policy.least_loaded``)."""

    selective = False
