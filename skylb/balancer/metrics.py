"""The balancer's Prometheus metrics (prometheus_client, one registry per balancer).

Gauges describing state (queue length, per-replica pending / availability, per-peer availability, controller
reachability) are read from the router at scrape time by a collector, so they are never out of date and cost
nothing between scrapes. Events (requests routed, responses, TTFT, queue wait) are counters and histograms.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import GaugeMetricFamily

from skylb.core import Router

__all__ = ["BalancerMetrics", "CONTENT_TYPE", "OPENMETRICS_CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)


class _StateCollector:
    """Reads router state at scrape time (the router, the clock and the controller's reachability: nothing else)."""

    def __init__(self, router: Router, now: Callable[[], float], controller_reachable: Callable[[], bool]):
        self.router = router
        self.now = now
        self.controller_reachable = controller_reachable

    def collect(self):
        router, now = self.router, self.now()
        region = router.region
        queue = GaugeMetricFamily("skylb_queue_length", "Requests waiting in this balancer's queue.",
                                  labels=["region"])
        queue.add_metric([region], len(router.queue))
        yield queue
        by_class = GaugeMetricFamily("skylb_queue_length_by_class", "Requests waiting in this balancer's queue, by "
                                     "priority class and tenant (the class a FCFS queue would give them when "
                                     "balancer.priorities is off).", labels=["region", "priority", "tenant"])
        for (priority, tenant), n in _queue_lengths(router).items():
            by_class.add_metric([region, priority, tenant], n)
        yield by_class
        pending = GaugeMetricFamily("skylb_replica_pending_requests",
                                    "Pending requests at each local replica in its latest probe.",
                                    labels=["region", "replica"])
        outstanding = GaugeMetricFamily("skylb_replica_outstanding_requests",
                                        "Requests this balancer sent to each replica that have not finished.",
                                        labels=["region", "replica"])
        available = GaugeMetricFamily("skylb_replica_available",
                                      "1 when the replica may take a request now (selective pushing), else 0; "
                                      "reason says why not.", labels=["region", "replica", "reason"])
        for r in router.replicas.values():
            pending.add_metric([region, r.id], r.pending)
            outstanding.add_metric([region, r.id], r.outstanding)
            reason = router.replica_unavailable_reason(r, now)
            available.add_metric([region, r.id, reason or ""], 0 if reason else 1)
        yield pending
        yield outstanding
        yield available
        peers = GaugeMetricFamily("skylb_peer_available", "1 when the peer balancer may take forwarded requests.",
                                  labels=["region", "peer", "reason"])
        for p in router.peers.values():
            reason = router.peer_unavailable_reason(p, now)
            peers.add_metric([region, p.region, reason or ""], 0 if reason else 1)
        yield peers
        ctl = GaugeMetricFamily("skylb_controller_reachable",
                                "1 when the latest controller call succeeded; 0: serving on the last membership.",
                                labels=["region"])
        ctl.add_metric([region], 1 if self.controller_reachable() else 0)
        yield ctl


def _queue_lengths(router: Router) -> dict[tuple[str, str], int]:
    """Queued requests by (priority class, tenant): O(classes x tenants) with classes, one pass over a FCFS queue
    (at most max_queue requests, at scrape time only)."""
    if router.classes is not None:
        return router.classes.lengths()
    lengths: dict[tuple[str, str], int] = {}
    for r in router.queue:
        lengths[(r.priority, r.tenant)] = lengths.get((r.priority, r.tenant), 0) + 1
    return lengths


class BalancerMetrics:
    """All metrics of one balancer; ``render()`` gives the Prometheus text.

    Args:
        router: the region's routing core (read at scrape time); now: the balancer's clock (s);
        controller_reachable: whether the latest controller call succeeded.
    """

    def __init__(self, router: Router, *, now: Callable[[], float], controller_reachable: Callable[[], bool]):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(router, now, controller_reachable))
        self.routed = Counter("skylb_requests_routed", "Requests routed, by route (local or peer) and target "
                              "(replica id or peer region).", ["region", "route", "target"], registry=self.registry)
        self.responses = Counter("skylb_responses", "Responses sent to clients, by HTTP status.",
                                 ["region", "status"], registry=self.registry)
        self.ttft = Histogram("skylb_ttft_seconds", "Time from arrival at this balancer to the first streamed byte "
                              "relayed to the client, s.", ["region", "route"], buckets=_LATENCY_BUCKETS_S,
                              registry=self.registry)
        self.queue_wait = Histogram("skylb_queue_wait_seconds", "Time requests waited in the queue, s.", ["region"],
                                    buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.queue_wait_by_class = Histogram("skylb_queue_wait_by_class_seconds", "Time requests waited in the "
                                             "queue by priority class, s.", ["region", "priority"],
                                             buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.rejected = Counter("skylb_rejected_requests", "Client requests the balancer answered with an error "
                                "of its own (bad input, unknown or unavailable model, queue full, internal error), "
                                "by reason and HTTP status.", ["region", "reason", "status"], registry=self.registry)
        self.retries = Counter("skylb_retries", "Requests re-queued after a target failed before the first byte.",
                               ["region"], registry=self.registry)
        self.retry_budget_exhausted = Counter("skylb_retry_budget_exhausted", "Requests that failed before the "
                                              "first byte and were not retried because the retry budget was spent.",
                                              ["region"], registry=self.registry)
        self.ejections = Counter("skylb_outlier_ejections", "Targets ejected by outlier detection (consecutive "
                                 "5xx or gateway failures), by route (local or peer) and target.",
                                 ["region", "route", "target"], registry=self.registry)
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}

    def child(self, metric: Counter | Histogram, *values: str):
        """``metric.labels(*values)``, looked up once and then kept: ``labels`` validates its arguments and takes a
        lock on every call (about 5 us, several times per request, in bench/results/overhead.md's profile), and the
        request path asks for the same few children again and again. The child is the one ``labels`` returns."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def render(self) -> bytes:
        """The Prometheus exposition text of every metric."""
        return generate_latest(self.registry)

    def render_openmetrics(self) -> bytes:
        """The OpenMetrics text of every metric (content type OPENMETRICS_CONTENT_TYPE): with the exemplars that
        link TTFT observations to their traces when the balancer traces (the OpenMetrics specification, "Exemplars";
        Prometheus 0.0.4 text has no place for them)."""
        return openmetrics.generate_latest(self.registry)
