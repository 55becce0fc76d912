"""Quota metrics (prometheus_client), registered in the balancer's registry (skylb/balancer/metrics.py).

Events are counters and a histogram: requests admitted and rejected by tenant, model and reason (the limit that
refused: tokens_per_minute, requests_per_minute, max_concurrent), the seconds a request waited for its quota.
State is read at scrape time by a collector: bucket levels (tokens, requests, in flight) by bucket key, requests
waiting for a quota by tenant, and whether Redis is unreachable (this balancer counting on its share).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

__all__ = ["QuotaMetrics"]

_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


class _QuotaStateCollector:
    def __init__(self, region: str, levels: Callable[[], dict[str, dict[str, float]]],
                 waiting: Callable[[], dict[str, int]], fallback: Callable[[], bool | None],
                 tenant_label: Callable[[str], str]):
        self.region, self.levels, self.waiting, self.fallback = region, levels, waiting, fallback
        self.tenant_label = tenant_label

    def collect(self):
        region = self.region
        levels = GaugeMetricFamily("skylb_quota_bucket_level", "Level of each quota bucket as last computed: kind "
                                   "tokens (tokens left), requests (requests left), in_flight (admitted, not ended).",
                                   labels=["region", "bucket", "kind"])
        for key, values in sorted(self.levels().items()):
            for kind, value in values.items():
                levels.add_metric([region, key, kind], value)
        yield levels
        waiting = GaugeMetricFamily("skylb_quota_waiting_requests", "Requests waiting for room in their quota "
                                    "(before the queue's routing), by tenant.", labels=["region", "tenant"])
        by_label: dict[str, int] = {}
        for tenant, n in self.waiting().items():
            label = self.tenant_label(tenant)
            by_label[label] = by_label.get(label, 0) + n
        for tenant, n in sorted(by_label.items()):
            waiting.add_metric([region, tenant], n)
        yield waiting
        fallback = self.fallback()
        if fallback is not None:  # only with Redis configured
            gauge = GaugeMetricFamily("skylb_quota_redis_fallback", "1 while Redis is unreachable and this balancer "
                                      "enforces its share of every limit on its own; 0 with Redis.",
                                      labels=["region"])
            gauge.add_metric([region], 1 if fallback else 0)
            yield gauge


class QuotaMetrics:
    """The quota gate's metrics in ``registry``.

    Args:
        region: this balancer's region (a label on every metric); levels: the limit backend's bucket levels;
        waiting: {tenant: requests waiting}; fallback: True while Redis is unreachable, False with Redis, None
        without Redis configured; tenant_label: a tenant's label (skylb/balancer/metrics.py TenantLabels: a
        tenant that is not configured counts as ``other``; default: the name).
    """

    def __init__(self, registry: CollectorRegistry, *, region: str,
                 levels: Callable[[], dict[str, dict[str, float]]], waiting: Callable[[], dict[str, int]],
                 fallback: Callable[[], bool | None], tenant_label: Callable[[str], str] = lambda tenant: tenant):
        #: Every recording site labels a tenant through this.
        self.tenant_label = tenant_label
        registry.register(_QuotaStateCollector(region, levels, waiting, fallback, tenant_label))
        self.admitted = Counter("skylb_quota_admitted", "Requests admitted by their quotas, by tenant and model.",
                                ["region", "tenant", "model"], registry=registry)
        self.rejected = Counter("skylb_quota_rejected", "Requests answered 429 after waiting wait_s for their "
                                "quota, by tenant, model and the limit that refused (reason).",
                                ["region", "tenant", "model", "reason"], registry=registry)
        self.wait = Histogram("skylb_quota_wait_seconds", "Time requests waited for room in their quota, s "
                              "(admitted or not).", ["region", "tenant"], buckets=_WAIT_BUCKETS_S, registry=registry)
