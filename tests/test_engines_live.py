"""Every engine behind a live balancer, either API in front of either engine, forwarding between regions that run
different engines, and a hash-ring session through a balancer and a drain: real processes, the official clients.

One deployment serves the whole module (its processes start once, in parallel): a controller and three regions.
us runs one replica of each OpenAI-dialect engine (vLLM, SGLang, TGI, llama.cpp, a generic OpenAI server), each with
one running-batch slot so two requests make one pending; eu runs an Ollama replica; ch runs three vLLM replicas under
SkyLB-CH (``--policy skylb-ch``). Every region serves models of its own, so forwarding happens only where a test asks
for another region's model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import ollama
import openai
import pytest
import requests

from tests.cluster import MODEL, Cluster, post_json
from tests.procs import ProcGroup, free_ports, wait_http

# One worker runs the whole module (--dist loadgroup), so its deployment starts once.
pytestmark = pytest.mark.xdist_group("engines_live")

FAST = ("--time-scale", "0.1")
OLLAMA_MODEL = "llama3.1:8b"
CH_MODEL = "ch-model"
#: engine adapter -> (emulator personality, the model its replica serves, the metric its load is read from).
ENGINES = {"vllm": ("vllm", MODEL, "vllm:num_requests_waiting"),
           "sglang": ("sglang", "sg-model", "sglang:num_queue_reqs"),
           "tgi": ("tgi", "tgi-model", "tgi_queue_size"),
           "llamacpp": ("llamacpp", "lc-model", "llamacpp:requests_deferred"),
           "openai": ("openai", "generic-model", None)}
SESSIONS = [f"session-{i}" for i in range(6)]


def _start_emulators(procs: ProcGroup, specs: dict[str, tuple[int, tuple[str, ...]]], ports: list[int]
                     ) -> tuple[dict[str, list[str]], list[str]]:
    """Start one emulator process per spec (name -> (replicas, args)) on ``ports`` without waiting: (replica URLs
    by name, the URL that answers once each replica is up)."""
    urls, ready, free = {}, [], iter(ports)
    for name, (n, args) in specs.items():
        mine = [next(free) for _ in range(n)]
        procs.skylb("emulator", *args, *FAST, "--max-num-seqs", "1", *(a for p in mine for a in ("--port", str(p))),
                    name=name)
        urls[name] = [f"http://127.0.0.1:{p}" for p in mine]
        ready += [f"{u}{'/v1/models' if 'openai' in args else '/health'}" for u in urls[name]]
    return urls, ready


def _stop_together(procs: ProcGroup) -> None:
    """SIGTERM every process at once, then wait for each (one by one, each takes about a second to exit)."""
    for proc in procs.procs:
        with contextlib.suppress(ProcessLookupError):
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
    procs.stop_all()


def _models_known(cluster: Cluster, region: str, n: int) -> bool:
    replicas = cluster.status(region)["replicas"]
    return len(replicas) == n and all(r["healthy"] and r["models"] for r in replicas)


def _sees_peer_models(cluster: Cluster, region: str, n: int) -> bool:
    return sum(bool(p["healthy"] and p["models"] and any(p["models"].values()))
               for p in cluster.status(region)["peers"]) >= n


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The module's deployment (module docstring): (cluster, replica URLs by region and adapter)."""
    tmp = tmp_path_factory.mktemp("engines-live")
    procs = ProcGroup(tmp / "logs")
    cluster = Cluster(procs, Path(tmp))
    try:
        regions = ["us", "eu", "ch"]
        specs = {f"emu-{a}": (1, ("--engine", engine, "--model", model)) for a, (engine, model, _) in ENGINES.items()}
        specs["emu-ollama"] = (1, ("--engine", "ollama", "--model", OLLAMA_MODEL))
        specs["emu-ch"] = (3, ("--engine", "vllm", "--model", CH_MODEL))
        # One reservation for every port: processes that bind later cannot be handed one another's.
        ports = free_ports(sum(n for n, _ in specs.values()) + 1 + len(regions))
        urls, ready = _start_emulators(procs, specs, ports)
        cluster.start_controller(regions, port=ports[-1 - len(regions)])
        for region, port in zip(regions, ports[-3:]):
            cluster.start_balancer(region, regions, port=port, policy="skylb-ch" if region == "ch" else None,
                                   wait=False)
        replicas = [("us", urls[f"emu-{a}"][0], f"{a}-0", a) for a in ENGINES]
        replicas += [("eu", urls["emu-ollama"][0], "ollama-0", "ollama"),
                     *(("ch", url, f"r{i}", "vllm") for i, url in enumerate(urls["emu-ch"]))]
        for region, url, replica_id, engine in replicas:  # the controller's API (skylb-ctl is a process each)
            status, answer, _ = post_json(f"{cluster.controller_url}/v1/replicas",
                                          {"region": region, "url": url, "id": replica_id, "engine": engine})
            assert status in (200, 201), answer
        for url in [*ready, *(f"{b}/healthz" for b in cluster.balancers.values())]:
            wait_http(url, timeout_s=30)
        for region, n in (("us", len(ENGINES)), ("eu", 1), ("ch", 3)):
            cluster.wait_until(lambda: _models_known(cluster, region, n) and _sees_peer_models(cluster, region, 2),
                               timeout_s=30, what=f"{region}'s models and its peers' known")
        yield cluster, urls
        cluster.assert_counters_return_to_zero()
    finally:
        _stop_together(procs)


@contextlib.contextmanager
def _held_streams(url: str, model: str, n: int):
    """``n`` long streamed completions held open straight on a replica (not through a balancer); closed at the end,
    so the engine aborts them."""
    with contextlib.ExitStack() as stack:
        for i in range(n):
            resp = stack.enter_context(requests.post(
                f"{url}/v1/completions", stream=True, timeout=30,
                json={"model": model, "prompt": f"a long story {i}", "max_tokens": 1500, "ignore_eos": True,
                      "stream": True}))
            assert resp.status_code == 200, resp.text
        yield


def _replica(cluster: Cluster, region: str, replica_id: str) -> dict:
    return next(r for r in cluster.status(region)["replicas"] if r["id"] == replica_id)


def _header_hook(seen: list):
    """An httpx response hook keeping each response's headers (the ollama client hides them)."""
    return {"response": [lambda response: seen.append(response.headers)]}


# ---- every engine behind a balancer, with its load signal ----------------------------------------------------------

def test_every_engine_streams_to_the_openai_client_and_its_load_signal_is_read(deployment):
    """vLLM, SGLang, TGI, llama.cpp and a generic OpenAI server behind one balancer: the openai client's streamed
    chat for each one's model is answered by that replica with its usage; with two requests held straight on an
    engine (one slot), the balancer's status shows one running and one pending, read from that engine's own metric
    (the generic server has none: its load is the balancer's own count, so it shows nothing); a /v1/embeddings call
    succeeds through the balancer."""
    cluster, urls = deployment
    client = openai.OpenAI(base_url=f"{cluster.balancers['us']}/v1", api_key="unused", max_retries=0, timeout=30)
    for adapter, (_, model, _) in ENGINES.items():
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=[{"role": "user", "content": f"hello {adapter}"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True}) as raw:
            assert raw.headers["X-SkyLB-Served-By"] == f"us/{adapter}-0", adapter
            chunks = list(raw.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), adapter
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1, adapter
    with contextlib.ExitStack() as stack:
        for adapter, (_, model, _) in ENGINES.items():
            stack.enter_context(_held_streams(urls[f"emu-{adapter}"][0], model, 2))
        for adapter, (_, _, metric) in ENGINES.items():
            want = (1, 1) if metric else (0, 0)
            cluster.wait_until(lambda: (_replica(cluster, "us", f"{adapter}-0")["running"],
                                        _replica(cluster, "us", f"{adapter}-0")["pending"]) == want,
                               timeout_s=10, what=f"{adapter}: running, pending = {want} from {metric}")
    generic = urls["emu-openai"][0]  # the OpenAI API only: nothing a balancer could read a load from
    assert [requests.get(f"{generic}{path}", timeout=5).status_code for path in ("/health", "/metrics")] == [404, 404]
    embedded = client.embeddings.with_raw_response.create(model=MODEL, input=["one", "two"])
    assert embedded.headers["X-SkyLB-Served-By"] == "us/vllm-0"
    vectors = [item.embedding for item in embedded.parse().data]
    assert len(vectors) == 2 and len(vectors[0]) > 0 and vectors[0] != vectors[1]


# ---- either API in front of either engine --------------------------------------------------------------------------

def _check_done(final, *, most_tokens: int, streamed: bool) -> None:
    """The done object: counts from the engine's usage, durations measured (eval_duration only for a stream)."""
    assert final.done is True and final.done_reason in ("stop", "length")
    assert final.prompt_eval_count > 0 and 1 <= final.eval_count <= most_tokens
    assert final.total_duration > 0 and final.load_duration is None
    assert (final.eval_duration is not None) == streamed


def test_the_ollama_client_reaches_vllm_replicas_through_translation(deployment):
    """The official ollama client asks us (vLLM replicas only, for this model) through the Ollama API: chat and
    generate, streamed and not, and /api/embed are translated to the OpenAI API and answered in Ollama's shape
    (NDJSON, a done object with the counts and durations); a request with nothing to generate loads the model; one
    with an option the OpenAI API cannot express gets a 400 naming the API that serves the model."""
    cluster, _ = deployment
    seen: list = []
    client = ollama.Client(host=cluster.balancers["us"], timeout=30, event_hooks=_header_hook(seen))
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4})
    assert chat.message.role == "assistant" and chat.message.content
    _check_done(chat, most_tokens=4, streamed=False)
    assert seen[-1]["X-SkyLB-Served-By"] == "us/vllm-0" and seen[-1]["Content-Type"].startswith("application/json")
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "stream"}], stream=True,
                             options={"num_predict": 5, "temperature": 0.2}))
    assert seen[-1]["Content-Type"] == "application/x-ndjson"
    assert all(not p.done for p in parts[:-1]) and "".join(p.message.content for p in parts[:-1])
    _check_done(parts[-1], most_tokens=5, streamed=True)
    assert parts[-1].eval_count == len([p for p in parts[:-1] if p.message.content])
    generated = client.generate(model=MODEL, prompt="once upon a time", options={"num_predict": 3})
    assert generated.response and generated.done
    streamed = list(client.generate(model=MODEL, prompt="once upon a time", stream=True, options={"num_predict": 3}))
    assert "".join(p.response for p in streamed) and streamed[-1].done and streamed[-1].eval_count >= 1
    embedded = client.embed(model=MODEL, input=["one", "two"])
    assert len(embedded.embeddings) == 2 and embedded.embeddings[0] != embedded.embeddings[1]
    assert embedded.prompt_eval_count >= 2
    assert client.generate(model=MODEL, prompt="").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=MODEL, prompt="x", options={"mirostat": 2})
    assert refused.value.status_code == 400
    assert "OpenAI API" in refused.value.error and "mirostat" in refused.value.error


# ---- forwarding between a vLLM region and an Ollama region ---------------------------------------------------------

def test_forwarding_between_a_vllm_region_and_an_ollama_region_both_ways_with_both_apis(deployment):
    """us runs vLLM, eu runs Ollama. us forwards a request for eu's model to eu through the OpenAI API and the Ollama
    API; eu forwards a request for us's model to us through both too (the Ollama API translated at eu, since no
    Ollama replica serves it), streamed with the ollama client; each is answered by the other region's engine. The
    OpenAI API reaches eu's own Ollama replica too."""
    cluster, _ = deployment
    us, eu = cluster.balancers["us"], cluster.balancers["eu"]
    for entry, model, route, served_by in ((us, OLLAMA_MODEL, "peer:eu", "eu/ollama-0"),
                                           (eu, MODEL, "peer:us", "us/vllm-0")):
        client = openai.OpenAI(base_url=f"{entry}/v1", api_key="unused", max_retries=0, timeout=30)
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "across regions"}], max_tokens=3)
        assert (raw.headers["X-SkyLB-Route"], raw.headers["X-SkyLB-Served-By"]) == (route, served_by)
        assert raw.parse().choices[0].message.content
        seen: list = []
        native = ollama.Client(host=entry, timeout=30, event_hooks=_header_hook(seen))
        parts = list(native.chat(model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
                                 options={"num_predict": 3}))
        assert (seen[-1]["X-SkyLB-Route"], seen[-1]["X-SkyLB-Served-By"]) == (route, served_by)
        assert parts[-1].done and parts[-1].eval_count >= 1 and "".join(p.message.content for p in parts)
    # The OpenAI API in front of the Ollama engine in its own region: Ollama's /v1/*, streamed.
    with openai.OpenAI(base_url=f"{eu}/v1", api_key="unused", max_retries=0, timeout=30).chat.completions.\
            with_streaming_response.create(model=OLLAMA_MODEL, messages=[{"role": "user", "content": "local"}],
                                           max_tokens=3, stream=True) as raw:
        assert (raw.headers["X-SkyLB-Route"], raw.headers["X-SkyLB-Served-By"]) == ("local", "eu/ollama-0")
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)


# ---- a hash-ring session through a live balancer -------------------------------------------------------------------

def _placements(url: str, turn: int) -> dict[str, str]:
    """Each session's next request through ``url``: session -> the replica that served it. Requests are a few probe
    intervals apart, so the ring replica's room is seen again before the next one (back to back, SkyLB-CH would
    rightly take the next replica on the ring while a probe is late)."""
    placed = {}
    for session in SESSIONS:
        resp = requests.post(f"{url}/v1/chat/completions", timeout=30, headers={"X-Session-ID": session},
                             json={"model": CH_MODEL, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": f"{session} turn {turn}"}]})
        assert resp.status_code == 200, resp.text
        placed[session] = resp.headers["X-SkyLB-Served-By"].split("/", 1)[1]
        time.sleep(0.15)
    return placed


def test_a_hash_ring_session_stays_on_its_replica_and_moves_only_when_it_is_drained(deployment):
    """skylb-ch with three replicas: each session's requests go to one replica turn after turn; draining the
    replica of the first session moves that replica's sessions to others while every other session stays put;
    undrained, the ring gives them back."""
    cluster, _ = deployment
    url = cluster.balancers["ch"]
    first = _placements(url, 0)
    assert _placements(url, 1) == first
    drained = first[SESSIONS[0]]
    assert set(first.values()) != {drained}, "some session lives on another replica (the ring is deterministic)"
    cluster.ctl("replica", "drain", drained, "--wait-timeout", "20")  # returns once it holds nothing
    cluster.wait_until(lambda: all(r["draining"] for r in cluster.status("ch")["replicas"] if r["id"] == drained),
                       timeout_s=5, what=f"{drained} draining or gone at the balancer")
    moved = _placements(url, 2)
    for session, replica in first.items():
        if replica == drained:
            assert moved[session] != drained, session
        else:
            assert moved[session] == replica, session
    status, answer, _ = post_json(f"{cluster.controller_url}/v1/replicas/{drained}/undrain", {})
    assert status == 200, answer
    cluster.wait_until(lambda: _models_known(cluster, "ch", 3) and not any(
        r["draining"] for r in cluster.status("ch")["replicas"]), timeout_s=5, what=f"{drained} back")
    assert _placements(url, 3) == first
