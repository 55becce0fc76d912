"""``least-load``: blind pushing to the healthy replica with the fewest outstanding requests (baseline LL, §5.1)."""

from __future__ import annotations

from skylb.core.plugins.least_load import LeastLoad
from skylb.core.plugins.most_room import MostRoom
from skylb.core.policies.base import NoOptions, register
from skylb.core.profile import Profile, Turns

__all__ = ["least_load"]


def least_load(options: NoOptions) -> Profile:
    """Fewest requests in flight from this balancer, ties taking turns; every healthy replica is a candidate."""
    return Profile("least-load", options, local=LeastLoad(Turns()), peer=MostRoom(), selective=False)


register("least-load", NoOptions, least_load)
