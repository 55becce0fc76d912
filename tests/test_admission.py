"""Model groups and the admission API with real processes: a controller, emulated vLLM replicas each serving its
own model, a balancer; requests through real HTTP (the official openai client for generations)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import requests

from tests.cluster import Cluster, emulator_gauge, get_json, post_json

# Each request decodes 8 tokens at ~53 ms each (time scale 1): about 0.45 s, long enough to overlap.
GEN = {"max_tokens": 8, "extra_body": {"ignore_eos": True}}
RUNNING = "vllm:num_requests_running"


def _cluster(procs, tmp_path, quotas: dict, models: list[str], *, wait_s: float = 30.0, **kw) -> tuple:
    cluster = Cluster(procs, tmp_path, balancer={"quotas": quotas, "quota": {"wait_s": wait_s},
                                                  **kw.pop("balancer", {})}, **kw)
    cluster.start_controller(["us"])
    replicas = {m: cluster.start_emulator(1, "--model", m, name=f"emu-{m}")[0] for m in models}
    url = cluster.start_balancer("us", ["us"])
    for m, r in replicas.items():
        cluster.add_replica("us", r, replica_id=m)
    cluster.wait_replicas_healthy("us", len(models))
    cluster.wait_until(lambda: all(r["models"] for r in cluster.status("us")["replicas"]), what="models known")
    return cluster, url, replicas


def test_group_spreads_by_weight_respects_caps_and_names_the_model(procs, tmp_path):
    quotas = {"groups": {"fast": {"m-a": 3, "m-b": 1}},
              "models": {"m-a": {"max_concurrent": 2}, "m-b": {"max_concurrent": 1}}}
    cluster, url, replicas = _cluster(procs, tmp_path, quotas, ["m-a", "m-b"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    listed = {m.id for m in client.models.list().data}
    assert {"fast", "m-a", "m-b"} <= listed
    tags = {m["name"]: m for m in requests.get(f"{url}/api/tags", timeout=10).json()["models"]}  # Ollama's list too
    assert {"fast", "m-a", "m-b"} <= set(tags) and tags["fast"]["skylb_group"] == ["m-a", "m-b"]

    def ask(i: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="fast", messages=[{"role": "user", "content": "same prompt"}], **GEN)
        chosen = raw.headers["X-SkyLB-Model"]
        assert raw.parse().model == chosen  # the replica's own answer names the model it served
        return chosen

    # One at a time, nothing is capped: WDRR gives m-a three requests for each of m-b's.
    sequential = [ask(i) for i in range(8)]
    assert Counter(sequential) == {"m-a": 6, "m-b": 2}

    # Twelve at once: the caps (2 on m-a, 1 on m-b) hold at the replicas; the rest wait in the balancer.
    peaks = {m: 0.0 for m in replicas}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for m, r in replicas.items():
                peaks[m] = max(peaks[m], emulator_gauge(r, RUNNING))
            time.sleep(0.02)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            chosen = list(pool.map(ask, range(12), timeout=60))
    finally:
        stop.set()
        watcher.join(5)
    assert len(chosen) == 12 and set(chosen) <= {"m-a", "m-b"}
    assert peaks["m-a"] == 2 and peaks["m-b"] == 1, peaks
    # Every slot came back: the next admission is immediate (schedule admits without a wait).
    status, body, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "fast", "estimated_tokens": 10})
    assert status == 200 and body["model"] in {"m-a", "m-b"}
    assert get_json(f"{url}/skylb/v1/advice")["in_flight"] == 1
    post_json(f"{url}/skylb/v1/complete", {"lease_id": body["lease_id"]})

    # A client that goes away mid-stream gives its slot back too.
    stream = client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "long"}],
                                            stream=True, max_tokens=200, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert get_json(f"{url}/skylb/v1/advice")["in_flight"] == 1
    stream.close()
    cluster.wait_until(lambda: get_json(f"{url}/skylb/v1/advice")["in_flight"] == 0, timeout_s=5,
                       what="the slot of a cancelled stream released")
    metrics = requests.get(f"{url}/metrics", timeout=5).text
    counts = {m: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("skylb_group_admissions_total{") and f'model="{m}"' in line
                     and 'via="request"' in line) for m in ("m-a", "m-b")}
    assert counts["m-a"] + counts["m-b"] == 8 + 12 + 1 and counts["m-a"] >= 6
    assert 'skylb_admission_leases{region="us"} 0.0' in metrics


def test_expired_lease_is_reclaimed_with_its_slot_and_tokens(procs, tmp_path):
    quotas = {"models": {"m-a": {"max_concurrent": 1, "tokens_per_minute": 6000}}}
    cluster, url, _ = _cluster(procs, tmp_path, quotas, ["m-a"])
    ask = {"model": "m-a", "estimated_tokens": 5000, "lease_ttl_ms": 1000}
    status, first, _ = post_json(f"{url}/skylb/v1/schedule", ask)
    assert status == 200 and first["model"] == "m-a" and first["lease_ttl_ms"] == 1000
    status, second, _ = post_json(f"{url}/skylb/v1/schedule", ask)
    assert status == 200 and "wait_for_ms" in second and "lease_id" not in second
    # No heartbeat: the lease expires after 1 s and is reclaimed. Its slot is free and its 5000 tokens are back
    # (without the refund the bucket would hold about 1000 + 100 tokens/s: not 5000 for 40 s).
    time.sleep(1.6)
    status, third, _ = post_json(f"{url}/skylb/v1/schedule", ask)
    assert status == 200 and third.get("model") == "m-a", third
    status, body, _ = post_json(f"{url}/skylb/v1/heartbeat", {"lease_id": first["lease_id"]})
    assert status == 404 and body["error"]["param"] == "lease_id"


def test_schedule_heartbeat_complete_advice_and_leased_generation(procs, tmp_path):
    quotas = {"groups": {"solo": {"m-b": 1}}, "models": {"m-b": {"max_concurrent": 1, "tokens_per_minute": 60000}},
              "tenants": {"batch": {"limits": {"*": {"max_concurrent": 3}}}}}
    cluster, url, _ = _cluster(procs, tmp_path, quotas, ["m-b"], wait_s=1.0, peer_token="admission-peer-token-6e2b9d04c7a1f358",
                               balancer={"tenants": {"batch": ["key-batch-0123456789"]}})
    auth = {"Authorization": "Bearer key-batch-0123456789"}
    # Client endpoints: a client key is needed; the peer status stays peer-only.
    status, body, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "solo", "estimated_tokens": 100})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert requests.get(f"{url}/skylb/v1/status?format=json", headers=auth, timeout=5).status_code == 403
    assert requests.get(f"{url}/skylb/v1/advice", timeout=5).status_code == 401

    status, lease, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "solo", "estimated_tokens": 100,
                                                             "lease_ttl_ms": 2000}, headers=auth)
    assert status == 200 and lease["model"] == "m-b"
    status, waiting, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "solo", "estimated_tokens": 100},
                                   headers=auth)
    assert status == 200 and waiting["wait_for_ms"] >= 50 and waiting["wait_for_ms"] % 50 == 0

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-batch-0123456789", max_retries=0, timeout=30)
    # Without the lease, the group's only slot is held: the request waits wait_s (1 s), then 429 + Retry-After.
    try:
        client.chat.completions.create(model="solo", messages=[{"role": "user", "content": "x"}], **GEN)
        raise AssertionError("expected 429")
    except openai.RateLimitError as exc:
        assert exc.status_code == 429 and int(exc.response.headers["Retry-After"]) >= 1
        assert set(exc.body) >= {"message", "type", "param", "code"}
    # Heartbeats keep the lease past its 2 s ttl.
    for pause in (0.0, 0.8, 0.8, 0.8):
        time.sleep(pause)
        status, beat, _ = post_json(f"{url}/skylb/v1/heartbeat", {"lease_id": lease["lease_id"]}, headers=auth)
        assert status == 200 and beat["ok"]
    # With the lease, the generation is already admitted: served at once by the leased model.
    raw = client.chat.completions.with_raw_response.create(
        model="solo", messages=[{"role": "user", "content": "x"}], extra_headers={"X-SkyLB-Lease": lease["lease_id"]},
        **GEN)
    assert raw.status_code == 200 and raw.headers["X-SkyLB-Model"] == "m-b"
    # Another tenant (no key of its own here: a wrong key) cannot use or complete the lease.
    status, _, _ = post_json(f"{url}/skylb/v1/complete", {"lease_id": lease["lease_id"]},
                             headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, done, _ = post_json(f"{url}/skylb/v1/complete", {"lease_id": lease["lease_id"], "used_tokens": 40},
                                headers=auth)
    assert status == 200 and done == {"ok": True, "model": "m-b", "refunded_tokens": 60}
    status, _, _ = post_json(f"{url}/skylb/v1/complete", {"lease_id": lease["lease_id"]}, headers=auth)
    assert status == 404  # completed once, never twice
    status, again, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "solo", "estimated_tokens": 100},
                                 headers=auth)
    assert status == 200 and again["model"] == "m-b"
    advice = get_json(f"{url}/skylb/v1/advice", headers=auth)
    # Two schedule calls admitted, one told to wait: seed 001 iteration 2 A's formula on those.
    normalized = min(1.0, max(0.0, (waiting["wait_for_ms"] - 25) / 975))
    assert advice["admit_rate"] == 0.6667 and advice["p95_wait_ms"] == waiting["wait_for_ms"]
    assert abs(advice["backpressure_score"] - (0.5 * normalized + 0.5 * (1 - 2 / 3))) < 1e-3
    assert advice["capacity"] == 1 and advice["in_flight"] == 1 and advice["suggested_parallelism"] == 4
    post_json(f"{url}/skylb/v1/complete", {"lease_id": again["lease_id"]}, headers=auth)


def test_admission_api_bad_input(procs, tmp_path):
    cluster, url, _ = _cluster(procs, tmp_path, {"groups": {"g": {"m-a": 1}}}, ["m-a"])
    cases = [
        ("schedule", b"not json", None),
        ("schedule", b"[1]", None),
        ("schedule", b"[" * 100_000 + b"]" * 100_000, None),  # deeper than Python's decoder recurses
        ("schedule", b'{"estimated_tokens": 10}', "model"),
        ("schedule", b'{"model": "g"}', "estimated_tokens"),
        ("schedule", b'{"model": "g", "estimated_tokens": "10"}', "estimated_tokens"),
        ("schedule", b'{"model": "g", "estimated_tokens": true}', "estimated_tokens"),
        ("schedule", b'{"model": "g", "estimated_tokens": 0}', "estimated_tokens"),
        ("schedule", b'{"model": "g", "estimated_tokens": 10, "lease_ttl_ms": 5}', "lease_ttl_ms"),
        ("heartbeat", b"{}", "lease_id"),
        ("complete", b'{"lease_id": 3}', "lease_id"),
        ("complete", b'{"lease_id": "x", "used_tokens": -1}', "used_tokens"),
    ]
    for endpoint, body, param in cases:
        resp = requests.post(f"{url}/skylb/v1/{endpoint}", data=body, timeout=5,
                             headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, (endpoint, body, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    status, body, _ = post_json(f"{url}/skylb/v1/schedule", {"model": "nope", "estimated_tokens": 1})
    assert status == 404 and body["error"]["param"] == "model"
    status, body, _ = post_json(f"{url}/skylb/v1/heartbeat", {"lease_id": "lse_unknown"})
    assert status == 404
    assert requests.get(f"{url}/skylb/v1/schedule", timeout=5).status_code == 405
