"""``round-robin``: blind pushing, round robin over healthy local replicas (baseline RR, SkyLB paper §5.1)."""

from __future__ import annotations

from skylb.core.plugins.most_room import MostRoom
from skylb.core.plugins.round_robin import RoundRobin
from skylb.core.policies.base import NoOptions, register
from skylb.core.profile import Profile, Turns

__all__ = ["round_robin"]


def round_robin(options: NoOptions) -> Profile:
    """Replicas in id order, one after another, whatever their load; every healthy replica is a candidate."""
    return Profile("round-robin", options, local=RoundRobin(Turns()), peer=MostRoom(), selective=False)


register("round-robin", NoOptions, round_robin)
