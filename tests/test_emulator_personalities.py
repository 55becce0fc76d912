"""Each emulator personality speaks its engine's dialect: endpoints, error shapes, streaming, the ollama client."""

from __future__ import annotations

import base64
import json
import math
import struct

import aiohttp
import pytest

from bench.emulator.personalities.base import EMBEDDING_DIM
from bench.emulator.personalities.ollama import QUEUE_FULL
from bench.launch.procs import ProcGroup, free_ports, wait_http

# One xdist worker runs the whole module (--dist loadgroup): it shares its emulator processes (module fixture emu),
# started once, not once per worker.
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("emulator_personalities")]

TIME_SCALE = "0.02"  # a decode step is about 1.1 ms
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OLLAMA_MODELS = ["llama3.2", "qwen2.5:0.5b"]  # the first is served as llama3.2:latest
TIMEOUT = aiohttp.ClientTimeout(total=15)

#: name -> (engine, extra flags): one emulator process each.
EMULATORS = {
    # 5 ms decode steps, keep-alives every 1 ms: several comment lines between chunks.
    "vllm": ("vllm", ["--time-scale", "0.1", "--sse-keepalive-ms", "1", "--fail-after-tokens", "3",
                      "--model", "m1", "--model", "m2"]),
    "sglang": ("sglang", ["--max-num-seqs", "2"]),
    "llamacpp": ("llamacpp", ["--parallel", "3"]),
    "llamacpp-loading": ("llamacpp", ["--load-seconds", "120"]),
    "llamacpp-failing": ("llamacpp", ["--fail-after-tokens", "2"]),
    "tgi": ("tgi", ["--max-num-seqs", "1", "--max-concurrent-requests", "2"]),
    "ollama": ("ollama", ["--parallel", "1", "--max-queue", "1",
                          *[arg for m in OLLAMA_MODELS for arg in ("--model", m)]]),
    "ollama-failing": ("ollama", ["--fail-after-tokens", "2"]),
}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """Every emulator of EMULATORS, started together; name -> base URL."""
    ports = dict(zip(EMULATORS, free_ports(len(EMULATORS))))
    group = ProcGroup(tmp_path_factory.mktemp("personalities"))
    try:
        procs = {name: group.skylb("emulator", "--engine", engine, "--port", str(ports[name]), "--time-scale",
                                   TIME_SCALE, "--no-request-log", *extra, name=name)
                 for name, (engine, extra) in EMULATORS.items()}
        for name, port in ports.items():
            wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=20, proc=procs[name].popen)
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        group.stop_all()


@pytest.fixture
async def http():
    """One aiohttp session per test."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield session


async def get(http, url: str) -> tuple[int, str, str]:
    """GET: (status, content type, body text)."""
    async with http.get(url) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def post(http, url: str, body) -> tuple[int, object]:
    """POST JSON (a str is sent raw): (status, parsed JSON body)."""
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    async with http.post(url, **kwargs) as resp:
        return resp.status, json.loads(await resp.text())


async def raw_lines(http, url: str, body: dict) -> tuple[int, str, list[str]]:
    """POST and read the whole streamed body: (status, content type, non-empty lines)."""
    async with http.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, resp.headers["Content-Type"], [ln for ln in text.splitlines() if ln]


def ndjson(lines: list[str]) -> list[dict]:
    return [json.loads(ln) for ln in lines]


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


# ---- vLLM ---------------------------------------------------------------------------------------------------------

async def test_vllm_keepalives_then_midstream_error_under_200(emu, http):
    """--sse-keepalive-ms sends ': keep-alive' comments between chunks; --fail-after-tokens 3 ends the stream with
    vLLM's data: {"error": ...} chunk under HTTP 200, then data: [DONE]."""
    body = {"model": "m1", "prompt": "one two three", "max_tokens": 10, "ignore_eos": True, "stream": True}
    status, ctype, lines = await raw_lines(http, f"{emu['vllm']}/v1/completions", body)
    assert status == 200 and ctype.startswith("text/event-stream")
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["text"].strip() != "" for c in chunks[:-1]] == [True] * 3
    error = chunks[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500
    keepalives = [i for i, ln in enumerate(lines) if ln == ": keep-alive"]
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert keepalives and max(keepalives) > first_data  # between chunks, not only before the first
    assert all(ln == ": keep-alive" or ln.startswith("data: ") for ln in lines)


async def test_vllm_failure_without_stream_is_500_nested(emu, http):
    """Not streamed, the injected failure is HTTP 500 in vLLM's nested error shape."""
    status, body = await post(http, f"{emu['vllm']}/v1/chat/completions",
                              chat_body("m2", max_tokens=10, ignore_eos=True))
    assert status == 500 and body["error"]["code"] == 500 and "--fail-after-tokens" in body["error"]["message"]


async def test_vllm_serves_several_models_and_embeddings(emu, http):
    """Every --model is listed and usable; /v1/embeddings gives deterministic unit vectors; others get 404."""
    status, _, text = await get(http, f"{emu['vllm']}/v1/models")
    assert [m["id"] for m in json.loads(text)["data"]] == ["m1", "m2"]
    url = f"{emu['vllm']}/v1/embeddings"
    status, first = await post(http, url, {"model": "m2", "input": ["the cache batch", "region"]})
    assert status == 200 and first["object"] == "list" and first["model"] == "m2"
    vectors = [d["embedding"] for d in first["data"]]
    assert [d["index"] for d in first["data"]] == [0, 1] and all(len(v) == EMBEDDING_DIM for v in vectors)
    assert all(math.isclose(sum(x * x for x in v), 1.0) for v in vectors)
    assert first["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    status, again = await post(http, url, {"model": "m1", "input": "the cache batch"})
    assert again["data"][0]["embedding"] == vectors[0]
    # encoding_format "base64" (the openai client's default): float32, little-endian, as vLLM sends them.
    status, packed = await post(http, url, {"model": "m1", "input": "the cache batch", "encoding_format": "base64"})
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert status == 200 and list(struct.unpack(f"<{EMBEDDING_DIM}f", raw)) == pytest.approx(vectors[0], abs=1e-6)
    status, body = await post(http, url, {"model": "m1", "input": "x", "encoding_format": "int8"})
    assert status == 400 and body["error"]["param"] == "encoding_format"
    status, body = await post(http, url, {"model": "m3", "input": "x"})
    assert status == 404 and body["error"]["message"] == "The model `m3` does not exist."


# ---- SGLang -------------------------------------------------------------------------------------------------------

async def test_vllm_responses_api_stores_chains_and_streams_events(emu, http):
    """/v1/responses as vLLM serves it with its store on: a stored response is retrieved by id and continued with
    previous_response_id (its conversation in the prompt); unknown ids get 404, ids not starting with resp 400; a
    stream is vLLM's event sequence, each event named on an event: line, ended by an error event on failure."""
    url = f"{emu['vllm']}/v1/responses"
    status, first = await post(http, url, {"model": "m1", "input": "hello there", "max_output_tokens": 2,
                                           "ignore_eos": True})
    assert status == 200 and first["object"] == "response" and first["id"].startswith("resp_")
    assert first["status"] == "incomplete" and first["usage"]["output_tokens"] == 2
    status, _, text = await get(http, f"{url}/{first['id']}")
    assert status == 200 and json.loads(text)["id"] == first["id"]
    status, second = await post(http, url, {"model": "m1", "input": [{"role": "user", "content": "more"}],
                                            "previous_response_id": first["id"], "max_output_tokens": 2})
    assert status == 200 and second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    for previous, code in (("resp_unknown", 404), ("chatcmpl-1", 400)):
        status, body = await post(http, url, {"model": "m1", "input": "x", "previous_response_id": previous})
        assert status == code and body["error"]["param"] == "response_id" and previous in body["error"]["message"]
    status, _, lines = await raw_lines(http, url, {"model": "m1", "input": "hi", "stream": True,
                                                   "max_output_tokens": 2, "ignore_eos": True})
    events = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    assert status == 200 and events == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    _, _, lines = await raw_lines(http, url, {"model": "m1", "input": "hi", "stream": True, "ignore_eos": True})
    assert [ln for ln in lines if ln.startswith("event: ")][-1] == "event: error"  # --fail-after-tokens 3


async def test_sglang_metrics_loads_and_get_load(emu, http):
    """SGLang's /metrics (rank labels), /v1/loads and legacy /get_load report its queue; /health is 200 empty."""
    base = emu["sglang"]
    assert (await get(http, f"{base}/health"))[::2] == (200, "")
    status, ctype, text = await get(http, f"{base}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    labels = f'{{engine_type="unified",model_name="{MODEL}",pp_rank="0",tp_rank="0"}}'
    assert f"\nsglang:num_queue_reqs{labels} 0.0" in text and f"\nsglang:num_running_reqs{labels} 0.0" in text
    loads = json.loads((await get(http, f"{base}/v1/loads"))[2])
    assert loads["dp_rank_count"] == 1 and loads["aggregate"]["total_waiting_reqs"] == 0
    assert {"dp_rank", "num_running_reqs", "num_waiting_reqs", "token_usage"} <= set(loads["loads"][0])
    assert json.loads((await get(http, f"{base}/get_load"))[2]) == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


async def test_sglang_errors_are_flat(emu, http):
    """SGLang errors are {"object": "error", "message", "type", "param", "code"} (400 and 404)."""
    status, body = await post(http, f"{emu['sglang']}/v1/chat/completions", chat_body("nope"))
    assert status == 404 and body["object"] == "error" and body["code"] == 404
    assert set(body) == {"object", "message", "type", "param", "code"}
    status, body = await post(http, f"{emu['sglang']}/v1/completions", "{oops")
    assert status == 400 and body["object"] == "error" and "Invalid JSON" in body["message"]
    status, body = await post(http, f"{emu['sglang']}/v1/chat/completions", chat_body(MODEL, max_tokens=2))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert "matched_stop" in body["choices"][0] and body["usage"]["completion_tokens"] <= 2


# ---- llama.cpp ----------------------------------------------------------------------------------------------------

async def test_llamacpp_health_metrics_slots(emu, http):
    """llama-server: /health {"status":"ok"}; /metrics in its hand-written layout; /slots has --parallel slots."""
    base = emu["llamacpp"]
    assert json.loads((await get(http, f"{base}/health"))[2]) == {"status": "ok"}
    status, _, text = await get(http, f"{base}/metrics")
    assert status == 200
    assert ("# HELP llamacpp:requests_deferred Number of requests deferred\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n") in text
    for name in ("requests_processing", "prompt_tokens_total", "tokens_predicted_total"):
        assert f"\nllamacpp:{name} " in text
    slots = json.loads((await get(http, f"{base}/slots"))[2])
    assert [s["id"] for s in slots] == [0, 1, 2] and not any(s["is_processing"] for s in slots)


async def test_llamacpp_responses_carry_timings_and_cached_tokens(emu, http):
    """Responses carry timings and usage.prompt_tokens_details.cached_tokens (a repeated prompt hits the cache)."""
    body = chat_body("anything", max_tokens=3, ignore_eos=True)
    body["messages"][0]["content"] = " ".join(f"w{i}" for i in range(40))
    usages = []
    for _ in range(2):
        status, answer = await post(http, f"{emu['llamacpp']}/v1/chat/completions", body)
        assert status == 200 and answer["model"] == "anything"  # one model: the request's name is echoed
        assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"} <= set(answer["timings"])
        usages.append(answer["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 32  # two full 16-token blocks of the 41-token prompt


async def test_llamacpp_errors_are_nested_without_param(emu, http):
    """llama.cpp errors are {"error": {"code", "message", "type"}} with no param."""
    status, body = await post(http, f"{emu['llamacpp']}/v1/completions", {"prompt": ""})
    assert status == 400 and body == {"error": {"code": 400, "message": body["error"]["message"],
                                                "type": "invalid_request_error"}}


async def test_llamacpp_loading_answers_503_but_lists_models(emu, http):
    """While loading, /health and /metrics answer 503 "Loading model"; /v1/models already answers."""
    base = emu["llamacpp-loading"]
    for path in ("/health", "/metrics", "/slots"):
        status, _, text = await get(http, f"{base}{path}")
        assert status == 503
        assert json.loads(text) == {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
    assert (await get(http, f"{base}/v1/models"))[0] == 200


async def test_llamacpp_midstream_error_is_an_error_line(emu, http):
    """llama.cpp's mid-stream failure is an 'error: {...}' line under HTTP 200, with no [DONE] after it."""
    body = {"prompt": "a b c", "max_tokens": 8, "ignore_eos": True, "stream": True}
    status, _, lines = await raw_lines(http, f"{emu['llamacpp-failing']}/v1/completions", body)
    assert status == 200
    assert [ln.split(":", 1)[0] for ln in lines] == ["data", "data", "error"]
    error = json.loads(lines[-1][len("error: "):])
    assert error["code"] == 500 and error["type"] == "server_error"


# ---- TGI ----------------------------------------------------------------------------------------------------------

async def test_tgi_metrics_info_health(emu, http):
    """TGI: /metrics has tgi_queue_size and tgi_batch_current_size; /info names the router; /health 200 empty."""
    base = emu["tgi"]
    text = (await get(http, f"{base}/metrics"))[2]
    assert "# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n" in text and "\ntgi_batch_current_size 0\n" in text
    info = json.loads((await get(http, f"{base}/info"))[2])
    assert info["router"] == "text-generation-router" and info["model_id"] == MODEL
    assert info["max_concurrent_requests"] == 2
    assert (await get(http, f"{base}/health"))[::2] == (200, "")


async def test_tgi_errors_ignore_model_and_overload_429(emu, http):
    """TGI errors are {"error", "error_type"} (422 validation); any model name is served; overload is 429."""
    base = emu["tgi"]
    status, body = await post(http, f"{base}/v1/chat/completions", {"model": "tgi", "messages": []})
    assert status == 422 and body["error_type"] == "validation" and set(body) == {"error", "error_type"}
    status, body = await post(http, f"{base}/v1/chat/completions", chat_body("tgi", max_tokens=2))
    assert status == 200 and body["model"] == MODEL

    long = {"model": "tgi", "prompt": "busy " * 5, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    responses = [await http.post(f"{base}/v1/completions", json=long) for _ in range(2)]
    try:
        assert [r.status for r in responses] == [200, 200]
        status, body = await post(http, f"{base}/v1/chat/completions", chat_body("tgi", max_tokens=1))
        assert (status, body) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    finally:
        for r in responses:
            r.close()  # drops the connections: both requests leave the engine


# ---- Ollama: native API -------------------------------------------------------------------------------------------

async def test_ollama_metadata_endpoints(emu, http):
    """GET/HEAD / say Ollama is running; /api/version, /api/tags, /api/ps and /api/show answer Ollama's shapes."""
    base = emu["ollama"]
    assert (await get(http, f"{base}/"))[::2] == (200, "Ollama is running")
    async with http.head(f"{base}/") as resp:
        assert resp.status == 200
    assert "version" in json.loads((await get(http, f"{base}/api/version"))[2])
    tags = json.loads((await get(http, f"{base}/api/tags"))[2])["models"]
    assert [m["name"] for m in tags] == OLLAMA_MODELS and tags[0]["details"]["format"] == "gguf"
    assert {"size", "digest", "modified_at"} <= set(tags[0])
    await post(http, f"{base}/api/generate", {"model": "llama3.2"})  # an empty generate loads the model
    ps = json.loads((await get(http, f"{base}/api/ps"))[2])["models"]
    assert {"expires_at", "size_vram", "context_length"} <= set(ps[0])
    status, show = await post(http, f"{base}/api/show", {"model": "qwen2.5:0.5b"})
    assert status == 200 and {"modelfile", "template", "details", "model_info", "capabilities"} <= set(show)
    assert await post(http, f"{base}/api/show", {"model": "gone"}) == (404, {"error": "model 'gone' not found"})
    assert await post(http, f"{base}/api/show", {}) == (400, {"error": "model is required"})


async def test_ollama_generate_streams_ndjson_by_default(emu, http):
    """/api/generate streams NDJSON by default: pieces with done false, then done true with durations (ns)."""
    body = {"model": "llama3.2:latest", "prompt": "why is the sky blue", "options": {"num_predict": 5,
                                                                                     "ignore_eos": True}}
    status, ctype, lines = await raw_lines(http, f"{emu['ollama']}/api/generate", body)
    assert status == 200 and ctype.startswith("application/x-ndjson")
    objs = ndjson(lines)
    assert [o["done"] for o in objs] == [False] * 5 + [True]
    assert len("".join(o["response"] for o in objs).split()) == 5
    final = objs[-1]
    assert final["done_reason"] == "length" and final["eval_count"] == 5 and final["response"] == ""
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert type(final[key]) is int and final[key] >= 0
    assert final["total_duration"] > final["eval_duration"] > 0 and final["prompt_eval_count"] > 0
    assert len(final["context"]) == final["prompt_eval_count"] + 5 and all(type(t) is int for t in final["context"])


async def test_ollama_generate_and_chat_without_stream(emu, http):
    """stream false gives one object: generate's response text and context, chat's assistant message."""
    base = emu["ollama"]
    status, gen = await post(http, f"{base}/api/generate", {"model": "llama3.2", "prompt": "hi", "stream": False,
                                                            "options": {"num_predict": 3, "ignore_eos": True}})
    assert status == 200 and gen["done"] and len(gen["response"].split()) == 3 and "context" in gen
    status, chat = await post(http, f"{base}/api/chat", chat_body("qwen2.5:0.5b", stream=False,
                                                                  options={"num_predict": 4, "ignore_eos": True}))
    assert status == 200 and chat["message"]["role"] == "assistant" and len(chat["message"]["content"].split()) == 4
    assert chat["done_reason"] == "length" and "context" not in chat


async def test_ollama_chat_streams_messages(emu, http):
    """/api/chat streams message pieces as NDJSON and ends with an empty message, done true."""
    body = chat_body("llama3.2", options={"num_predict": 3, "ignore_eos": True})
    _, _, lines = await raw_lines(http, f"{emu['ollama']}/api/chat", body)
    objs = ndjson(lines)
    assert [o["done"] for o in objs] == [False, False, False, True]
    assert all(o["message"]["role"] == "assistant" for o in objs) and objs[-1]["message"]["content"] == ""


async def test_ollama_load_requests_and_errors(emu, http):
    """An empty prompt only loads the model (keep_alive 0 unloads); unknown models get Ollama's 404 wording."""
    base = emu["ollama"]
    status, body = await post(http, f"{base}/api/generate", {"model": "llama3.2"})
    assert status == 200 and body["done"] and body["done_reason"] == "load"
    status, body = await post(http, f"{base}/api/chat", {"model": "llama3.2", "messages": [], "keep_alive": 0})
    assert body["done_reason"] == "unload" and body["message"] == {"role": "assistant", "content": ""}
    for path in ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings"):
        status, body = await post(http, f"{base}{path}", {"model": "mistral", "prompt": "x", "input": "x"})
        assert (status, body) == (404, {"error": 'model "mistral" not found, try pulling it first'}), path
    assert await post(http, f"{base}/api/generate", {"prompt": "x"}) == (400, {"error": "model is required"})


async def test_ollama_embed_and_embeddings(emu, http):
    """/api/embed takes a string or a list (embeddings); legacy /api/embeddings takes prompt (embedding)."""
    base = emu["ollama"]
    status, one = await post(http, f"{base}/api/embed", {"model": "llama3.2", "input": "the sky"})
    assert status == 200 and len(one["embeddings"]) == 1 and len(one["embeddings"][0]) == EMBEDDING_DIM
    status, two = await post(http, f"{base}/api/embed", {"model": "llama3.2", "input": ["the sky", "blue"]})
    assert two["embeddings"][0] == one["embeddings"][0] and len(two["embeddings"]) == 2
    status, legacy = await post(http, f"{base}/api/embeddings", {"model": "llama3.2", "prompt": "the sky"})
    assert status == 200 and legacy["embedding"] == one["embeddings"][0]
    status, body = await post(http, f"{base}/api/embed", {"model": "llama3.2", "input": 7})
    assert (status, body) == (400, {"error": "invalid input type"})


async def test_ollama_queue_cap_answers_503(emu, http):
    """With 1 slot and OLLAMA_MAX_QUEUE 1, a third concurrent request gets 503 "server busy"."""
    base = emu["ollama"]
    long = {"model": "llama3.2", "prompt": "slow " * 5, "options": {"num_predict": 3000, "ignore_eos": True}}
    # Headers come back once a request is in the engine: the first then runs, the second waits.
    responses = [await http.post(f"{base}/api/generate", json=long) for _ in range(2)]
    try:
        assert [r.status for r in responses] == [200, 200]
        status, body = await post(http, f"{base}/api/generate", {**long, "stream": False})
        assert (status, body) == (503, {"error": QUEUE_FULL})
    finally:
        for r in responses:
            r.close()  # drops the connections: both requests leave the engine


async def test_ollama_midstream_error_is_an_error_line(emu, http):
    """An Ollama stream that fails after it started ends with an {"error": ...} NDJSON line under HTTP 200."""
    body = {"model": "llama3.1:8b", "prompt": "x y", "options": {"num_predict": 6, "ignore_eos": True}}
    status, _, lines = await raw_lines(http, f"{emu['ollama-failing']}/api/generate", body)
    objs = ndjson(lines)
    assert status == 200 and [o.get("done") for o in objs[:2]] == [False, False]
    assert set(objs[-1]) == {"error"} and len(objs) == 3


# ---- Ollama: OpenAI-compatible API ---------------------------------------------------------------------------------

async def test_ollama_openai_endpoints(emu, http):
    """Ollama's /v1 serves chat, models and embeddings, with OpenAI-shaped errors (param and code null)."""
    base = emu["ollama"]
    models = json.loads((await get(http, f"{base}/v1/models"))[2])
    assert [m["id"] for m in models["data"]] == OLLAMA_MODELS and models["data"][0]["owned_by"] == "library"
    status, body = await post(http, f"{base}/v1/chat/completions", chat_body("llama3.2", max_tokens=2))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    status, body = await post(http, f"{base}/v1/embeddings", {"model": "qwen2.5:0.5b", "input": ["a", "b"]})
    assert status == 200 and len(body["data"]) == 2
    status, body = await post(http, f"{base}/v1/chat/completions", chat_body("mistral"))
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert body["error"]["param"] is None and body["error"]["code"] is None


# ---- the official ollama client -----------------------------------------------------------------------------------

async def test_official_ollama_client(emu):
    """The official ollama Python client works against the personality: generate, chat (streamed and not),
    embed, list, ps, show, and a 404 as ResponseError."""
    ollama = pytest.importorskip("ollama")  # a test dependency: pip install ollama (0.6.3 here)
    client = ollama.AsyncClient(host=emu["ollama"], timeout=10)
    opts = {"num_predict": 4, "ignore_eos": True}
    gen = await client.generate(model="llama3.2", prompt="hello", options=opts)
    assert gen.done and len(gen.response.split()) == 4 and gen.eval_count == 4
    pieces = [part async for part in await client.generate(model="llama3.2", prompt="hello", options=opts,
                                                           stream=True)]
    assert pieces[-1].done and len("".join(p.response for p in pieces).split()) == 4
    chat = await client.chat(model="qwen2.5:0.5b", messages=[{"role": "user", "content": "hi"}], options=opts)
    assert chat.message.role == "assistant" and len(chat.message.content.split()) == 4
    parts = [p async for p in await client.chat(model="qwen2.5:0.5b", messages=[{"role": "user", "content": "hi"}],
                                                options=opts, stream=True)]
    assert parts[-1].done and parts[-1].done_reason == "length"
    assert len("".join(p.message.content for p in parts).split()) == 4
    embedded = await client.embed(model="llama3.2", input=["a b", "c"])
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == EMBEDDING_DIM
    assert [m.model for m in (await client.list()).models] == OLLAMA_MODELS
    assert len((await client.ps()).models) == 2
    shown = await client.show("llama3.2")
    assert shown.details.format == "gguf" and "completion" in shown.capabilities
    with pytest.raises(ollama.ResponseError) as info:
        await client.generate(model="mistral", prompt="x")
    assert info.value.status_code == 404 and "not found" in info.value.error


# ---- flags --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "needle"), [
    (["--engine", "vllm", "--no-metrics"], "--no-metrics does not apply to --engine vllm"),
    (["--engine", "ollama", "--max-concurrent-requests", "3"], "--max-concurrent-requests does not apply"),
    (["--engine", "llamacpp", "--load-seconds", "-1"], "--load-seconds must be at least 0"),
])
def test_engine_specific_flags_are_checked(procs, flags, needle):
    """A flag the chosen engine does not honour, or a bad value, exits 2 before anything listens."""
    proc = procs.skylb("emulator", "--port", str(free_ports(1)[0]), *flags, name="emu-flags")
    assert proc.popen.wait(timeout=10) == 2
    assert needle in proc.log()
