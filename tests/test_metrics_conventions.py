"""The balancer's metric conventions in-process: bounded tenant and model labels, the inter-token latency and token
counts an answer yields, and the exposition accepted by `promtool check metrics`."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

from skylb.balancer.metrics import OTHER, BalancerMetrics, model_label
from skylb.config import BalancerConfig
from skylb.core import build_router
from skylb.core.rates import Usage
from tests.system import require_binary


def _metrics(configured=("default", "alpha")):
    router = build_router("us", BalancerConfig())
    router.set_replicas([("r1", "http://127.0.0.1:1", "vllm")])
    router.replicas["r1"].models = {"m": None}
    return router, BalancerMetrics(router, now=lambda: 0.0, controller_reachable=lambda: True,
                                   tenant_configured=lambda t: t in configured)


def _sample(metrics: BalancerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_tenant_and_model_labels_are_bounded():
    """A configured tenant keeps its name, any other is "other"; a model the target reports keeps its name, one
    it does not (or a target that reports none) is "other"."""
    router, metrics = _metrics()
    assert [metrics.tenant_label(t) for t in ("alpha", "default", None, "mallory-1", "mallory-2")] == \
        ["alpha", "default", "default", OTHER, OTHER]
    local = SimpleNamespace(route="local", target="r1")
    assert model_label(router, local, "m", "openai") == "m"
    assert model_label(router, local, "made-up", "openai") == OTHER
    assert model_label(router, SimpleNamespace(route="local", target="gone"), "m", "openai") == OTHER
    assert model_label(router, SimpleNamespace(route="peer", target="eu"), "m", "openai") == OTHER


def test_an_answer_counts_its_latencies_and_tokens_once():
    """A stream of 11 completion tokens, 2 s end to end with a 0.5 s TTFT: one end-to-end observation (2 s), one
    inter-token observation ((2 - 0.5) / 10 = 0.15 s), 10 prompt and 11 completion tokens; the same answer
    relayed for a peer (count_tokens False) adds latencies but no tokens; a whole (not streamed) answer has no
    inter-token latency."""
    _, metrics = _metrics()
    usage = Usage(prompt_tokens=10, prefilled_tokens=10, output_tokens=11)
    metrics.observe_answer("us", "local", "m", "alpha", e2e_s=2.0, ttft_s=0.5, usage=usage, count_tokens=True)
    metrics.observe_answer("us", "local", "m", "alpha", e2e_s=2.0, ttft_s=0.5, usage=usage, count_tokens=False)
    metrics.observe_answer("us", "local", "m", "alpha", e2e_s=1.0, ttft_s=None, usage=usage, count_tokens=False)
    labels = dict(region="us", model="m", tenant="alpha")
    assert _sample(metrics, "skylb_e2e_latency_seconds_count", route="local", **labels) == 3
    assert _sample(metrics, "skylb_e2e_latency_seconds_sum", route="local", **labels) == 5.0
    assert _sample(metrics, "skylb_inter_token_latency_seconds_count", **labels) == 2
    assert abs(_sample(metrics, "skylb_inter_token_latency_seconds_sum", **labels) - 0.3) < 1e-9
    assert _sample(metrics, "skylb_prompt_tokens_total", **labels) == 10
    assert _sample(metrics, "skylb_completion_tokens_total", **labels) == 11


def test_exposition_passes_promtool_check_metrics():
    """Every balancer metric, each with a sample, passes `promtool check metrics` (Prometheus's naming lint:
    counters end in _total, base units, no colons, help text)."""
    _, metrics = _metrics()
    metrics.observe_answer("us", "local", "m", "alpha", e2e_s=2.0, ttft_s=0.5,
                           usage=Usage(prompt_tokens=3, output_tokens=4), count_tokens=True)
    for counter, labels in ((metrics.routed, ("us", "local", "r1", "estimated_ttft")),
                            (metrics.responses, ("us", "200")),
                            (metrics.rejected, ("us", "queue_full", "503")), (metrics.retries, ("us",)),
                            (metrics.retry_budget_exhausted, ("us",)), (metrics.ejections, ("us", "local", "r1"))):
        counter.labels(*labels).inc()
    metrics.ttft.labels("us", "local").observe(0.1)
    metrics.queue_wait.labels("us", "normal").observe(0.1)
    text = metrics.render()
    assert b"skylb_inter_token_latency_seconds_bucket" in text and b"skylb_prompt_tokens_total" in text
    checked = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text, capture_output=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
