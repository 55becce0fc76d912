"""Least load: the local replica with the fewest requests in flight from this balancer (baseline LL, SkyLB paper
§5.1), ties taking turns, so idle replicas share the load."""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.plugins.scoring import least_loaded
from skylb.core.profile import Turns
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["LeastLoad"]


class LeastLoad:
    """ReplicaPicker: fewest outstanding plus sent since the last probe (scoring.least_loaded), ties rotated by the
    profile's shared ``turns``."""

    def __init__(self, turns: Turns):
        self.turns = turns

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The least loaded of ``candidates`` (non-empty)."""
        return least_loaded(candidates, self.turns.next())
