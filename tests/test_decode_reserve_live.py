"""SGLang's running reserve with real processes: an emulated SGLang replica (its scheduler model, which exports
``sglang:new_token_ratio``) behind a balancer; the balancer's status shows what the replica keeps for the outputs
of the requests it runs while they run, and nothing once they are done."""

from concurrent.futures import ThreadPoolExecutor

import requests

from tests.cluster import MODEL, Cluster

N = 4  # requests at once, each asking for 400 output tokens


def test_the_balancer_tracks_what_sglang_keeps_reserved_for_its_running_requests(procs, tmp_path):
    cluster = Cluster(procs, tmp_path, balancer={"probe_interval_ms": 50})
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, "--engine", "sglang", "--admission", "sglang", "--time-scale", "0.05",
                                       name="emulator-sglang")
    cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", replica, replica_id="s", engine="sglang")
    cluster.wait_replicas_healthy("us", 1)
    url = cluster.balancers["us"]

    def call(i):
        body = {"model": MODEL, "prompt": f"reserve {i} " * 20, "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as resp:
            return resp.status_code if any(line == b"data: [DONE]" for line in resp.iter_lines()) else -1

    with ThreadPoolExecutor(N) as pool:
        calls = [pool.submit(call, i) for i in range(N)]
        # While they run: at most the ratio (0.7 at the start, falling slowly as the engine decodes) x 4 x 400
        # tokens, and, seen within a few probes of their start, well above what the floor a balancer assumes
        # without the gauge (0.098) would give: the engine's ratio was read.
        reserved = cluster.wait_until(lambda: cluster.first_replica("us").get("kv_reserved_tokens"), timeout_s=10,
                                      what="a reserve while the requests run")
        assert 0.098 * N * 400 < reserved <= 0.7 * N * 400 + 1
        assert [c.result(timeout=60) for c in calls] == [200] * N
    assert cluster.first_replica("us")["kv_reserved_tokens"] == 0
