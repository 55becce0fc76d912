"""A replica that answers 501 Not Implemented to a kind of request (llama-server without ``--embeddings``): the
request is retried on another replica before any byte reaches the client, that replica gets no request of that kind
for a while, and with no replica left that serves it the client gets 501 saying so. Core rules (Router) and real
processes (a static balancer in front of two emulated llama-servers, one started without embeddings)."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from skylb.core import AvailabilityRules, Request, Router, make_policy
from tests.cluster import MODEL, Cluster


def _router() -> Router:
    router = Router(region="us", policy=make_policy("least-load"), rules=AvailabilityRules())
    router.set_replicas([("r1", "sim://r1", "llamacpp"), ("r2", "sim://r2", "llamacpp")])
    for rid in ("r1", "r2"):
        router.observe_replica(rid, now=0.0, healthy=True, pending=0)
        router.set_replica_models(rid, [MODEL])
    return router


def test_a_replica_that_answered_501_gets_no_request_of_that_kind_until_the_hold_ends():
    router = _router()
    router.enqueue(Request("e1", "text", arrived_at=0.0, model=MODEL, embedding=True))
    [first] = router.dispatch(0.01)
    router.finished(first)
    router.unsupported(first, now=0.02, hold_s=300.0)
    other = "r2" if first.target == "r1" else "r1"
    for i in range(4):  # embeddings only go to the other replica; generation still goes to both
        for rid in ("r1", "r2"):
            router.observe_replica(rid, now=0.1 + i, healthy=True, pending=0)
        router.enqueue(Request(f"e{i + 2}", "text", arrived_at=0.1, model=MODEL, embedding=True))
        router.enqueue(Request(f"g{i}", "text", arrived_at=0.1, model=MODEL))
        decisions = router.dispatch(0.1 + i)
        assert {d.target for d in decisions if d.request.embedding} == {other}
        for d in decisions:
            router.finished(d)
    assert router.served_elsewhere(Request("x", "t", 3.1, model=MODEL, embedding=True), 3.1)
    lone = Request("y", "t", 3.1, model=MODEL, embedding=True, avoid=frozenset({("local", other)}))
    assert not router.served_elsewhere(lone, 3.1)  # the other one failed it too: nobody left
    for rid in ("r1", "r2"):
        router.observe_replica(rid, now=400.0, healthy=True, pending=0)
    assert router.served_elsewhere(lone, 400.0)  # the hold ended: the replica may have been restarted


def test_embeddings_on_a_mixed_fleet_all_succeed_and_501_when_no_replica_embeds(procs, tmp_path):
    """Six openai and six Ollama embedding calls through a static balancer in front of a llama-server with
    embeddings and one without: all twelve succeed, the one without gets at most one of them (its 501, retried
    before any byte reached the client) and the balancer logs it once. A balancer whose only replica lacks
    embeddings answers 501 naming the model and the engine's own words; chat still works there."""
    cluster = Cluster(procs, tmp_path)
    [embeds] = cluster.start_emulator(1, "--engine", "llamacpp", name="embeds")
    [no_embeds] = cluster.start_emulator(1, "--engine", "llamacpp", "--no-embeddings", name="no-embeds")
    balancer = cluster.start_static_balancer([no_embeds, embeds], engine="llamacpp", region="mixed")
    url = cluster.balancers["mixed"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    served_by = [client.embeddings.with_raw_response.create(model=MODEL, input=f"text {i}")
                 .headers["X-SkyLB-Served-By"] for i in range(6)]
    for i in range(6):
        answer = requests.post(f"{url}/api/embed", json={"model": MODEL, "input": f"ollama {i}"}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["embeddings"]) == 1
    assert len(set(served_by)) == 1  # all from the replica that embeds
    lines = [json.loads(line) for line in balancer.log().splitlines() if line.startswith("{")]
    unsupported = [line for line in lines if line.get("event") == "unsupported"]
    assert [line["kind"] for line in unsupported] == ["embeddings"]  # the first went there, then none

    alone = cluster.start_static_balancer([no_embeds], engine="llamacpp", region="alone")
    alone_url = cluster.balancers["alone"]
    with pytest.raises(openai.APIStatusError) as err:
        openai.OpenAI(base_url=f"{alone_url}/v1", api_key="unused", max_retries=0,
                      timeout=30).embeddings.create(model=MODEL, input="text")
    assert err.value.status_code == 501
    message = err.value.body["message"]
    assert MODEL in message and "--embeddings" in message
    chat = requests.post(f"{alone_url}/v1/chat/completions", timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
