"""``round-robin``: blind pushing, round robin over healthy local replicas (baseline RR, SkyLB paper §5.1)."""

from __future__ import annotations

from skylb.core.policies.base import Policy

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy(Policy, name="round-robin"):
    """Replicas in id order, one after another, whatever their load."""

    selective = False

    def pick_replica(self, request, candidates):
        ordered = sorted(candidates, key=lambda c: c.id)
        return ordered[next(self._rotation) % len(ordered)]
