"""Learned admission capacity with real processes: a balancer in front of a replica with a batch of 2 and one with
a batch of 32 (two emulated vLLM processes), under a burst of long requests."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.cluster import MODEL, Cluster, emulator_gauge

N = 100  # requests in the burst, all at once


def test_a_burst_fills_the_large_batch_and_leaves_the_small_one_at_most_two_pending(procs, tmp_path):
    cluster = Cluster(procs, tmp_path, balancer={"max_dispatch_per_probe": 0, "probe_interval_ms": 50})
    cluster.start_controller(["us"])
    [small] = cluster.start_emulator(1, "--time-scale", "0.3", "--max-num-seqs", "2", name="emulator-small")
    [large] = cluster.start_emulator(1, "--time-scale", "0.3", "--max-num-seqs", "32", name="emulator-large")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", small, replica_id="small")
    cluster.add_replica("us", large, replica_id="large")
    cluster.wait_replicas_healthy("us", 2)

    peak = {"small_waiting": 0.0, "large_running": 0.0, "large_waiting": 0.0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["small_waiting"] = max(peak["small_waiting"], emulator_gauge(small, "vllm:num_requests_waiting"))
            peak["large_running"] = max(peak["large_running"], emulator_gauge(large, "vllm:num_requests_running"))
            peak["large_waiting"] = max(peak["large_waiting"], emulator_gauge(large, "vllm:num_requests_waiting"))
            time.sleep(0.01)

    def call(i):
        # Streamed, as chat clients send: the balancer sees each prompt's first token (its prefill done) at once.
        body = {"model": MODEL, "prompt": f"burst {i} " * 30, "max_tokens": 150, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as resp:
            done = any(line == b"data: [DONE]" for line in resp.iter_lines())
            return resp.status_code if done else -1

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(N) as pool:
            statuses = list(pool.map(call, range(N)))
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert statuses == [200] * N
    assert peak["small_waiting"] <= 2, peak
    assert peak["large_running"] == 32, peak
    limits = {r["id"]: r["admission_capacity"] for r in cluster.status("us")["replicas"]}
    assert limits["small"] <= 3 and limits["large"] >= 32, limits  # 3: one retest of the small batch since
