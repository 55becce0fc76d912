"""The embedding cache's keys, bounds and metrics, and request classification (in process; the end-to-end checks
with real processes are in tests/test_priorities.py)."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from skylb.balancer.embed_cache import ENTRY_OVERHEAD_BYTES, EmbeddingCache, EmbeddingCacheSettings
from skylb.config import BalancerConfig
from skylb.quota.priorities import BadPriority, classify, peer_class, peer_headers


def _cache(**settings):
    registry = CollectorRegistry()
    return EmbeddingCache(EmbeddingCacheSettings(enabled=True, **settings), region="us", registry=registry), registry


def _metric(registry, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _key(path="/v1/embeddings", tenant="default", auth=None, **body):
    return EmbeddingCache.key(path, json.dumps({"model": "m", "input": "hello", **body}).encode(), tenant=tenant,
                              authorization=auth)


def test_keys_hold_everything_that_changes_the_vectors_and_nothing_else():
    base = _key()
    assert base == EmbeddingCache.key("/v1/embeddings", b'{"input": "hello", "model": "m"}', tenant="default",
                                      authorization=None)  # field order does not matter
    assert base == _key(user="alice") == _key(keep_alive="5m")  # fields that never change the vectors
    different = [_key(input="hello!"), _key(model="m2"), _key(dimensions=64), _key(encoding_format="base64"),
                 _key(truncate=False), _key(options={"num_ctx": 512}), _key(path="/api/embed"),
                 _key(tenant="other"), _key(auth="Bearer a"), _key(auth="Bearer b")]
    assert len({base, *different}) == len(different) + 1
    assert _key(path="/v1/chat/completions") is None
    assert EmbeddingCache.key("/api/embed", b"[1, 2]", tenant="t", authorization=None) is None
    assert EmbeddingCache.key("/api/embed", b"{not json", tenant="t", authorization=None) is None


def test_hits_misses_and_the_byte_bound_with_evictions_counted():
    cache, registry = _cache(max_bytes=3 * (100 + ENTRY_OVERHEAD_BYTES))
    assert cache.get("a") is None
    for k in "abc":
        assert cache.put(k, b"x" * 100)
    hit = cache.get("a")  # a is now the most recently used
    assert hit.status == 200 and hit.body == b"x" * 100 and hit.content_type == "application/json"
    assert cache.put("d", b"y" * 100)  # over the bound: b, least recently used, goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("d") is not None
    assert not cache.put("huge", b"z" * 10_000)  # larger than the whole bound: not kept, nothing evicted for it
    assert _metric(registry, "skylb_embedding_cache_hits_total", region="us") == 3
    assert _metric(registry, "skylb_embedding_cache_misses_total", region="us") == 2
    assert _metric(registry, "skylb_embedding_cache_evictions_total", reason="size", region="us") == 1
    assert _metric(registry, "skylb_embedding_cache_entries", region="us") == 3
    assert _metric(registry, "skylb_embedding_cache_bytes", region="us") == 3 * (100 + ENTRY_OVERHEAD_BYTES)


def test_entries_expire_after_ttl_and_are_counted():
    cache, registry = _cache(ttl_s=0.2)
    cache.put("a", b"{}")
    assert cache.get("a") is not None
    time.sleep(0.3)
    assert cache.get("a") is None
    assert _metric(registry, "skylb_embedding_cache_entries", region="us") == 0  # the scrape expires it
    assert _metric(registry, "skylb_embedding_cache_evictions_total", reason="ttl", region="us") == 1


def test_the_cache_is_off_by_default():
    assert EmbeddingCache.from_settings(BalancerConfig().embedding_cache, region="us",
                                        registry=CollectorRegistry()) is None
    with pytest.raises(ValueError):
        BalancerConfig(embedding_cache={"enabled": True, "max_bytes": 0})


@pytest.mark.parametrize("path, header, default, expected", [
    ("/v1/embeddings", None, "low", "critical"),
    ("/api/embed", "low", "normal", "critical"),  # embeddings are critical by path, whatever the header says
    ("/api/embeddings", None, "normal", "critical"),
    ("/v1/chat/completions", "high", "low", "high"),
    ("/api/generate", " LOW ", "high", "low"),
    ("/v1/completions", None, "high", "high"),  # the tenant's default class
    ("/v1/completions", None, "normal", "normal"),
])
def test_classification(path, header, default, expected):
    assert classify(path, header, default) == expected


@pytest.mark.parametrize("header", ["critical", "urgent", "", "1"])
def test_a_bad_priority_header_is_refused_while_classes_are_on(header):
    with pytest.raises(BadPriority, match="high, normal, low"):
        classify("/v1/completions", header, "normal")
    assert classify("/v1/completions", header, "normal", use_header=False) == "normal"


def test_class_and_tenant_travel_to_peers_and_bad_values_are_dropped():
    assert peer_headers("critical", "acme") == {"X-SkyLB-Priority": "critical", "X-SkyLB-Tenant": "acme"}
    assert peer_headers("low", "caf\u00e9") == {"X-SkyLB-Priority": "low"}
    assert peer_class("critical", "acme") == ("critical", "acme")
    assert peer_class("urgent", "x" * 200) == (None, None)
    assert peer_class(None, None) == (None, None)


def test_the_pipeline_classifies_by_the_tenants_default_class_and_trusts_peers_only():
    """classify_request (the classify stage's rule): a tenant's default class without a header; X-Priority over it; the
    peer headers only on a forwarded request; with classes off the header is ignored but embeddings stay critical."""
    from aiohttp.test_utils import make_mocked_request

    from skylb.balancer.auth import TENANT
    from skylb.balancer.balancer import Balancer
    from skylb.balancer.stages.classify import classify_request

    quotas = {"tenants": {"batch": {"priority": "low", "weight": 0.5}}}

    def request(path="/v1/completions", tenant="batch", **headers):
        req = make_mocked_request("POST", path, headers=headers)
        req[TENANT] = tenant
        return req

    on = Balancer(BalancerConfig(priorities={"enabled": True}, quotas=quotas), region="us", advertise_url="http://x")

    def on_(req, forwarded=False):
        return classify_request(req, forwarded=forwarded, quotas=on.quotas, use_header=True)

    def off_(req):
        return classify_request(req, forwarded=False, quotas=off.quotas, use_header=False)

    assert on_(request()) == ("low", "batch")
    assert on_(request(**{"X-Priority": "high"})) == ("high", "batch")
    assert on_(request(tenant="default")) == ("normal", "default")
    spoofed = request(**{"X-SkyLB-Priority": "critical", "X-SkyLB-Tenant": "vip"})
    assert on_(spoofed) == ("low", "batch")
    assert on_(spoofed, forwarded=True) == ("critical", "vip")
    with pytest.raises(BadPriority):
        on_(request(**{"X-Priority": "now"}))
    assert on.router.classes.weight_of("batch") == 0.5 and on.router.classes.weight_of("other") == 1.0
    off = Balancer(BalancerConfig(quotas=quotas), region="us", advertise_url="http://x")
    assert off_(request(**{"X-Priority": "now"})) == ("low", "batch")
    assert off_(request("/v1/embeddings")) == ("critical", "batch")
