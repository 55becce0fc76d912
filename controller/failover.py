"""Which region's balancer serves each region's replicas (SkyLB paper §4.2, "Failure recovery of load balancers").

A region is *live* when one of its registered balancers is healthy and not draining. A live region serves its own
replicas. A region that has balancers but none live is served by the closest live region (the round trips in
``controller.failover.rtt_ms``; ties by name), which treats those replicas as its own until the region's balancer
is healthy again; then they move back. Several failures at once are planned together: each failed region goes to
the closest region that is live now, never to another failed one. A region with no live balancer anywhere, or with
no balancer registered yet (a deployment still starting), keeps its assignment.

Every change is a store write that bumps the region's epoch (controller/store.py ``assign``), so a balancer still
holding the older epoch is known to be stale.
"""

from __future__ import annotations

from controller.store import Assignment, Balancer
from skylb.config import Failover

__all__ = ["plan_assignments", "live_regions"]


def live_regions(balancers: list[Balancer]) -> set[str]:
    """Regions with at least one balancer that is healthy and not draining."""
    return {b.region for b in balancers if b.healthy and not b.draining}


def plan_assignments(assignments: list[Assignment], balancers: list[Balancer], config: Failover) -> dict[str, str]:
    """The serving region each region should have: {region: balancer_region}, for every region of ``assignments``.

    Pure: reads the current assignments and the balancers' health and drain flags, writes nothing.
    """
    live = live_regions(balancers)
    registered = {b.region for b in balancers}
    plan = {}
    for a in assignments:
        if a.region in live:
            plan[a.region] = a.region
        elif a.region not in registered or not live:
            plan[a.region] = a.balancer_region  # nothing to decide, or nobody to take it: keep what holds
        else:
            plan[a.region] = min(live, key=lambda region: (config.rtt(a.region, region), region))
    return plan
