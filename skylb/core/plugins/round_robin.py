"""Round robin: local replicas in id order, one after another, whatever their load (baseline RR, SkyLB paper §5.1)."""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.profile import Turns
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["RoundRobin"]


class RoundRobin:
    """ReplicaPicker: the next replica in id order, by the profile's shared ``turns``."""

    def __init__(self, turns: Turns):
        self.turns = turns

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The ``turn``-th of ``candidates`` (non-empty) sorted by id, modulo their number."""
        ordered = sorted(candidates, key=lambda c: c.id)
        return ordered[self.turns.next() % len(ordered)]
