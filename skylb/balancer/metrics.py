"""The balancer's Prometheus metrics (prometheus_client, one registry per balancer).

Gauges describing state (queue length, per-replica pending / availability, per-peer availability, controller
reachability) are read from the router at scrape time by a collector, so they are never out of date and cost
nothing between scrapes. Events (requests routed, responses, TTFT, end-to-end and inter-token latency, queue wait,
tokens) are counters and histograms.

Names follow Prometheus's "Metric and label naming" (prometheus.io, Practices): the ``skylb_`` prefix, base units
(``_seconds``, ``_bytes``), counters exposed with ``_total`` (prometheus_client appends it), no colons (those are for
recording rules, deploy/prometheus/). Label values are bounded: a ``tenant`` label is a configured tenant's name
(an API key's tenant, a tenant with quotas, or ``default``), any other is ``other`` (:class:`TenantLabels`); a
``model`` label is a model the target that served the request reports serving, else ``other`` (:func:`model_label`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import GaugeMetricFamily

from skylb import gc_pauses
from skylb.core import Router

__all__ = ["BalancerMetrics", "CONTENT_TYPE", "OPENMETRICS_CONTENT_TYPE", "OTHER", "TenantLabels", "model_label"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST
#: The label value of every tenant that is not configured and every model its target does not report.
OTHER = "other"
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)
#: End-to-end times: a long generation takes minutes.
_E2E_BUCKETS_S = _LATENCY_BUCKETS_S + (180, 300, 600)
#: Time per output token after the first (vLLM's ``vllm:inter_token_latency_seconds`` buckets, from 1 ms).
_INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                          0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class TenantLabels:
    """The ``tenant`` label of a tenant: its name when configured, else :data:`OTHER`, so that clients cannot
    grow the number of series (Prometheus, "Instrumentation": "Do not overuse labels").

    Args:
        configured: whether a tenant is configured now (an API key's tenant, a tenant with quotas, ``default``);
            asked at each call, so tenants added at run time get their own label.
    """

    def __init__(self, configured: Callable[[str], bool]):
        self.configured = configured

    def __call__(self, tenant: str | None) -> str:
        """``tenant``'s label (None, before classification: ``default``)."""
        if tenant is None:
            return "default"
        return tenant if self.configured(tenant) else OTHER


def model_label(router: Router, decision, model: str | None, api: str) -> str:
    """The ``model`` label of a request for ``model`` that ``decision`` (skylb.core.Decision) sent to its target:
    the name when that replica (or peer, in dialect ``api``) reports serving it, else :data:`OTHER` (an engine
    that lists no models would otherwise let clients name series)."""
    if not model:
        return OTHER
    if decision.route == "local":
        replica = router.replicas.get(decision.target)
        models = None if replica is None else replica.models
    else:
        peer = router.peers.get(decision.target)
        models = None if peer is None or not peer.models else peer.models.get(api)
    return model if models and model in models else OTHER


class _StateCollector:
    """Reads router state at scrape time (the router, the clock and the controller's reachability: nothing else)."""

    def __init__(self, router: Router, now: Callable[[], float], controller_reachable: Callable[[], bool],
                 tenant_label: TenantLabels):
        self.router = router
        self.now = now
        self.controller_reachable = controller_reachable
        self.tenant_label = tenant_label

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
        lengths: dict[tuple[str, str], int] = {}
        for (priority, tenant), n in _queue_lengths(router).items():
            key = (priority, self.tenant_label(tenant))
            lengths[key] = lengths.get(key, 0) + n
        for (priority, tenant), n in lengths.items():
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
        controller_reachable: whether the latest controller call succeeded; tenant_configured: whether a tenant
            is configured now (:class:`TenantLabels`; default: only ``default`` is).
    """

    def __init__(self, router: Router, *, now: Callable[[], float], controller_reachable: Callable[[], bool],
                 tenant_configured: Callable[[str], bool] = lambda tenant: tenant == "default"):
        self.router = router
        self.registry = CollectorRegistry()
        #: The bounded tenant label (for every metric with a ``tenant`` label, the quota gate's too).
        self.tenant_label = TenantLabels(tenant_configured)
        self.registry.register(_StateCollector(router, now, controller_reachable, self.tenant_label))
        self.registry.register(gc_pauses.PAUSES)  # the process's own (skylb/gc_pauses.py)
        self.routed = Counter("skylb_requests_routed", "Requests routed, by route (local or peer), target "
                              "(replica id or peer region) and rule (the routing profile's plugin that chose the "
                              "target, or pinned).", ["region", "route", "target", "rule"], registry=self.registry)
        self.responses = Counter("skylb_responses", "Responses sent to clients, by HTTP status.",
                                 ["region", "status"], registry=self.registry)
        self.ttft = Histogram("skylb_ttft_seconds", "Time from arrival at this balancer to the first streamed byte "
                              "relayed to the client, s.", ["region", "route"], buckets=_LATENCY_BUCKETS_S,
                              registry=self.registry)
        self.e2e = Histogram("skylb_e2e_latency_seconds", "Time from arrival at this balancer to the last byte of a "
                             "successful answer (status < 400, whole), s; a forwarded request counts at both "
                             "balancers (route peer, then local), as TTFT does.",
                             ["region", "route", "model", "tenant"], buckets=_E2E_BUCKETS_S, registry=self.registry)
        self.inter_token = Histogram("skylb_inter_token_latency_seconds", "Time per output token after the first "
                                     "of a successful stream that reported its usage: (end-to-end - TTFT) / "
                                     "(completion tokens - 1), s.", ["region", "model", "tenant"],
                                     buckets=_INTER_TOKEN_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter("skylb_prompt_tokens", "Prompt tokens of answered requests, from the usage "
                                     "they reported; counted by the balancer the client called only.",
                                     ["region", "model", "tenant"], registry=self.registry)
        self.completion_tokens = Counter("skylb_completion_tokens", "Completion (output) tokens of answered "
                                         "requests, from the usage they reported; counted by the balancer the "
                                         "client called only.", ["region", "model", "tenant"], registry=self.registry)
        self.queue_wait = Histogram("skylb_queue_wait_seconds", "Time requests waited in the queue, by priority "
                                    "class, s.", ["region", "priority"], buckets=_LATENCY_BUCKETS_S,
                                    registry=self.registry)
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

    def observe_answer(self, region: str, route: str, model: str, tenant: str, *, e2e_s: float,
                       ttft_s: float | None, usage, count_tokens: bool) -> None:
        """Count one successful answer: its end-to-end time (s); with ``usage`` (skylb.core.rates.Usage), its tokens
        (when ``count_tokens``: the balancer the client called) and, for a stream (``ttft_s`` given) of more than
        one completion token, its time per output token after the first, (e2e - TTFT) / (tokens - 1), as the
        OpenTelemetry GenAI semantic conventions define ``gen_ai.server.time_per_output_token`` ("Semantic
        conventions for generative AI metrics"). ``model`` and ``tenant`` are labels already bounded."""
        self.child(self.e2e, region, route, model, tenant).observe(e2e_s)
        if usage is None:
            return
        out = usage.output_tokens
        if count_tokens:
            if usage.prompt_tokens:
                self.child(self.prompt_tokens, region, model, tenant).inc(usage.prompt_tokens)
            if out:
                self.child(self.completion_tokens, region, model, tenant).inc(out)
        if ttft_s is not None and out is not None and out > 1 and e2e_s >= ttft_s:
            self.child(self.inter_token, region, model, tenant).observe((e2e_s - ttft_s) / (out - 1))

    def render(self) -> bytes:
        """The Prometheus exposition text of every metric."""
        return generate_latest(self.registry)

    def render_openmetrics(self) -> bytes:
        """The OpenMetrics text of every metric (content type OPENMETRICS_CONTENT_TYPE): with the exemplars that
        link TTFT observations to their traces when the balancer traces (the OpenMetrics specification, "Exemplars";
        Prometheus 0.0.4 text has no place for them)."""
        return openmetrics.generate_latest(self.registry)
