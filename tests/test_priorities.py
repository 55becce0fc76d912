"""Priority classes, tenants and the embedding cache with real processes: a controller, an emulated Ollama replica
with one slot (registered with max_concurrency 1, so the balancer holds everything else in its queue), and a real
balancer with ``balancer.priorities`` on.

With one slot, the order in which requests complete is the order in which the balancer placed them, and each
generation takes a few hundred ms, so orders are read from completion with wide margins (no timing assertions).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import ollama
import openai
import requests

from tests.cluster import Cluster

PEER_TOKEN = "priorities-peer-token-0d7c3e91a5b2f846"

OLLAMA_MODEL = "llama3.1:8b"
#: Half speed: a 20-token generation takes about half a second, a 60-token one about 1.5 s.
EMULATOR = ("--engine", "ollama", "--model", OLLAMA_MODEL, "--parallel", "1", "--time-scale", "0.5")
SHORT, LONG = 20, 60


def _region(procs, tmp_path, *, balancer: dict | None = None, peer_token: str | None = None):
    """us: a balancer with priority classes on and one one-slot Ollama replica; returns (cluster, url, replica)."""
    cfg = {"priorities": {"enabled": True}, "queue_timeout_s": 60, **(balancer or {})}
    cluster = Cluster(procs, tmp_path, balancer=cfg, peer_token=peer_token)
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, *EMULATOR, name="emu-ollama")
    url = cluster.start_balancer("us", ["us"])
    cluster.ctl("replica", "add", "--region", "us", "--url", replica, "--engine", "ollama", "--max-concurrency", "1")
    cluster.wait_replicas_healthy("us", 1)
    cluster.wait_until(lambda: OLLAMA_MODEL in (cluster.status("us")["replicas"][0].get("models") or []),
                       what="the replica's models")
    return cluster, url, replica


def _generate(url: str, prompt: str, tokens: int, headers: dict | None = None) -> requests.Response:
    body = {"model": OLLAMA_MODEL, "prompt": prompt, "stream": False,
            "options": {"num_predict": tokens, "ignore_eos": True}}
    return requests.post(f"{url}/api/generate", json=body, headers=headers, timeout=60)


def _metrics(url: str, headers: dict | None = None) -> str:
    req = urllib.request.Request(f"{url}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    """The value of the sample ``name`` whose labels include ``labels`` (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class _Order:
    """Names in the order their requests completed (thread-safe)."""

    def __init__(self):
        self.names: list[str] = []
        self._lock = threading.Lock()

    def run(self, name: str, call):
        result = call()
        with self._lock:
            self.names.append(name)
        return result


def _block(cluster: Cluster, pool, order: _Order, url: str, headers: dict | None = None, tokens: int = LONG):
    """Start a long generation that holds the only slot; returns its future once it runs."""
    future = pool.submit(order.run, "blocker", lambda: _generate(url, "blocker", tokens, headers))
    cluster.wait_until(lambda: cluster.status("us")["replicas"][0]["outstanding"] == 1, what="the blocker runs")
    return future


def _queue(cluster: Cluster, n: int) -> None:
    cluster.wait_until(lambda: cluster.status("us")["queue_len"] == n, what=f"{n} requests queued")


def test_an_embedding_overtakes_queued_generations_and_metadata_never_queues(procs, tmp_path):
    """Three generations wait behind a running one; an embedding (official ollama client) sent after them is
    placed first (critical by path): it completes before any of them runs. Meanwhile the metadata endpoints
    answer without queueing, and the metrics count the queue by class and the waits by class."""
    cluster, url, _ = _region(procs, tmp_path)
    order = _Order()
    client = ollama.Client(host=url, timeout=60)
    with ThreadPoolExecutor(6) as pool:
        blocker = _block(cluster, pool, order, url)
        generations = []
        for i in range(3):
            generations.append(pool.submit(order.run, f"gen{i}", lambda i=i: _generate(url, f"queued {i}", SHORT)))
            _queue(cluster, i + 1)
        # Metadata endpoints never queue: they answer now, with the only slot busy and three requests queued.
        assert requests.get(f"{url}/api/tags", timeout=5).status_code == 200
        assert requests.get(f"{url}/api/version", timeout=5).status_code == 200
        assert requests.get(f"{url}/v1/models", timeout=5).status_code == 200
        assert requests.post(f"{url}/api/show", json={"model": OLLAMA_MODEL}, timeout=5).status_code == 200
        metrics = _metrics(url)
        assert _sample(metrics, "skylb_queue_length_by_class", priority="normal", tenant="default") == 3
        embedding = pool.submit(order.run, "embed", lambda: client.embed(model=OLLAMA_MODEL, input=["the sky"]))
        _queue(cluster, 4)
        assert _sample(_metrics(url), "skylb_queue_length_by_class", priority="critical", tenant="default") == 1
        assert len(embedding.result(timeout=60).embeddings[0]) > 0
        assert blocker.result(timeout=60).status_code == 200
        assert all(g.result(timeout=60).status_code == 200 for g in generations)
    # One slot: completion order is placement order. The embedding went before every queued generation.
    assert [n for n in order.names if n != "blocker"] == ["embed", "gen0", "gen1", "gen2"]
    metrics = _metrics(url)
    assert _sample(metrics, "skylb_queue_wait_seconds_count", priority="critical") == 1
    assert _sample(metrics, "skylb_queue_wait_seconds_count", priority="normal") == 4


def test_x_priority_high_goes_before_normal_and_a_bad_value_is_refused(procs, tmp_path):
    """Two normal generations queue, then one with ``X-Priority: high`` (official openai client, Ollama's /v1):
    it is placed first. An X-Priority that is not high, normal or low gets 400 in the API's shape."""
    cluster, url, _ = _region(procs, tmp_path)
    order = _Order()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        blocker = _block(cluster, pool, order, url)
        normal = []
        for i in range(2):
            normal.append(pool.submit(order.run, f"normal{i}", lambda i=i: _generate(url, f"normal {i}", SHORT)))
            _queue(cluster, i + 1)
        high = pool.submit(order.run, "high", lambda: client.chat.completions.create(
            model=OLLAMA_MODEL, messages=[{"role": "user", "content": "urgent"}], max_tokens=SHORT,
            extra_headers={"X-Priority": "high"}))
        _queue(cluster, 3)
        assert high.result(timeout=60).choices[0].message.content
        assert blocker.result(timeout=60).status_code == 200
        assert all(f.result(timeout=60).status_code == 200 for f in normal)
    assert [n for n in order.names if n != "blocker"] == ["high", "normal0", "normal1"]
    bad = _generate(url, "x", 1, headers={"X-Priority": "critical"})
    assert bad.status_code == 400 and "high, normal, low" in bad.json()["error"]
    bad = requests.post(f"{url}/v1/completions", json={"model": OLLAMA_MODEL, "prompt": "x", "max_tokens": 1},
                        headers={"X-Priority": "urgent"}, timeout=10)
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["type"] == "invalid_request_error" and "urgent" in error["message"]
    assert 'reason="bad_priority"' in _metrics(url)


def test_two_tenants_with_weights_2_to_1_share_a_saturated_replica_2_to_1(procs, tmp_path):
    """Tenants a (weight 2) and b (weight 1), 9 queued generations each behind a running one, b's queued first:
    the first 9 placements go about 2:1 (deficit round robin gives exactly 6:3; 5 to 7 accepted), each tenant's
    in its arrival order."""
    keys = {"a": "key-a", "b": "key-b", "c": "key-c"}
    cfg = {"tenants": {t: [k] for t, k in keys.items()},
           "quotas": {"tenants": {"a": {"weight": 2}, "b": {"weight": 1}}}}
    cluster, url, _ = _region(procs, tmp_path, balancer=cfg, peer_token=PEER_TOKEN)
    auth = {t: {"Authorization": f"Bearer {k}"} for t, k in keys.items()}
    order = _Order()
    with ThreadPoolExecutor(20) as pool:
        blocker = _block(cluster, pool, order, url, auth["c"], tokens=150)  # about 4 s: time to queue 18
        futures = []
        # All of b's first, then a's, one at a time (so arrival order is known): first come, first served would
        # place 9 of b before any of a.
        for tenant, i in [(t, i) for t in "ba" for i in range(9)]:
            futures.append(pool.submit(order.run, f"{tenant}{i}",
                                       lambda t=tenant, i=i: _generate(url, f"{t} {i}", SHORT // 2, auth[t])))
            _queue(cluster, len(futures))
        assert cluster.status("us")["replicas"][0]["outstanding"] == 1, "the blocker ended before all queued"
        metrics = _metrics(url, {"Authorization": f"Bearer {PEER_TOKEN}"})
        assert _sample(metrics, "skylb_queue_length_by_class", priority="normal", tenant="a") == 9
        assert _sample(metrics, "skylb_queue_length_by_class", priority="normal", tenant="b") == 9
        assert blocker.result(timeout=60).status_code == 200
        assert all(f.result(timeout=90).status_code == 200 for f in futures)
    placed = [n for n in order.names if n != "blocker"]
    first = placed[:9]
    assert 5 <= sum(n[0] == "a" for n in first) <= 7, placed
    for tenant in "ab":  # first come, first served inside a tenant
        mine = [n for n in placed if n[0] == tenant]
        assert mine == [f"{tenant}{i}" for i in range(9)], placed


def test_a_cached_embedding_is_answered_without_a_replica(procs, tmp_path):
    """With the cache on, a repeated embedding is a hit: same vectors, X-SkyLB-Route: cache, no routing decision
    counted, the hit counted; it is still answered after the only replica is gone, while a new input is not."""
    cluster, url, _ = _region(procs, tmp_path, balancer={"embedding_cache": {"enabled": True}, "queue_timeout_s": 2})
    client = ollama.Client(host=url, timeout=30)
    first = client.embed(model=OLLAMA_MODEL, input="the sky is blue")
    before = _metrics(url)
    second = requests.post(f"{url}/api/embed", json={"input": "the sky is blue", "model": OLLAMA_MODEL}, timeout=10)
    assert second.status_code == 200 and second.headers["X-SkyLB-Route"] == "cache"
    assert second.json()["embeddings"] == first.embeddings
    after = _metrics(url)
    assert _sample(after, "skylb_requests_routed_total") == _sample(before, "skylb_requests_routed_total") == 1
    assert _sample(after, "skylb_embedding_cache_hits_total") == 1
    assert _sample(after, "skylb_embedding_cache_misses_total") == 1
    assert _sample(after, "skylb_embedding_cache_entries") == 1
    # Other parameters are other entries: a miss, answered by the replica.
    other = requests.post(f"{url}/api/embed", json={"input": "the sky is blue", "model": OLLAMA_MODEL,
                                                    "dimensions": 8}, timeout=10)
    assert other.status_code == 200 and other.headers["X-SkyLB-Route"] == "local"
    assert _sample(_metrics(url), "skylb_embedding_cache_misses_total") == 2
    # The replica goes away: the cached answer is still served (it never needed one), a new input is not.
    [emulator] = [p for p in procs.procs if p.name == "emu-ollama"]
    emulator.stop()
    cluster.wait_until(lambda: not any(r["healthy"] for r in cluster.status("us")["replicas"]),
                       what="the replica seen down")
    again = client.embed(model=OLLAMA_MODEL, input="the sky is blue")
    assert again.embeddings == first.embeddings
    fresh = requests.post(f"{url}/api/embed", json={"input": "never seen", "model": OLLAMA_MODEL}, timeout=10)
    assert fresh.status_code == 503
    assert _sample(_metrics(url), "skylb_embedding_cache_hits_total") == 2


def _request_lines(proc) -> list[dict]:
    """The balancer's per-request log lines (one JSON object per line)."""
    lines = []
    for line in proc.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "request":
            lines.append(entry)
    return lines


def test_a_forwarded_request_keeps_its_class_and_tenant_and_clients_cannot_set_them(procs, tmp_path):
    """us has no replica and forwards to eu: a request of tenant a with ``X-Priority: high`` is queued in eu as
    high and as tenant a (X-SkyLB-Priority, X-SkyLB-Tenant with the peer token), although the client's own key
    never reaches eu. A client sending those headers itself is not believed."""
    cfg = {"priorities": {"enabled": True}, "tenants": {"a": ["key-a"], "b": ["key-b"]}}
    cluster = Cluster(procs, tmp_path, balancer=cfg, peer_token=PEER_TOKEN)
    regions = ["us", "eu"]
    cluster.start_controller(regions)
    [replica] = cluster.start_emulator(1, *EMULATOR, name="emu-eu")
    eu = cluster.start_balancer("eu", regions)
    us = cluster.start_balancer("us", regions)
    cluster.ctl("replica", "add", "--region", "eu", "--url", replica, "--engine", "ollama", "--max-concurrency", "1")
    cluster.wait_replicas_healthy("eu", 1)
    # Available and serving the model: eu's status can say "1 available replica" before eu has read that replica's
    # model list, and us answers 404 for a model no one reports (CI-style run).
    cluster.wait_until(lambda: [p["available"] and bool(p["models"] and any(p["models"].values()))
                                for p in cluster.status("us")["peers"]] == [True],
                       what="eu available to us with its models")
    forwarded = _generate(us, "from us", 2, headers={"Authorization": "Bearer key-a", "X-Priority": "high"})
    assert forwarded.status_code == 200 and forwarded.headers["X-SkyLB-Route"] == "peer:eu"
    direct = _generate(eu, "direct", 2, headers={"Authorization": "Bearer key-b", "X-SkyLB-Priority": "critical",
                                                 "X-SkyLB-Tenant": "a"})
    assert direct.status_code == 200 and direct.headers["X-SkyLB-Route"] == "local"
    metrics = _metrics(eu, {"Authorization": f"Bearer {PEER_TOKEN}"})
    assert _sample(metrics, "skylb_queue_wait_seconds_count", priority="high") == 1
    assert _sample(metrics, "skylb_queue_wait_seconds_count", priority="normal") == 1
    assert _sample(metrics, "skylb_queue_wait_seconds_count", priority="critical") == 0
    [eu_proc] = [p for p in procs.procs if p.name == "balancer-eu"]
    seen = {(e["priority"], e["tenant"]) for e in _request_lines(eu_proc)}
    assert seen == {("high", "a"), ("normal", "b")}
