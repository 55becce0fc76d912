"""Engine adapters probing real emulator processes in each engine's dialect (and a canned server for odd answers)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from skylb.engines import ADAPTERS, adapter_for, detect_engine
from skylb.core import AvailabilityRules, Router, make_policy
from skylb.engines.openai import DEFAULT_SLOTS
from bench.emulator.model import EngineParams
from bench.launch.procs import ProcGroup, free_port, free_ports, wait_http

# One xdist worker runs the whole module (--dist loadgroup): it shares its emulator processes (fixture emulators),
# started once, not once per worker.
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("engine_adapters")]

#: 0.02: a decode step is about 1.1 ms.
TIME_SCALE = "0.02"
SLOTS = 2
TIMEOUT_S = 2.0
OLLAMA_MODELS = ["llama3.2:1b", "qwen2.5:0.5b"]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

#: name -> (engine, extra flags): one emulator process each.
EMULATORS = {
    "vllm": ("vllm", []),
    "sglang": ("sglang", []),
    "sglang-loads": ("sglang", ["--no-metrics"]),
    "sglang-get-load": ("sglang", ["--no-metrics", "--disable-endpoint", "/v1/loads"]),
    "llamacpp": ("llamacpp", []),
    "llamacpp-no-metrics": ("llamacpp", ["--no-metrics"]),
    "llamacpp-loading": ("llamacpp", ["--load-seconds", "120"]),
    "tgi": ("tgi", []),
    "ollama": ("ollama", [arg for m in OLLAMA_MODELS for arg in ("--model", m)]),
}


@pytest.fixture(scope="module")
def emulators(tmp_path_factory):
    """Every emulator of EMULATORS, started together (2 running slots each); name -> base URL."""
    ports = dict(zip(EMULATORS, free_ports(len(EMULATORS))))
    group = ProcGroup(tmp_path_factory.mktemp("adapter-emulators"))
    try:
        procs = {name: group.skylb("emulator", "--engine", engine, "--port", str(ports[name]), "--time-scale",
                                   TIME_SCALE, "--max-num-seqs", str(SLOTS), "--no-request-log", *extra, name=name)
                 for name, (engine, extra) in EMULATORS.items()}
        for name, port in ports.items():  # /v1/models answers on every engine, even while llama.cpp loads
            wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=20, proc=procs[name].popen)
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        group.stop_all()


@pytest.fixture
async def session():
    """One aiohttp session per test."""
    async with aiohttp.ClientSession() as s:
        yield s


class CannedServer:
    """An in-process HTTP server answering canned ``(status, body)`` per path and counting the hits."""

    def __init__(self):
        self.answers: dict[str, tuple[int, str | bytes]] = {}
        self.hits: list[str] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        status, body = self.answers.get(request.path, (404, '{"detail":"Not Found"}'))
        if isinstance(body, bytes):  # sent as it is, even when it is not UTF-8
            return web.Response(status=status, body=body, content_type="text/plain")
        return web.Response(status=status, text=body)


@pytest.fixture
async def canned():
    """A CannedServer on a free port for the length of the test."""
    server = CannedServer()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        await runner.cleanup()


async def probe(session, engine: str, url: str, **kwargs):
    """One probe of ``url`` with ``engine``'s adapter."""
    return await adapter_for(engine).probe(session, url, timeout_s=TIMEOUT_S, **kwargs)


async def stream(session, url: str, tag: str, n_tokens: int = 400) -> None:
    """A streaming completion that decodes about n_tokens x 1.1 ms (read to the end)."""
    body = {"model": MODEL, "prompt": f"{tag} " * 10, "max_tokens": n_tokens, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for _ in resp.content:
            pass


METRIC_ENGINES = [("vllm", "vllm"), ("sglang", "sglang"), ("sglang-loads", "sglang"),
                  ("sglang-get-load", "sglang"), ("llamacpp", "llamacpp"), ("tgi", "tgi")]


@pytest.mark.parametrize(("emulator", "engine"), METRIC_ENGINES + [("ollama", "ollama"), ("vllm", "openai")])
async def test_idle_replica_is_healthy_with_zero_pending(emulators, session, emulator, engine):
    """An idle replica of each engine (sglang through each of its three sources) probes healthy, pending 0."""
    result = await probe(session, engine, emulators[emulator])
    assert result.healthy, result.error
    assert result.pending == 0 and result.running == 0


@pytest.mark.parametrize(("emulator", "engine"), [("vllm", "vllm"), ("sglang", "sglang"), ("sglang-loads", "sglang")])
async def test_kv_capacity_in_tokens_from_the_emulated_engines_metrics(emulators, session, emulator, engine):
    """vLLM's ``cache_config_info`` (num_gpu_blocks x block_size) and SGLang's ``max_total_num_tokens``, as the
    emulator serves them, give the KV cache's size in tokens (the emulator's default cache)."""
    result = await probe(session, engine, emulators[emulator])
    assert result.healthy and result.kv_capacity_tokens == EngineParams().num_blocks * EngineParams().block_size
    # SGLang reserves up to 4096 output tokens when it admits a request; vLLM admits on the prompt alone.
    assert result.output_reserve_tokens == (4096 if engine == "sglang" else None)


@pytest.mark.parametrize(("engine", "text", "tokens"), [
    ("vllm", 'vllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
             'num_gpu_blocks="27921"} 1.0\n', 446736),
    ("vllm", 'vllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n',
     None),  # before the engine has profiled its memory
    ("vllm", "vllm:num_requests_waiting 0\n", None),
    ("sglang", "sglang:num_queue_reqs 0\nsglang:max_total_num_tokens 471258\n", 471258),
    ("sglang", "sglang:num_queue_reqs 0\n", None),
])
async def test_kv_capacity_from_each_engines_metrics(session, canned, engine, text, tokens):
    """The KV cache's size in tokens where the engine exports it, None where it does not."""
    canned.answers["/metrics"] = (200, text)
    result = await probe(session, engine, canned.url)
    assert result.healthy and result.kv_capacity_tokens == tokens


@pytest.mark.parametrize(("loads", "expected"), [
    ([{"dp_rank": 0, "num_waiting_reqs": 1, "num_running_reqs": 3, "token_usage": 0.25, "max_total_num_tokens": 9000},
      {"dp_rank": 1, "num_waiting_reqs": 0, "num_running_reqs": 2, "token_usage": 0.5, "max_total_num_tokens": 9000}],
     (0.5, 9000, 4096, 0.098)),
    ([{"dp_rank": 0, "num_waiting_reqs": 0, "num_running_reqs": 0}], (None, None, None, None)),  # an older release
    ([{"dp_rank": 0, "num_waiting_reqs": 0, "num_running_reqs": 0, "token_usage": "high",
       "max_total_num_tokens": 9000}], (None, None, None, None)),
])
async def test_sglang_kv_cache_from_v1_loads(session, canned, loads, expected):
    """SGLang without --enable-metrics: /v1/loads gives the KV cache's usage (the fullest rank) and size, and the
    engine's output reserve with its ratio at the floor (the endpoint does not carry it); a release or an answer
    without usable KV fields gives none, and still its load."""
    canned.answers["/metrics"] = (404, "")
    canned.answers["/v1/loads"] = (200, json.dumps({"loads": loads}))
    result = await probe(session, "sglang", canned.url)
    assert result.healthy and result.pending == sum(rank["num_waiting_reqs"] for rank in loads)
    assert (result.kv_usage, result.kv_capacity_tokens, result.output_reserve_tokens,
            result.output_reserve_ratio) == expected


@pytest.mark.parametrize(("text", "ratio"), [
    ('sglang:num_queue_reqs 0\nsglang:new_token_ratio{tp_rank="0"} 0.31\nsglang:new_token_ratio{tp_rank="1"} 0.4\n',
     0.4),
    ("sglang:num_queue_reqs 0\n", 0.098),  # an SGLang that does not export it: the floor its ratio decays to
])
async def test_sglang_new_token_ratio_from_its_metrics(session, canned, text, ratio):
    """The share of the running batch's remaining output SGLang keeps reserved (its ``new_token_ratio``, the
    fullest rank's), or the floor when it does not say; vLLM reserves none."""
    canned.answers["/metrics"] = (200, text)
    result = await probe(session, "sglang", canned.url)
    assert result.healthy and result.output_reserve_ratio == ratio
    canned.answers["/metrics"] = (200, "vllm:num_requests_waiting 0\n")
    assert (await probe(session, "vllm", canned.url)).output_reserve_ratio is None


@pytest.mark.parametrize(("emulator", "engine"), METRIC_ENGINES)
async def test_pending_rises_when_more_requests_than_slots(emulators, session, emulator, engine):
    """With more concurrent requests than the batch has slots, the engine's own signal reads pending > 0."""
    url = emulators[emulator]
    # Streams of about 4.4 s, cancelled once seen: 0.44 s ones could end before the last one arrived on a loaded
    # machine (pending 2, running 1 was seen once with the suite on 4 workers).
    tasks = [asyncio.create_task(stream(session, url, f"{emulator}{i}", n_tokens=4000)) for i in range(SLOTS + 2)]
    try:
        seen, deadline = None, time.monotonic() + 5
        while time.monotonic() < deadline:
            seen = await probe(session, engine, url)
            if seen.healthy and seen.pending == 2 and seen.running == SLOTS:  # not a reading mid-admission
                break
            await asyncio.sleep(0.01)
        assert seen.healthy and seen.pending == 2 and seen.running == SLOTS, seen
    finally:
        for task in tasks:
            task.cancel()  # closing the connections cancels the requests in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (await probe(session, engine, url)).pending:
        await asyncio.sleep(0.02)
    assert (await probe(session, engine, url)).pending == 0


@pytest.mark.parametrize(("outstanding", "max_concurrency", "pending", "running"), [
    (0, None, 0, 0), (1, None, 0, 1), (3, None, 2, 1), (3, 2, 1, 2), (4, 8, 0, 4)])
async def test_ollama_pending_comes_from_outstanding(emulators, session, outstanding, max_concurrency, pending,
                                                     running):
    """Ollama has no metric: pending = outstanding - slots, slots = max_concurrency or OLLAMA_NUM_PARALLEL's 1."""
    result = await probe(session, "ollama", emulators["ollama"], outstanding=outstanding,
                         max_concurrency=max_concurrency)
    assert result.healthy and (result.pending, result.running) == (pending, running)


@pytest.mark.parametrize(("outstanding", "max_concurrency", "pending"), [
    (DEFAULT_SLOTS, None, 0), (DEFAULT_SLOTS + 3, None, 3), (5, 4, 1), (5, 5, 0)])
async def test_openai_pending_comes_from_outstanding(emulators, session, outstanding, max_concurrency, pending):
    """A generic OpenAI server: pending = outstanding - max_concurrency (default 8); healthy by /v1/models."""
    result = await probe(session, "openai", emulators["vllm"], outstanding=outstanding,
                         max_concurrency=max_concurrency)
    assert result.healthy and result.pending == pending
    assert result.running == min(outstanding, max_concurrency or DEFAULT_SLOTS)


@pytest.mark.parametrize("engine", sorted(ADAPTERS))
async def test_down_server_is_unhealthy_with_a_reason(session, engine):
    """Every adapter (auto too) reports a replica that refuses connections as unhealthy, saying so."""
    result = await probe(session, engine, f"http://127.0.0.1:{free_port()}", outstanding=1)
    assert not result.healthy
    assert "connection refused" in result.error or "ClientConnectorError" in result.error


async def test_llamacpp_loading_is_unhealthy_loading_model(emulators, session):
    """A llama-server still loading its model (503 "Loading model") is unhealthy with reason "loading model"."""
    async with session.get(f"{emulators['llamacpp-loading']}/health") as resp:
        assert resp.status == 503
    result = await probe(session, "llamacpp", emulators["llamacpp-loading"])
    assert (result.healthy, result.error) == (False, "loading model")


async def test_llamacpp_without_metrics_says_to_start_with_metrics(emulators, session):
    """A llama-server without --metrics (501) is unhealthy and the reason names the missing flag."""
    result = await probe(session, "llamacpp", emulators["llamacpp-no-metrics"])
    assert not result.healthy and "start llama-server with --metrics" in result.error and "501" in result.error


@pytest.mark.parametrize(("engine", "text", "reason"), [
    ("vllm", 'vllm:num_requests_waiting_by_reason{reason="capacity"} 5\n', "no vllm:num_requests_waiting"),
    ("llamacpp", "llamacpp:requests_processing 2\n", "no llamacpp:requests_deferred"),
    ("tgi", "tgi_batch_current_size 2\ntgi_queue_size_total 3\n", "no tgi_queue_size"),
    ("sglang", "sglang:num_running_reqs 1\n", "no load signal"),
])
async def test_metrics_without_the_pending_metric_is_unhealthy(session, canned, engine, text, reason):
    """/metrics answering 200 without the exact pending metric (look-alike names do not count) is unhealthy."""
    canned.answers["/metrics"] = (200, text)
    result = await probe(session, engine, canned.url)
    assert not result.healthy and reason in result.error


@pytest.mark.parametrize(("engine", "text"), [
    ("vllm", 'vllm:num_requests_waiting{engine="0" 1\n'),
    ("vllm", "vllm:num_requests_waiting many\n"),
    ("vllm", b"vllm:num_requests_waiting \xff\n"),
    ("sglang", "sglang:num_queue_reqs many\n"),
    ("llamacpp", "llamacpp:requests_deferred many\n"),
    ("tgi", 'tgi_queue_size{shard="0" 1\n'),
    ("tgi", b"tgi_queue_size \xff\n"),
    ("vllm", "vllm:num_requests_waiting NaN\n"),  # parses as a float, but is no count of requests
    ("vllm", "vllm:num_requests_waiting 1\nvllm:num_requests_running +Inf\n"),
    ("sglang", "sglang:num_queue_reqs NaN\n"),
    ("llamacpp", "llamacpp:requests_deferred +Inf\n"),
    ("tgi", "tgi_queue_size 0\ntgi_batch_current_size NaN\n"),
])
async def test_malformed_metrics_is_unhealthy_with_the_reason(session, canned, engine, text):
    """/metrics answering 200 with an unparsable pending metric is unhealthy, the reason saying "malformed"."""
    canned.answers["/metrics"] = (200, text)
    result = await probe(session, engine, canned.url)
    assert not result.healthy and result.error.startswith("malformed /metrics: "), result


@pytest.mark.parametrize(("engine", "text", "pending", "running"), [
    ("vllm", 'vllm:num_requests_waiting_by_reason{reason="x"} 50\nvllm:num_requests_waiting{engine="0"} 1\n'
             'vllm:num_requests_waiting{engine="1"} 2\nvllm:num_requests_running{engine="0"} 4\n', 3, 4),
    ("sglang", 'sglang:num_queue_reqs{dp_rank="0",tp_rank="0"} 2\nsglang:num_queue_reqs{dp_rank="1",tp_rank="0"} 3\n'
               'sglang:num_queue_reqs_by_reason{reason="x"} 40\nsglang:num_running_reqs{dp_rank="0"} 7\n', 5, 7),
    ("llamacpp", "llamacpp:requests_deferred 3\nllamacpp:requests_deferred_total 99\n", 3, None),
    ("tgi", "tgi_queue_size 4\ntgi_queue_size_total 99\ntgi_batch_current_size 8\n", 4, 8),
])
async def test_pending_sums_label_sets_of_the_exact_name_only(session, canned, engine, text, pending, running):
    """Pending sums every label set (engine, tp/dp ranks) of the exact metric name; longer names are ignored."""
    canned.answers["/metrics"] = (200, text)
    result = await probe(session, engine, canned.url)
    assert result.healthy and (result.pending, result.running) == (pending, running), result


async def test_sglang_remembers_the_source_that_worked(session, canned):
    """SGLang falls back /metrics -> /v1/loads -> /get_load once, then probes only the source that worked."""
    canned.answers["/get_load"] = (200, '[{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 9},'
                                        ' {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 3}]')
    result = await probe(session, "sglang", canned.url)
    assert result.healthy and (result.pending, result.running) == (3, 3)
    assert canned.hits == ["/metrics", "/v1/loads", "/get_load"]
    canned.hits.clear()
    assert (await probe(session, "sglang", canned.url)).pending == 3
    assert canned.hits == ["/get_load"]
    del canned.answers["/get_load"]  # the remembered source disappears: the others are tried again
    canned.answers["/v1/loads"] = (200, '{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0}]}')
    canned.hits.clear()
    assert (await probe(session, "sglang", canned.url)).healthy
    assert canned.hits == ["/get_load", "/metrics", "/v1/loads"]


@pytest.mark.parametrize(("path", "body", "reason"), [
    ("/v1/loads", '{"loads": [{"num_waiting_reqs": "many"}]}', "malformed /v1/loads"),
    ("/v1/loads", "not json", "malformed /v1/loads"),
    ("/get_load", '{"oops": 1}', "malformed /get_load"),
])
async def test_sglang_malformed_load_answer_is_unhealthy(session, canned, path, body, reason):
    """A JSON load endpoint answering nonsense makes the replica unhealthy with a reason naming the endpoint."""
    canned.answers[path] = (200, body)
    result = await probe(session, "sglang", canned.url)
    assert not result.healthy and reason in result.error


@pytest.mark.parametrize(("emulator", "engine"), [
    ("vllm", "vllm"), ("sglang", "sglang"), ("sglang-loads", "sglang"), ("llamacpp", "llamacpp"),
    ("llamacpp-no-metrics", "llamacpp"), ("llamacpp-loading", "llamacpp"), ("tgi", "tgi"), ("ollama", "ollama")])
async def test_auto_detects_each_personality(emulators, session, emulator, engine):
    """--engine auto tells every personality apart (with or without metrics, even while loading)."""
    assert await detect_engine(session, emulators[emulator], timeout_s=TIMEOUT_S) == engine


async def test_auto_falls_back_to_openai_and_delegates(emulators, session, canned):
    """A server that is none of the known engines is "openai"; auto's probe is the detected engine's probe."""
    canned.answers["/v1/models"] = (200, '{"object": "list", "data": [{"id": "gpt-x"}]}')
    assert await detect_engine(session, canned.url, timeout_s=TIMEOUT_S) == "openai"
    result = await probe(session, "auto", canned.url, outstanding=DEFAULT_SLOTS + 1)
    assert result.healthy and result.pending == 1
    assert await adapter_for("auto").models(session, canned.url, timeout_s=TIMEOUT_S) == ["gpt-x"]
    result = await probe(session, "auto", emulators["ollama"], outstanding=3, max_concurrency=2)
    assert result.healthy and (result.pending, result.running) == (1, 2)


@pytest.mark.parametrize(("emulator", "engine", "models"), [
    ("vllm", "vllm", [MODEL]), ("sglang", "sglang", [MODEL]), ("llamacpp", "llamacpp", [MODEL]),
    ("tgi", "tgi", [MODEL]), ("ollama", "ollama", OLLAMA_MODELS), ("ollama", "auto", OLLAMA_MODELS),
    ("vllm", "openai", [MODEL])])
async def test_models_lists_each_personalitys_models(emulators, session, emulator, engine, models):
    """models() returns the served model names in each engine's own listing (Ollama: /api/tags)."""
    assert await adapter_for(engine).models(session, emulators[emulator], timeout_s=TIMEOUT_S) == models


# One row per engine and metric set: the probe's reading, then the skylb policy's view of the replica (its
# availability and estimated wait) with this balancer holding ``own`` unprefilled prompt tokens there. A first probe
# showing requests waiting beside a batch above the learned capacity's start (2) reads "batch full".
LOAD_ESTIMATE_ROWS = [
    # engine, /metrics text, outstanding, own unprefilled tokens, (pending, running, kv_usage), reason, wait s
    ("vllm", "vllm:num_requests_waiting 0\nvllm:num_requests_running 5\nvllm:kv_cache_usage_perc 0.42\n",
     0, [], (0, 5, 0.42), None, 0.0),
    ("vllm", "vllm:num_requests_waiting 0\nvllm:num_requests_running 9\nvllm:kv_cache_usage_perc 0.97\n",
     0, [], (0, 9, 0.97), "KV cache full", 0.0),
    ("vllm", "vllm:num_requests_waiting 0\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.3\n",
     0, [1500, 1000], (0, 2, 0.3), "prefill backlog", 1.25),  # before vLLM 0.12: the old KV gauge name
    ("vllm", 'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_running{engine="0"} 4\n'
             'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.8\n',
     0, [400], (2, 4, 0.8), "batch full", 0.456),  # one pending of unknown size (512) besides our own
    ("sglang", "sglang:num_queue_reqs 0\nsglang:num_running_reqs 3\nsglang:token_usage 0.25\n",
     0, [600], (0, 3, 0.25), None, 0.3),
    ("sglang", "sglang:num_queue_reqs 0\nsglang:num_running_reqs 30\nsglang:token_usage 0.99\n",
     0, [], (0, 30, 0.99), "KV cache full", 0.0),
    ("llamacpp", "llamacpp:requests_deferred 0\nllamacpp:requests_processing 1\n",
     0, [200], (0, 1, None), None, 0.1),
    ("llamacpp", "llamacpp:requests_deferred 1\nllamacpp:requests_processing 4\nllamacpp:kv_cache_usage_ratio 0.6\n",
     0, [], (1, 4, 0.6), "batch full", 0.256),  # an older build that still exports KV usage; no /props here
    ("tgi", "tgi_queue_size 0\ntgi_batch_current_size 2\n", 0, [800], (0, 2, None), None, 0.4),
    ("openai", None, 3, [100, 100, 100], (0, 3, None), None, 0.15),  # no metric: its own count vs max_concurrency
    ("openai", None, 6, [], (2, 4, None), "batch full", 0.512),
    ("ollama", None, 1, [300], (0, 1, None), None, 0.15),
]


@pytest.mark.parametrize(("engine", "text", "outstanding", "own", "load", "reason", "wait_s"), LOAD_ESTIMATE_ROWS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(LOAD_ESTIMATE_ROWS)])
async def test_load_estimate_from_each_engines_metrics(session, canned, engine, text, outstanding, own, load,
                                                       reason, wait_s):
    """Each engine's load signal (pending, running, KV usage) plus the balancer's own backlog gives the replica's
    availability under ``skylb`` and its estimated wait (tokens / 2000 tokens/s)."""
    if text is not None:
        canned.answers["/metrics"] = (200, text)
    else:  # engines without a load metric: answered from the balancer's own in-flight count
        canned.answers["/v1/models"] = (200, '{"data": []}')
        canned.answers["/"] = (200, "Ollama is running")
        canned.answers["/api/tags"] = (200, '{"models": []}')
    result = await probe(session, engine, canned.url, outstanding=outstanding,
                         max_concurrency=4 if engine == "openai" else 1 if engine == "ollama" else None)
    assert result.healthy, result
    assert (result.pending, result.running, result.kv_usage) == load
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([("r", canned.url, engine)])
    router.observe_replica("r", now=0.0, healthy=True, pending=result.pending, running=result.running,
                           slots=result.slots, kv_usage=result.kv_usage)
    state = router.replicas["r"]
    for i, tokens in enumerate(own):
        state.add_unprefilled(f"q{i}", tokens)
    assert router.replica_unavailable_reason(state, 0.01) == reason
    assert router.policy.estimated_wait_s(state) == pytest.approx(wait_s)
