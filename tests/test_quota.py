"""Quotas end to end with real processes: controller, balancers, emulated replicas, a real redis-server, and the
official openai client. A tenant over its limit waits, then gets 429 with Retry-After while another tenant is
served; 429 and 503 answers are in each API's shape; two balancers share one limit through Redis and keep serving,
within the documented bound, when Redis is stopped (skylb/quota/redis_backend.py)."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.cluster import MODEL, Cluster
from tests.quota_http import http_post as http
from tests.redis import start_redis

PEER = "peer-token-for-quota-tests-0123456789"
ADMIN = "admin-token-for-quota-tests-0123456789"
KEY_A, KEY_B, KEY_C = "sk-alpha-key-0123456789", "sk-beta-key-0123456789", "sk-gamma-key-0123456789"
OLLAMA_MODEL = "llama3.1:8b"
#: Emulated replicas: one running slot, 40 ms per decode step, and without ignore_eos at most 8 tokens.
EMULATOR = ("--max-num-seqs", "1", "--decode-base-ms", "40", "--eos-max-tokens", "8")


def chat(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def ollama_chat(num_predict: int = 4, **options) -> dict:
    return {"model": OLLAMA_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": num_predict, **options}}


def metric(cluster: Cluster, region: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` on a balancer's /metrics whose labels include ``labels``."""
    req = urllib.request.Request(f"{cluster.balancers[region]}/metrics", headers={"X-SkyLB-Token": PEER})
    with urllib.request.urlopen(req, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# 252 tokens a request (prompt "user: hi\n" = 2 tokens + max_tokens 250): two fit 600 tokens a minute, a third
# would need 15 s of refill, longer than the 2.5 s it may wait.
# gamma may run one request at a time.
TENANTS = {"tenants": {"alpha": [KEY_A], "beta": [KEY_B], "gamma": [KEY_C]},
           "quotas": {"tenants": {"alpha": {"limits": {"*": {"tokens_per_minute": 600}}},
                                  "gamma": {"limits": {"*": {"max_concurrent": 1}}}}},
           "quota": {"wait_s": 2.5}, "queue_timeout_s": 3.0,
           # The queue-timeout test needs requests to wait in the balancer: none beyond the batch in the engine.
           "pending_allowance": 0}


@pytest.fixture
def tenants(procs, tmp_path) -> Cluster:
    """Controller, one balancer (us) with tenants alpha (600 tokens/min) and beta (no limit), a vLLM and an Ollama
    emulated replica."""
    cluster = Cluster(procs, tmp_path, balancer=TENANTS, peer_token=PEER, admin_token=ADMIN,
                      controller={"health": {"enabled": False}})
    cluster.start_controller(["us"])
    vllm = cluster.start_emulator(1, *EMULATOR)
    ollama = cluster.start_emulator(1, "--engine", "ollama", "--model", OLLAMA_MODEL, *EMULATOR, name="ollama")
    cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", vllm[0])
    cluster.add_replica("us", ollama[0], engine="ollama")
    cluster.wait_replicas_healthy("us", 2)
    return cluster


def test_tenant_over_tokens_per_minute_waits_then_429_while_another_tenant_is_served(tenants):
    """alpha's third request of 252 tokens (600/min) waits in the balancer (status shows it waiting), then gets 429
    with a Retry-After near its refill time; beta is served meanwhile; the openai client raises RateLimitError."""
    base = tenants.balancers["us"]
    for _ in range(2):
        assert http(f"{base}/v1/chat/completions", chat(250), key=KEY_A)[0] == 200
    result: dict = {}

    def over_limit() -> None:
        started = time.monotonic()
        result["answer"] = http(f"{base}/v1/chat/completions", chat(250), key=KEY_A)
        result["took_s"] = time.monotonic() - started

    waiter = threading.Thread(target=over_limit)
    waiter.start()
    try:
        tenants.wait_until(lambda: tenants.status("us")["quota"]["waiting"] == {"alpha": 1}, timeout_s=2.4,
                           what="alpha's request waiting for its quota")
        status, body, _ = http(f"{base}/v1/chat/completions", chat(), key=KEY_B)
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert waiter.is_alive(), "alpha's request should still be waiting while beta is served"
    finally:
        waiter.join(timeout=10)
    status, body, headers = result["answer"]
    assert status == 429 and result["took_s"] >= 2.0  # it waited (wait_s 2.5 s) before the answer
    assert body["error"]["type"] == "rate_limit_exceeded" and "tokens per minute" in body["error"]["message"]
    # (252 - 96 left - 25 refilled in 2.5 s) / 10 tokens/s = 13 s (less what refilled while the first two requests
    # ran), jittered up to 1.5x, rounded up.
    assert 10 <= int(headers["Retry-After"]) <= 20, headers["Retry-After"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**chat(250))
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert tenants.status("us")["quota"]["waiting"] == {}
    assert metric(tenants, "us", "skylb_quota_rejected_total", tenant="alpha", reason="tokens_per_minute") == 2
    assert metric(tenants, "us", "skylb_rejected_requests_total", reason="tokens_per_minute", status="429") == 2
    assert metric(tenants, "us", "skylb_quota_admitted_total", tenant="alpha") == 2
    assert metric(tenants, "us", "skylb_quota_bucket_level", bucket="tenant/alpha/*", kind="in_flight") == 0


def test_a_client_that_leaves_frees_its_concurrency_slot(tenants):
    """gamma (one request at a time) starts a stream and leaves after the first chunk: its slot is released, so its
    next request is served; while a request holds the slot, another waits and gets 429 for max_concurrent."""
    base = tenants.balancers["us"]
    body = json.dumps(chat(100, ignore_eos=True, stream=True)).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY_C}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and resp.readline()  # the stream started: the slot is held
        status, body, headers = http(f"{base}/v1/chat/completions", chat(), key=KEY_C)
        assert status == 429 and "concurrent requests" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
    # The client left mid-stream (connection closed): the balancer ends the request and frees the slot.
    tenants.wait_until(lambda: tenants.status("us")["quota"]["levels"]["tenant/gamma/*"]["in_flight"] == 0,
                       timeout_s=5, what="gamma's slot released")
    assert http(f"{base}/v1/chat/completions", chat(), key=KEY_C)[0] == 200
    assert metric(tenants, "us", "skylb_quota_rejected_total", tenant="gamma", reason="max_concurrent") == 1


def test_429_and_503_bodies_in_each_api_shape(tenants):
    """429 (quota) and 503 (queue timeout, every replica busy) come in OpenAI's {"error": {message, type, param,
    code}} on /v1/* and Ollama's {"error": "..."} on /api/*, each with a whole-second Retry-After."""
    base = tenants.balancers["us"]
    for _ in range(2):
        assert http(f"{base}/v1/chat/completions", chat(250), key=KEY_A)[0] == 200
    status, body, headers = http(f"{base}/v1/chat/completions", chat(250), key=KEY_A)
    assert status == 429 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 429 and int(headers["Retry-After"]) >= 1
    status, body, headers = http(f"{base}/api/chat", ollama_chat(250), key=KEY_A)
    assert status == 429 and isinstance(body["error"], str) and "rate limit" in body["error"]
    assert int(headers["Retry-After"]) >= 1
    # Each replica has one running slot: two long generations each (120 tokens at 40 ms) keep one pending for
    # about 4.8 s, so beta's requests wait in the queue for queue_timeout_s (3 s) and get 503.
    busy = [(f"{base}/v1/chat/completions", chat(120, ignore_eos=True))] * 2 + \
           [(f"{base}/api/chat", ollama_chat(120, ignore_eos=True))] * 2
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(http, url, body, key=KEY_B) for url, body in busy]
        time.sleep(0.5)
        # Prompts no replica holds: a cache hit would be pushed into its holder's batch instead of waiting here.
        fresh = [{"role": "user", "content": f"a question nobody asked before, number {i}, " * 4} for i in range(2)]
        openai_503 = pool.submit(http, f"{base}/v1/chat/completions", chat() | {"messages": [fresh[0]]}, key=KEY_B)
        ollama_503 = pool.submit(http, f"{base}/api/chat", ollama_chat() | {"messages": [fresh[1]]}, key=KEY_B)
        status, body, headers = openai_503.result(timeout=20)
        assert status == 503 and body["error"]["type"] == "overloaded_error" and body["error"]["code"] == 503
        assert int(headers["Retry-After"]) >= 1
        status, body, headers = ollama_503.result(timeout=20)
        assert status == 503 and isinstance(body["error"], str) and int(headers["Retry-After"]) >= 1
        assert all(f.result(timeout=30)[0] == 200 for f in running)


# --- two balancers, one limit, through Redis -----------------------------------------------------------------------

LIMIT = 10  # requests per minute for tenant alpha, shared by both balancers


def _burst(cluster: Cluster, n: int) -> tuple[int, int]:
    """``n`` requests of alpha spread over both balancers, 8 at a time; (answered 200, answered 429). Any other
    status fails the test."""
    urls = [cluster.balancers[("us", "eu")[i % 2]] for i in range(n)]
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda url: http(f"{url}/v1/chat/completions", chat(), key=KEY_A)[0], urls))
    assert set(statuses) <= {200, 429}, statuses
    return statuses.count(200), statuses.count(429)


def test_two_balancers_share_one_limit_through_redis_and_survive_its_loss(procs, tmp_path):
    """Two balancers with one Redis admit no more than alpha's 10 requests/min together (plus the refill during
    the test); with redis-server stopped, both keep serving on their halves of the limit, within the documented
    bound (one more limit's worth per switch); when Redis is back they use it again."""
    with start_redis(tmp_path) as redis:
        cfg = {"tenants": {"alpha": [KEY_A]},
               "quotas": {"tenants": {"alpha": {"limits": {"*": {"requests_per_minute": LIMIT}}}}},
               "quota": {"redis_url": redis.url, "wait_s": 0.3, "redis_retry_s": 1.0, "redis_timeout_s": 0.3,
                         "redis_connect_timeout_s": 0.3}}
        cluster = Cluster(procs, tmp_path, balancer=cfg, peer_token=PEER, admin_token=ADMIN,
                          controller={"health": {"enabled": False}})
        regions = ["us", "eu"]
        cluster.start_controller(regions)
        replicas = cluster.start_emulator(2, "--decode-base-ms", "5", "--eos-max-tokens", "8")
        for region, url in zip(regions, replicas):
            cluster.start_balancer(region, regions)
            cluster.add_replica(region, url)
        for region in regions:
            cluster.wait_replicas_healthy(region, 1)
            cluster.wait_peers_probed(region, 1)
        started = time.monotonic()
        ok1, refused1 = _burst(cluster, 3 * LIMIT)
        refill = math.ceil(LIMIT * (time.monotonic() - started) / 60)
        assert LIMIT <= ok1 <= LIMIT + refill and refused1 >= LIMIT
        assert all(cluster.status(r)["quota"]["backend"] == "redis" for r in regions)

        redis.stop()
        ok2, refused2 = _burst(cluster, 3 * LIMIT)
        refill = math.ceil(LIMIT * (time.monotonic() - started) / 60)
        for region in regions:
            quota = cluster.status(region)["quota"]
            assert quota["redis_fallback"] is True and quota["share"] == 0.5, quota
            assert metric(cluster, region, "skylb_quota_redis_fallback") == 1
        assert ok2 >= 1, "the balancers stopped serving when Redis went away"
        # The bound (redis_backend.py): one switch adds at most one limit's worth within the window.
        assert ok1 + ok2 <= 2 * LIMIT + refill, (ok1, ok2, refill)
        print(f"limit {LIMIT}/min: {ok1} admitted with Redis, {ok2} more on the shares after Redis stopped "
              f"(bound {2 * LIMIT + refill})")

        redis.start()
        for region in regions:
            cluster.wait_until(lambda: cluster.status(region)["quota"]["redis_fallback"] is False, timeout_s=10,
                               what=f"{region} back on Redis")
        assert http(f"{cluster.balancers['us']}/v1/chat/completions", chat(), key=KEY_A)[0] == 200
        assert metric(cluster, "us", "skylb_quota_redis_fallback") == 0
