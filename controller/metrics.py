"""The controller's Prometheus metrics (prometheus_client, one registry per controller), served at ``GET /metrics``.

State is read from the membership store at scrape time (one snapshot per scrape): the revision, replicas and
balancers per region by state, each region's assignment epoch, and whether this controller leads. Events are
counters: health checks by target kind and result, and failovers (every reassignment of a region, failing over or
back). Names follow Prometheus's "Metric and label naming" (prometheus.io, Practices), as the balancer's do
(skylb/balancer/metrics.py): ``skylb_controller_`` prefix, counters exposed with ``_total``; every label value is an
operator's region name or a fixed word, so the number of series stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from controller.store import Membership
from skylb import gc_pauses

__all__ = ["ControllerMetrics", "CONTENT_TYPE", "STATES"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The ``state`` label of a replica or balancer: draining (whatever its health), else healthy or unhealthy.
STATES = ("healthy", "unhealthy", "draining")


def _state(member) -> str:
    return "draining" if member.draining else "healthy" if member.healthy else "unhealthy"


class _MembershipCollector:
    """Reads one membership snapshot and the leadership at scrape time."""

    def __init__(self, snapshot: Callable[[], Membership], is_leader: Callable[[], bool]):
        self.snapshot = snapshot
        self.is_leader = is_leader

    def collect(self):
        m = self.snapshot()
        revision = GaugeMetricFamily("skylb_controller_membership_revision", "The membership store's revision "
                                     "(every change of replicas, balancers, health, assignments or quotas bumps it).")
        revision.add_metric([], m.revision)
        yield revision
        regions = sorted(set(m.regions) | {r.region for r in m.replicas} | {b.region for b in m.balancers})
        for name, members, what in (("skylb_controller_replicas", m.replicas, "Replicas"),
                                    ("skylb_controller_balancers", m.balancers, "Balancers")):
            family = GaugeMetricFamily(name, f"{what} in the membership, by region and state (draining, else "
                                       "healthy or unhealthy by the controller's health check).",
                                       labels=["region", "state"])
            counts = {(region, state): 0 for region in regions for state in STATES}
            for member in members:
                counts[(member.region, _state(member))] += 1
            for (region, state), n in counts.items():
                family.add_metric([region, state], n)
            yield family
        epoch = GaugeMetricFamily("skylb_controller_assignment_epoch", "Each region's assignment: the region whose "
                                  "balancer serves its replicas (balancer_region) and the epoch of that assignment.",
                                  labels=["region", "balancer_region"])
        for a in m.assignments:
            epoch.add_metric([a.region, a.balancer_region], a.epoch)
        yield epoch
        leader = GaugeMetricFamily("skylb_controller_leader", "1 when this controller leads (runs the health checks "
                                   "and failover), else 0.")
        leader.add_metric([], 1 if self.is_leader() else 0)
        yield leader


class ControllerMetrics:
    """All metrics of one controller; ``render()`` gives the Prometheus text.

    Args:
        snapshot: the store's current membership (``Store.snapshot``); is_leader: whether this controller leads.

    Attributes:
        health_checks: Counter by (target "replica" or "balancer", region, result "success" or "failure").
        failovers: Counter by (region, balancer_region): each reassignment of ``region`` to ``balancer_region``'s
            balancer (equal names: failed back).
    """

    def __init__(self, snapshot: Callable[[], Membership], *, is_leader: Callable[[], bool]):
        self.registry = CollectorRegistry()
        self.registry.register(gc_pauses.PAUSES)  # the process's own (skylb/gc_pauses.py)
        self.registry.register(_MembershipCollector(snapshot, is_leader))
        self.health_checks = Counter("skylb_controller_health_checks", "Active health checks the controller ran, "
                                     "by target kind (replica, balancer), the target's region and result (success, "
                                     "failure).", ["target", "region", "result"], registry=self.registry)
        self.failovers = Counter("skylb_controller_failovers", "Regions reassigned to another region's balancer "
                                 "(failed over), or back to their own (balancer_region equal to region: failed back).",
                                 ["region", "balancer_region"], registry=self.registry)

    def checked(self, target: str, region: str, ok: bool) -> None:
        """Count one health check of a ``target`` ("replica" or "balancer") in ``region``."""
        self.health_checks.labels(target, region, "success" if ok else "failure").inc()

    def reassigned(self, region: str, balancer_region: str) -> None:
        """Count one reassignment of ``region`` to ``balancer_region``'s balancer."""
        self.failovers.labels(region, balancer_region).inc()

    def render(self) -> bytes:
        """The Prometheus exposition text of every metric."""
        return generate_latest(self.registry)
