"""A successful /v1/embeddings through a balancer and across a hop to a peer balancer, with the official openai client:
real processes (controller, two balancers, an emulated vLLM replica)."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.cluster import MODEL, Cluster


def test_embeddings_through_a_balancer_forwarded_to_a_peer(procs, tmp_path):
    """us has no replica, eu has one: the openai client's embeddings.create on us (base64-encoded, the client's
    default) is forwarded once to eu and served by eu's replica, and the vectors it decodes equal the replica's own
    float answer; asked for floats, the same vectors come back through the hop."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us", "eu"])
    [replica] = cluster.start_emulator(1, "--time-scale", "0.1", name="emu-eu")
    cluster.start_balancer("eu", ["us", "eu"])
    us = cluster.start_balancer("us", ["us", "eu"])
    cluster.add_replica("eu", replica, replica_id="eu-0")
    cluster.wait_until(lambda: any(p["available"] and MODEL in (p["models"] or {}).get("openai", ())
                                   for p in cluster.status("us")["peers"]), timeout_s=20, what="us sees eu's model")
    inputs = ["the sky over the region", "a second, different text"]
    direct = requests.post(f"{replica}/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=10).json()
    expected = [item["embedding"] for item in direct["data"]]

    client = openai.OpenAI(base_url=f"{us}/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=inputs)
    assert (raw.headers["X-SkyLB-Route"], raw.headers["X-SkyLB-Served-By"]) == ("peer:eu", "eu/eu-0")
    answer = raw.parse()
    assert answer.model == MODEL and [d.index for d in answer.data] == [0, 1]
    for got, want in zip((d.embedding for d in answer.data), expected):
        assert got == pytest.approx(want, abs=1e-6)  # float32 on the wire
    assert answer.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    floats = client.embeddings.with_raw_response.create(model=MODEL, input=inputs[0], encoding_format="float")
    assert floats.headers["X-SkyLB-Route"] == "peer:eu"
    assert floats.parse().data[0].embedding == expected[0]
