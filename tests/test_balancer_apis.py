"""Both APIs through a balancer, model-aware routing and streaming fidelity, with real processes."""

from __future__ import annotations

import json

import ollama
import openai
import pytest
import requests

from tests.cluster import MODEL, Cluster, post_json

FAST = ("--time-scale", "0.1")
OLLAMA_MODEL = "llama3.1:8b"


def _cluster(procs, tmp_path, regions):
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(regions)
    return cluster


def test_official_ollama_client_through_the_balancer(procs, tmp_path):
    """The ollama client gets generate, chat (streamed and not), embed, list, ps and show through a balancer."""
    cluster = _cluster(procs, tmp_path, ["us"])
    replicas = cluster.start_emulator(2, "--engine", "ollama", "--model", OLLAMA_MODEL, "--parallel", "2", *FAST,
                                      name="emu-ollama")
    url = cluster.start_balancer("us", ["us"])
    for r in replicas:
        cluster.add_replica("us", r, engine="ollama")
    cluster.wait_replicas_healthy("us", 2)
    cluster.wait_until(lambda: OLLAMA_MODEL in (cluster.first_replica("us").get("models") or ()), what="models")
    client = ollama.Client(host=url, timeout=30)
    gen = client.generate(model=OLLAMA_MODEL, prompt="why is the sky blue", options={"num_predict": 5})
    assert gen.done and gen.response and gen.eval_count >= 1
    chat = client.chat(model=OLLAMA_MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4})
    assert chat.message.content and chat.done
    parts = list(client.chat(model=OLLAMA_MODEL, messages=[{"role": "user", "content": "stream"}], stream=True,
                             options={"num_predict": 6}))
    assert len(parts) >= 2 and parts[-1].done and not parts[0].done
    assert "".join(p.message.content for p in parts)
    emb = client.embed(model=OLLAMA_MODEL, input=["one", "two"])
    assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) > 0
    assert OLLAMA_MODEL in [m.model for m in client.list().models]
    assert isinstance(client.ps().models, list)
    assert client.show(OLLAMA_MODEL) is not None
    assert requests.get(url, timeout=5).text == "Ollama is running"
    assert requests.head(url, timeout=5).status_code == 200
    assert "version" in requests.get(f"{url}/api/version", timeout=5).json()
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="nonexistent:1b", prompt="x")
    assert err.value.status_code == 404 and "nonexistent:1b" in err.value.error


def test_ollama_api_stream_defaults_to_true_and_ends_with_done(procs, tmp_path):
    """/api/generate without "stream" streams NDJSON, and the final done object reaches the client unchanged."""
    cluster = _cluster(procs, tmp_path, ["us"])
    [replica] = cluster.start_emulator(1, "--engine", "ollama", "--model", OLLAMA_MODEL, *FAST,
                                       name="emu-ollama")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", replica, engine="ollama")
    cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="models")
    with requests.post(f"{url}/api/generate", json={"model": OLLAMA_MODEL, "prompt": "hello",
                                                     "options": {"num_predict": 4}}, stream=True, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) >= 2 and lines[-1]["done"] is True
    for field in ("done_reason", "total_duration", "load_duration", "prompt_eval_count", "eval_count",
                  "eval_duration", "context"):
        assert field in lines[-1]
    status, body, _ = post_json(f"{url}/api/generate", {"prompt": "no model"})
    assert status == 400 and isinstance(body["error"], str)


def test_model_served_only_in_another_region_is_forwarded_and_unknown_is_404(procs, tmp_path):
    """A model only eu serves is forwarded from us to eu, and us's `/v1/models` lists it with what eu's engine says
    (vLLM's ``owned_by``, ``root``, ``created``, ``max_model_len``, carried in eu's peer status), not as SkyLB's own
    (``owned_by: skylb``, ``created: 0``); an unknown model gets 404 in OpenAI's shape."""
    cluster = _cluster(procs, tmp_path, ["us", "eu"])
    [us_r] = cluster.start_emulator(1, *FAST, name="emu-us")
    [eu_r] = cluster.start_emulator(1, *FAST, "--model", "Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192",
                                    name="emu-eu")
    cluster.start_balancer("eu", ["us", "eu"])
    url = cluster.start_balancer("us", ["us", "eu"])
    cluster.add_replica("us", us_r)
    cluster.add_replica("eu", eu_r)
    cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="us models")
    cluster.wait_until(lambda: any(p["models"] for p in cluster.status("us")["peers"]), what="eu models")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="Qwen/Qwen2.5-7B-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert raw.headers["X-SkyLB-Route"] == "peer:eu" and raw.headers["X-SkyLB-Served-By"].startswith("eu/")
    assert raw.parse().choices[0].message.content
    local = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert local.headers["X-SkyLB-Route"] == "local"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert "gpt-nope" in err.value.body["message"]
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL, "Qwen/Qwen2.5-7B-Instruct"}
    [engine_card] = requests.get(f"{eu_r}/v1/models", timeout=5).json()["data"]
    card = listed["Qwen/Qwen2.5-7B-Instruct"].model_dump()
    assert {k: card.get(k) for k in ("owned_by", "root", "created", "max_model_len")} == {
        "owned_by": "vllm", "root": engine_card["root"], "created": engine_card["created"], "max_model_len": 8192}
    assert "permission" not in card  # only a card's scalar fields travel in the peer status


def _sse_lines(url: str, path: str, body: dict) -> tuple[int, list[bytes]]:
    with requests.post(url + path, json=body, stream=True, timeout=30) as resp:
        return resp.status_code, [line for line in resp.iter_lines() if line]


@pytest.mark.parametrize("engine, flags", [
    ("vllm", ("--sse-keepalive-ms", "5", "--fail-after-tokens", "3")),
    ("llamacpp", ("--fail-after-tokens", "3")),
])
def test_stream_extras_and_mid_stream_errors_reach_the_client_unchanged(procs, tmp_path, engine, flags):
    """Keep-alive comments, include_usage, and mid-stream error chunks (vLLM data:, llama.cpp error:) pass through."""
    cluster = _cluster(procs, tmp_path, ["us"])
    [replica] = cluster.start_emulator(1, "--engine", engine, "--time-scale", "0.5", *flags, name="emu")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", replica, engine=engine)
    cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="models")
    body = {"model": MODEL, "prompt": "same prompt", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    direct_status, direct = _sse_lines(replica, "/v1/completions", body)
    via_status, via = _sse_lines(url, "/v1/completions", body)
    assert direct_status == via_status == 200

    def shape(lines):  # what each line is, without ids and timestamps
        kinds = []
        for line in lines:
            if line.startswith(b":"):
                kinds.append("comment")
            elif line.startswith(b"error:"):
                kinds.append("error-line")
            elif line == b"data: [DONE]":
                kinds.append("done")
            else:
                chunk = json.loads(line.split(b":", 1)[1])
                kinds.append("error" if "error" in chunk else "usage" if not chunk.get("choices") else "chunk")
        return [k for k in kinds if k != "comment"], "comment" in kinds

    assert shape(via)[0] == shape(direct)[0]
    assert "error" in shape(via)[0] or "error-line" in shape(via)[0]
    if engine == "vllm":
        assert shape(via)[1]  # keep-alive comments were relayed


def test_health_and_models_answer_as_the_engines_do(procs, tmp_path):
    """`GET /health` is 200 as on vLLM (guidellm checks it); `/v1/models` keeps the engines' fields
    (vLLM's ``root``, ``parent``, ``created``, ``owned_by``) with the smallest ``max_model_len`` of two replicas."""
    cluster = Cluster(procs, tmp_path)
    [long] = cluster.start_emulator(1, "--max-model-len", "8192", *FAST, name="emu-long")
    [short] = cluster.start_emulator(1, "--max-model-len", "4096", *FAST, name="emu-short")
    cluster.start_static_balancer([long, short], engine="vllm")
    url = cluster.balancers["local"]
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert requests.head(f"{url}/health", timeout=5).status_code == 200
    [card] = requests.get(f"{url}/v1/models", timeout=5).json()["data"]
    [engine_card] = requests.get(f"{long}/v1/models", timeout=5).json()["data"]
    assert card["max_model_len"] == 4096 and engine_card["max_model_len"] == 8192
    assert {k: card[k] for k in ("id", "object", "root", "parent", "owned_by")} == {
        "id": MODEL, "object": "model", "root": engine_card["root"], "parent": None, "owned_by": "vllm"}
    assert 0 < card["created"] <= engine_card["created"]
    listed = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10).models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in listed] == [(MODEL, 4096)]

