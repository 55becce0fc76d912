"""Every engine behind a live balancer, forwarding between regions that run different engines, embeddings and a
hash-ring session through a balancer: real processes, the official clients."""

from __future__ import annotations

import time

import ollama
import openai
import requests

from tests.cluster import MODEL, Cluster

FAST = ("--time-scale", "0.1")
OLLAMA_MODEL = "llama3.1:8b"
#: engine adapter -> (emulator personality, the model its replica serves).
ENGINES = {"sglang": ("sglang", "sg-model"), "tgi": ("tgi", "tgi-model"), "llamacpp": ("llamacpp", "lc-model"),
           "openai": ("vllm", MODEL)}


def _models_known(cluster: Cluster, region: str, n: int) -> bool:
    replicas = cluster.status(region)["replicas"]
    return len(replicas) == n and all(r["healthy"] and r["models"] for r in replicas)


def test_every_engine_serves_the_openai_client_through_one_balancer_and_embeddings_pass(procs, tmp_path):
    """SGLang, TGI, llama.cpp and a generic OpenAI-compatible server (probed by the ``openai`` adapter, no load
    metrics) in one region: a chat completion for each one's model is answered by that replica through the
    balancer, and a successful /v1/embeddings call goes through it too."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    url = cluster.start_balancer("us", ["us"])
    for adapter, (personality, model) in ENGINES.items():
        [replica] = cluster.start_emulator(1, "--engine", personality, "--model", model, *FAST, name=f"emu-{adapter}")
        cluster.add_replica("us", replica, replica_id=f"{adapter}-0", engine=adapter)
    cluster.wait_until(lambda: _models_known(cluster, "us", len(ENGINES)), timeout_s=20, what="every model known")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    for adapter, (_, model) in ENGINES.items():
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": f"hello {adapter}"}], max_tokens=3)
        assert raw.headers["X-SkyLB-Served-By"] == f"us/{adapter}-0", adapter
        assert raw.parse().choices[0].message.content
    embedded = client.embeddings.with_raw_response.create(model=MODEL, input=["one", "two"])
    assert embedded.headers["X-SkyLB-Served-By"] == "us/openai-0"
    vectors = [item.embedding for item in embedded.parse().data]
    assert len(vectors) == 2 and len(vectors[0]) > 0 and vectors[0] != vectors[1]


def test_forwarding_between_regions_running_different_engines_both_ways(procs, tmp_path):
    """us runs vLLM, eu runs Ollama: us forwards a request for eu's model (OpenAI API and Ollama API) to eu, and eu
    forwards a request for us's model to us; each is answered by the other region's engine."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us", "eu"])
    [vllm_replica] = cluster.start_emulator(1, *FAST, name="emu-vllm")
    [ollama_replica] = cluster.start_emulator(1, "--engine", "ollama", "--model", OLLAMA_MODEL, *FAST,
                                              name="emu-ollama")
    eu = cluster.start_balancer("eu", ["us", "eu"])
    us = cluster.start_balancer("us", ["us", "eu"])
    cluster.add_replica("us", vllm_replica, replica_id="vllm-0")
    cluster.add_replica("eu", ollama_replica, replica_id="ollama-0", engine="ollama")
    for region, other in (("us", "eu"), ("eu", "us")):
        cluster.wait_until(lambda: _models_known(cluster, region, 1) and any(
            p["available"] and p["models"] and any(p["models"].values()) for p in cluster.status(region)["peers"]),
            timeout_s=20, what=f"{region} sees {other}'s models")
    to_eu = openai.OpenAI(base_url=f"{us}/v1", api_key="unused", max_retries=0, timeout=30)
    raw = to_eu.chat.completions.with_raw_response.create(
        model=OLLAMA_MODEL, messages=[{"role": "user", "content": "to ollama"}], max_tokens=3)
    assert (raw.headers["X-SkyLB-Route"], raw.headers["X-SkyLB-Served-By"]) == ("peer:eu", "eu/ollama-0")
    assert raw.parse().choices[0].message.content
    chat = ollama.Client(host=us, timeout=30).chat(model=OLLAMA_MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  options={"num_predict": 3})
    assert chat.done and chat.message.content
    to_us = openai.OpenAI(base_url=f"{eu}/v1", api_key="unused", max_retries=0, timeout=30)
    raw = to_us.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "to vllm"}], max_tokens=3)
    assert (raw.headers["X-SkyLB-Route"], raw.headers["X-SkyLB-Served-By"]) == ("peer:us", "us/vllm-0")
    assert raw.parse().choices[0].message.content


def test_a_hash_ring_session_stays_on_its_replica_through_a_live_balancer(procs, tmp_path):
    """skylb-ch with three replicas: every request of a session (X-Session-ID) is served by the same replica,
    whatever the other session's requests in between, while that replica has room. Requests are a few probe
    intervals apart: back to back, the two sessions may share a ring replica and use up its dispatches per probe
    (``max_dispatch_per_probe``) before a late probe on a loaded machine, and SkyLB-CH then rightly takes the next
    replica on the ring (it failed so once in a full suite)."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    replicas = cluster.start_emulator(3, *FAST, name="emu-us")
    url = cluster.start_balancer("us", ["us"], policy="skylb-ch")
    for i, replica in enumerate(replicas):
        cluster.add_replica("us", replica, replica_id=f"r{i}")
    cluster.wait_until(lambda: _models_known(cluster, "us", 3), what="three replicas")
    served: dict[str, set[str]] = {"alice": set(), "bob": set()}
    for turn in range(6):
        for session in served:
            r = requests.post(f"{url}/v1/chat/completions", timeout=30, headers={"X-Session-ID": session},
                              json={"model": MODEL, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": f"{session} turn {turn} {'x' * turn}"}]})
            assert r.status_code == 200
            served[session].add(r.headers["X-SkyLB-Served-By"])
            time.sleep(0.15)  # three probe intervals (50 ms): the replica's room is seen again
    assert all(len(targets) == 1 for targets in served.values()), served
