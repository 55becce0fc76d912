"""Bad input, from clients, replicas and peers: always a clear error in the API's shape, counted and logged, never a
500 or a hang. Real balancer processes (tests/cluster.py) with emulated or deliberately misbehaving replicas, and
in-process property-based tests (hypothesis) of request parsing, SSE / NDJSON re-framing and msgpack decoding."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import http.client
import json
import socket
import threading
import time
import zlib

import msgpack
import openai
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skylb.balancer.api import BadRequest, parse_ollama, parse_openai
from skylb.balancer.framing import FramingError, StreamFramer
from skylb.balancer.protocol import ProtocolError, decode_status, encode_status
from skylb.config import BalancerConfig
from skylb.core import PeerStatus
from tests.cluster import MODEL, Cluster, post_json
from tests.procs import free_port

FAST = ("--time-scale", "0.1")
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
OLLAMA_PATHS = ("/api/generate", "/api/chat", "/api/embed")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on a balancer's /metrics whose labels include ``labels``."""
    text = requests.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _one_region(procs, tmp_path, *, balancer: dict | None = None, replicas: int = 1, emulator_args=()):
    cluster = Cluster(procs, tmp_path, balancer=balancer)
    cluster.start_controller(["us"])
    urls = cluster.start_emulator(replicas, *FAST, *emulator_args, name="emu-us") if replicas else []
    url = cluster.start_balancer("us", ["us"])
    for r in urls:
        cluster.add_replica("us", r)
    if urls:
        cluster.wait_until(lambda: all(r["models"] for r in cluster.status("us")["replicas"])
                           and len(cluster.status("us")["replicas"]) == len(urls), what="replica models")
    return cluster, url


# -- request ids ------------------------------------------------------------------------------------------------------
def test_requests_sharing_a_client_request_id_all_get_answers(procs, tmp_path):
    """20 concurrent requests with the same X-Request-Id all finish (the id is a label, not a key) and each gets
    its own X-SkyLB-Request-Id while the client's id is echoed back."""
    cluster, url = _one_region(procs, tmp_path, emulator_args=("--max-num-seqs", "2"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "same id"}], "max_tokens": 8}

    def call(i):
        r = requests.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "dup-1"}, timeout=30)
        return r.status_code, r.headers.get("X-Request-Id"), r.headers.get("X-SkyLB-Request-Id"), r.text[:300]

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(call, range(20)))
    if [a[0] for a in answers] != [200] * 20:  # say why (a rare 503 under a loaded CI: its reason is in the logs)
        logs = "".join(f"--- {path.name}\n" + "".join(line for line in path.read_text(errors="replace").splitlines(True)
                                                      if any(k in line for k in ("503", "membership", "health", "drain",
                                                                                 "eject", "stale", "error")))[-3000:]
                       for path in sorted((tmp_path / "logs").glob("*.log")))
        pytest.fail(f"not all 200: {[(a[0], a[3]) for a in answers if a[0] != 200]}\n{logs}")
    assert {a[1] for a in answers} == {"dup-1"}
    assert len({a[2] for a in answers}) == 20
    assert cluster.status("us")["queue_len"] == 0


# -- client input -----------------------------------------------------------------------------------------------------
_BAD_BODIES = [
    # (path, raw body, status, param or None)
    ("/v1/chat/completions", b"\xff\xfe{not utf8", 400, None),
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/chat/completions", b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e999}',
     400, None),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
     400, None),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": -5}).encode(), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": None}]}]}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": 7, "messages": []}).encode(), 400, "model"),
    # longer than any model id a replica may list: refused before it is echoed into an error or a log line
    ("/v1/chat/completions", json.dumps({"model": "m" * 100_000,
                                         "messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": True}).encode(), 400, "n"),
    ("/v1/embeddings", json.dumps({"model": MODEL, "input": None}).encode(), 400, "input"),
    ("/v1/embeddings", b"[]", 400, None),
    ("/v1/chat/completions", json.dumps({"model": "nobody-serves-this",
                                         "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
]


def test_malformed_client_requests_get_clean_errors_counted_and_logged(procs, tmp_path):
    """Invalid UTF-8, deep nesting, huge numbers, NaN, negative max_tokens, empty messages, a null text part, wrong
    types and an unknown model: 400 / 404 in OpenAI's shape (Ollama's on /api/*), counted by reason, logged; an
    Ollama request for a model served only through the OpenAI API gets a 404 that says so."""
    cluster, url = _one_region(procs, tmp_path)
    for path, raw, status, param in _BAD_BODIES:
        r = requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == status, (path, raw[:60], r.status_code, r.text[:200])
        assert r.headers["Content-Type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param and error["code"] == status
        assert r.headers["X-SkyLB-Request-Id"]
    for path in OLLAMA_PATHS:
        r = requests.post(url + path, data=b'{"model": "m", "prompt": 5, "input": 5, "messages": 5}', timeout=10)
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = requests.post(f"{url}/api/chat", json={"model": "m" * 100_000, "messages": []}, timeout=10)
    assert r.status_code == 400 and "100000 characters" in r.json()["error"] and len(r.text) < 1000
    assert max(map(len, (tmp_path / "logs" / "balancer-us.log").read_text().splitlines())) < 10_000
    r = requests.post(f"{url}/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                               "options": "fast"}, timeout=10)
    assert r.status_code == 400 and "options" in r.json()["error"]
    # aiohttp's own errors are in the API's shape too, and counted
    r = requests.post(f"{url}/api/show", data=b"[" * 100_000, timeout=5)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = requests.get(f"{url}/v1/chat/completions", timeout=5)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = requests.post(f"{url}/api/nothing-here", data=b"{}", timeout=5)
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    assert _metric(url, "skylb_rejected_requests_total", reason="invalid_json", status="400") == 6
    assert _metric(url, "skylb_rejected_requests_total", reason="unknown_model", status="404") == 1
    assert _metric(url, "skylb_rejected_requests_total", reason="method_not_allowed", status="405") == 1
    assert _metric(url, "skylb_responses_total", status="500") == 0
    log = (tmp_path / "logs" / "balancer-us.log").read_text()
    assert '"reason": "invalid_json"' in log or "reason=invalid_json" in log
    # An Ollama client asking for a model only OpenAI-dialect replicas serve, with what the OpenAI API cannot say:
    # the 400 names the API that serves the model (a translatable request is served: tests/test_engines_live.py).
    r = requests.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"},
                      timeout=10)
    assert r.status_code == 400 and "served here through the OpenAI API (/v1/chat/completions" in r.json()["error"]
    assert "'template'" in r.json()["error"]
    assert _metric(url, "skylb_rejected_requests_total", reason="untranslatable", status="400") == 1


def test_body_limit_gives_413_in_the_apis_shape(procs, tmp_path):
    """A body over balancer.max_body_bytes gets 413 in OpenAI's or Ollama's shape, counted as body_too_large."""
    cluster, url = _one_region(procs, tmp_path, balancer={"max_body_bytes": 2000}, replicas=0)
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, body, headers = post_json(f"{url}/v1/chat/completions", big)
    assert status == 413 and body["error"]["code"] == 413 and "max_body_bytes" in body["error"]["message"]
    status, body, _ = post_json(f"{url}/api/generate", {"model": "m", "prompt": "x" * 5000})
    assert status == 413 and isinstance(body["error"], str)
    assert _metric(url, "skylb_rejected_requests_total", reason="body_too_large", status="413") == 2


def test_a_model_whose_only_region_is_down_gets_503_with_retry_after(procs, tmp_path):
    """A model served only by a peer region that went down gets 503 + Retry-After (it may come back); a model
    nobody ever served still gets 404."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us", "eu"])
    [us_r] = cluster.start_emulator(1, *FAST, name="emu-us")
    [eu_r] = cluster.start_emulator(1, *FAST, "--model", "Qwen/Qwen2.5-7B-Instruct", name="emu-eu")
    us = cluster.start_balancer("us", ["us", "eu"])
    cluster.start_balancer("eu", ["us", "eu"])
    cluster.add_replica("us", us_r)
    cluster.add_replica("eu", eu_r)
    cluster.wait_until(lambda: any("Qwen/Qwen2.5-7B-Instruct" in (p["models"] or {}).get("openai", {})
                                   for p in cluster.status("us")["peers"]), what="eu's models at us")
    msg = [{"role": "user", "content": "hi"}]
    status, _, _ = post_json(f"{us}/v1/chat/completions", {"model": "Qwen/Qwen2.5-7B-Instruct", "messages": msg,
                                                           "max_tokens": 2})
    assert status == 200
    for p in procs.procs:
        if p.name in ("balancer-eu", "emu-eu"):
            p.kill()
    cluster.wait_until(lambda: not any(p["healthy"] for p in cluster.status("us")["peers"]), what="eu down")
    status, body, headers = post_json(f"{us}/v1/chat/completions", {"model": "Qwen/Qwen2.5-7B-Instruct",
                                                                    "messages": msg}, timeout=10)
    assert status == 503, body
    assert int(headers["Retry-After"]) >= 1 and body["error"]["code"] == 503
    status, body, _ = post_json(f"{us}/v1/chat/completions", {"model": "never/served", "messages": msg})
    assert status == 404


# -- replicas that misbehave ------------------------------------------------------------------------------------------
class MisbehavingReplica:
    """An OpenAI-compatible replica (probed as engine "openai") whose model name picks how it misbehaves:

    gzip-polite: gzips answers (whole and streamed) when the request accepts gzip, as servers behind compression
    middleware do; gzip-always: gzips whatever the request accepts; garbage: 200 with an HTML page; text-json: JSON
    under text/plain; truncated: an SSE stream cut before [DONE]; garbage-stream: SSE whose second event is not JSON;
    garbage-first: SSE whose first event is not JSON. Runs on its own event loop in a thread.
    """

    MODELS = ("gzip-polite", "gzip-always", "garbage", "text-json", "truncated", "garbage-stream", "garbage-first")

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.accept_encodings: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/skylb/v1/status", self._status)
        self._runner = runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.MODELS]})

    async def _status(self, request):  # as a peer balancer: a status that is not msgpack of our protocol
        return web.Response(body=b"\xc1\xff garbage", content_type="application/msgpack")

    async def _chat(self, request):
        body = await request.json()
        model, stream = body["model"], body.get("stream", False)
        accepted = request.headers.get("Accept-Encoding", "")
        self.accept_encodings.append(accepted)
        compress = model == "gzip-always" or (model == "gzip-polite" and "gzip" in accepted)
        chunk = {"id": "c1", "object": "chat.completion.chunk", "model": model,
                 "choices": [{"index": 0, "delta": {"content": "héllo"}, "finish_reason": None}]}
        whole = {"id": "c1", "object": "chat.completion", "model": model, "created": 0,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "héllo wörld"},
                              "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
        if model == "garbage":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if model == "text-json":
            return web.Response(text=json.dumps(whole), content_type="text/plain")
        if not stream:
            data = json.dumps(whole).encode()
            headers = {"Content-Type": "application/json"}
            if compress:
                data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
            return web.Response(body=data, headers=headers)
        events = [b"data: " + json.dumps(chunk).encode() + b"\n\n"] * 3
        if model == "garbage-first":
            events[0] = b"data: {{{not json\n\n"
        if model == "garbage-stream":
            events[1] = b"data: <html>oops</html>\n\n"
        if model != "truncated":
            events.append(b"data: [DONE]\n\n")
        headers = {"Content-Type": "text/event-stream"}
        if compress:
            headers["Content-Encoding"] = "gzip"
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        encoder = zlib.compressobj(wbits=31) if compress else None
        for i, event in enumerate(events):
            if model == "truncated" and i == len(events) - 1:
                event = event[: len(event) // 2]  # cut inside the last event
            await response.write(encoder.compress(event) + encoder.flush(zlib.Z_SYNC_FLUSH) if encoder else event)
            await asyncio.sleep(0.01)
        if encoder:
            await response.write(encoder.flush())
        await response.write_eof()
        return response


@pytest.fixture
def misbehaving(procs, tmp_path):
    """A one-region cluster whose only replica is a MisbehavingReplica; yields (cluster, balancer url, replica)."""
    with MisbehavingReplica() as replica:
        cluster = Cluster(procs, tmp_path, balancer={"retry_policy": {"num_retries": 0},
                                                     "outlier_detection": {"consecutive_gateway_failure": 1,
                                                                           "base_ejection_time_s": 0.001}})
        cluster.start_controller(["us"])
        url = cluster.start_balancer("us", ["us"])
        cluster.add_replica("us", replica.url, engine="openai")
        cluster.wait_until(lambda: cluster.status("us")["replicas"]
                           and cluster.status("us")["replicas"][0]["models"], what="replica models")
        yield cluster, url, replica


def test_compressed_upstream_answers_reach_clients_intact(misbehaving):
    """A replica that gzips (when asked, or always) still gives the official openai client a correct answer, whole
    and streamed: the balancer asks replicas for identity and decodes a compressed answer anyway."""
    cluster, url, replica = misbehaving
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=10)
    msg = [{"role": "user", "content": "hi"}]
    for model in ("gzip-polite", "gzip-always"):
        answer = client.chat.completions.create(model=model, messages=msg)
        assert answer.choices[0].message.content == "héllo wörld"
        parts = [c.choices[0].delta.content for c in client.chat.completions.create(model=model, messages=msg,
                                                                                     stream=True)]
        assert "".join(parts) == "héllo" * 3
    assert replica.accept_encodings and all(a == "identity" for a in replica.accept_encodings)


def test_replica_garbage_and_truncated_streams_give_502_or_an_error_event(misbehaving):
    """Garbage from a replica (HTML under 200, a first SSE event that is not JSON) gives 502 in OpenAI's shape; a
    stream cut or garbled after its first event ends with a well-formed error event; JSON under a wrong content type
    passes as application/json; every failure counts against the replica (outlier detection)."""
    cluster, url, replica = misbehaving
    msg = [{"role": "user", "content": "hi"}]
    for model in ("garbage", "garbage-first"):
        r = requests.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msg,
                                                              "stream": model == "garbage-first"}, timeout=10)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == 502 and "JSON" in r.json()["error"]["message"]
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "text-json", "messages": msg}, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["choices"][0]["message"]["content"] == "héllo wörld"
    for model, good_events in (("truncated", 2), ("garbage-stream", 1)):
        r = requests.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msg, "stream": True},
                          timeout=10)
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events), events  # whole events only: nothing spliced
        payloads = [e[len(b"data: "):] for e in events]
        assert payloads[-1] == b"[DONE]"
        assert [json.loads(p)["object"] for p in payloads[:good_events]] == ["chat.completion.chunk"] * good_events
        assert json.loads(payloads[good_events])["error"]["code"] == 502
    # 2 garbage answers, 2 broken streams: each a gateway failure of the replica, ejected at each (threshold 1)
    assert _metric(url, "skylb_outlier_ejections_total", target=cluster.status("us")["replicas"][0]["id"]) == 4


# -- the catch-all ----------------------------------------------------------------------------------------------------
async def test_an_unexpected_bug_is_a_500_in_the_apis_shape_counted_and_logged(tmp_path):
    """Any exception a handler did not expect becomes a 500 in OpenAI's or Ollama's shape, counted as
    internal_error, instead of aiohttp's 500 text/plain."""
    from skylb.balancer.process import build_app

    cfg = BalancerConfig(controller_url="http://127.0.0.1:1", state_dir=str(tmp_path / "state"))
    app = build_app(cfg, region="us", advertise_url="http://127.0.0.1:1")

    async def boom(request):
        raise KeyError("a bug")

    app.router.add_post("/v1/boom", boom)
    app.router.add_post("/api/boom", boom)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/v1/boom", data=b"{}")
        assert r.status == 500 and (await r.json())["error"]["type"] == "server_error"
        r = await client.post("/api/boom", data=b"{}")
        assert r.status == 500 and isinstance((await r.json())["error"], str)
        metrics = await (await client.get("/metrics")).text()
        assert 'skylb_rejected_requests_total{reason="internal_error",region="us",status="500"} 2.0' in metrics


# -- fuzzing the request parsers --------------------------------------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
_content = st.one_of(st.text(max_size=10), st.none(), _json_values,
                     st.lists(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url"]) |
                                                                  _json_values, "text": _json_values}), max_size=3))
_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system"]) | _json_values,
                                               "content": _content})
_request = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["m", ""]) | _json_values,
    "messages": st.lists(_message, max_size=3) | _json_values,
    "prompt": st.text(max_size=10) | st.lists(st.integers(-3, 10), max_size=3) | _json_values,
    "input": st.text(max_size=10) | st.lists(st.text(max_size=5), max_size=3) | _json_values,
    "system": st.text(max_size=5) | _json_values,
    "stream": st.booleans() | _json_values,
    "max_tokens": st.integers(-2, 5) | _json_values,
    "n": _json_values, "user": _json_values, "prompt_cache_key": _json_values, "options": _json_values,
})


@FUZZ
@given(path=st.sampled_from(OPENAI_PATHS + OLLAMA_PATHS + ("/api/embeddings",)), data=_request,
       session=st.none() | st.text(max_size=10))
def test_fuzz_request_shapes_parse_or_raise_bad_request(path, data, session):
    """Any JSON shape on any endpoint parses or raises BadRequest (never another exception)."""
    parse = parse_ollama if path.startswith("/api/") else parse_openai
    try:
        parsed = parse(path, json.dumps(data).encode(), session_header_value=session)
    except BadRequest as exc:
        assert str(exc) and exc.reason in ("invalid_json", "invalid_field")
        return
    assert isinstance(parsed.model, str) and parsed.model and isinstance(parsed.text, str)
    assert isinstance(parsed.stream, bool) and (parsed.session_key is None or isinstance(parsed.session_key, str))


@FUZZ
@given(path=st.sampled_from(OPENAI_PATHS + OLLAMA_PATHS), raw=st.binary(max_size=200))
def test_fuzz_raw_bytes_parse_or_raise_bad_request(path, raw):
    """Arbitrary bytes as a body raise BadRequest (or, rarely, parse), never another exception."""
    parse = parse_ollama if path.startswith("/api/") else parse_openai
    try:
        parse(path, raw, session_header_value=None)
    except BadRequest:
        pass


async def test_fuzz_requests_through_the_balancer_app_never_give_500(tmp_path):
    """Fuzzed bodies and X-Request-Id headers through the whole balancer app (no replicas: every valid request is
    a 404) get 400 / 404 in the API's shape, never a 500."""
    from hypothesis import strategies as hs
    from skylb.balancer.process import build_app

    cfg = BalancerConfig(controller_url="http://127.0.0.1:1", state_dir=str(tmp_path / "state"))
    app = build_app(cfg, region="us", advertise_url="http://127.0.0.1:1")
    examples = hs.tuples(hs.sampled_from(OPENAI_PATHS + OLLAMA_PATHS), _request,
                         hs.text(alphabet=hs.characters(min_codepoint=32, max_codepoint=126), max_size=200))
    async with TestClient(TestServer(app)) as client:
        seen = []

        @settings(max_examples=100, deadline=None, database=None)
        @given(examples)
        def collect(example):
            seen.append(example)

        collect()
        for path, data, request_id in seen:
            r = await client.post(path, data=json.dumps(data).encode(), headers={"X-Request-Id": request_id})
            assert r.status in (400, 404), (path, data, r.status, await r.text())
            error = (await r.json())["error"]
            assert isinstance(error, str) if path.startswith("/api/") else set(error) == {"message", "type",
                                                                                            "param", "code"}


# -- fuzzing SSE / NDJSON re-framing ----------------------------------------------------------------------------------
_event_json = st.dictionaries(st.text(max_size=5), st.text(max_size=10) | st.integers(), max_size=3)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@FUZZ
@given(events=st.lists(_event_json.filter(lambda e: "error" not in e), max_size=6), done=st.booleans(),
       comments=st.booleans(), crlf=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_fuzz_sse_reframing_keeps_bytes_and_finds_the_end(events, done, comments, crlf, cuts):
    """However an SSE stream is cut into chunks, the framer passes the same bytes on in whole events, and says the
    stream ended properly exactly when [DONE] went by."""
    nl = b"\r\n" if crlf else b"\n"
    parts = [(b": keep-alive" + nl + nl) if comments else b""]
    parts += [b"data: " + json.dumps(e).encode() + nl + nl for e in events]
    if done:
        parts.append(b"data: [DONE]" + nl + nl)
    stream = b"".join(parts)
    framer = StreamFramer("sse")
    out = [framer.feed(chunk) for chunk in _split(stream, cuts)]
    out.append(framer.finish())
    assert b"".join(out) == stream
    assert framer.done == done
    for piece in out:  # every piece handed on ends at an event boundary
        assert not piece or piece.endswith(nl + nl)


@FUZZ
@given(events=st.lists(_event_json.filter(lambda e: "done" not in e and "error" not in e), max_size=6),
       done=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_fuzz_ndjson_reframing_keeps_bytes_and_finds_the_end(events, done, cuts):
    """NDJSON cut anywhere is passed on line by line unchanged; done exactly when a "done": true object went by."""
    lines = [json.dumps(e).encode() + b"\n" for e in events]
    if done:
        lines.append(b'{"done": true}\n')
    stream = b"".join(lines)
    framer = StreamFramer("ndjson")
    out = [framer.feed(chunk) for chunk in _split(stream, cuts)]
    out.append(framer.finish())
    assert b"".join(out) == stream and framer.done == done


@FUZZ
@given(kind=st.sampled_from(["sse", "ndjson"]), chunks=st.lists(st.binary(max_size=40), max_size=6))
def test_fuzz_arbitrary_bytes_give_events_or_a_framing_error(kind, chunks):
    """Arbitrary upstream bytes give whole events or FramingError, never another exception."""
    framer = StreamFramer(kind, max_event_bytes=64)
    try:
        for chunk in chunks:
            framer.feed(chunk)
        framer.finish()
    except FramingError:
        pass


# -- fuzzing the peer status decoder ----------------------------------------------------------------------------------
_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
_status_maps = st.fixed_dictionaries(
    {"v": st.just(1) | _msgpack_values},
    optional={"region": st.text(max_size=5) | _msgpack_values,
              "available_replicas": st.integers(-2, 5) | _msgpack_values,
              "replicas": st.integers(-2, 5) | _msgpack_values, "queue_len": st.integers(-2, 5) | _msgpack_values,
              "models": st.dictionaries(st.sampled_from(["openai", "ollama"]),
                                        st.dictionaries(st.text(max_size=5), st.integers(-1, 3), max_size=2),
                                        max_size=2) | _msgpack_values,
              "wait_ms": st.floats() | _msgpack_values})


@FUZZ
@given(raw=_status_maps | _msgpack_values)
def test_fuzz_msgpack_status_decodes_or_raises_protocol_error(raw):
    """Any msgpack value as a peer status decodes to a PeerStatus or raises ProtocolError, never another error."""
    try:
        status = decode_status(msgpack.packb(raw, use_bin_type=True))
    except ProtocolError:
        return
    assert isinstance(status, PeerStatus) and status.available_replicas >= 0 and status.queue_len >= 0


@FUZZ
@given(region=st.text(min_size=1, max_size=8), counts=st.tuples(*[st.integers(0, 1000)] * 3),
       flip=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_fuzz_msgpack_status_round_trips_and_survives_corruption(region, counts, flip, byte):
    """A status round-trips; the same bytes with one byte changed decode or raise ProtocolError."""
    status = PeerStatus(region=region, available_replicas=counts[0], replicas=counts[1], queue_len=counts[2])
    data = encode_status(status)
    assert decode_status(data) == status
    pos = flip % len(data)
    try:
        decode_status(data[:pos] + bytes([byte]) + data[pos + 1:])
    except ProtocolError:
        pass


def test_a_balancer_answering_garbage_status_is_an_unhealthy_peer(procs, tmp_path):
    """A "peer" whose status endpoint answers garbage is marked unhealthy with a reason; the balancer keeps
    serving its own replicas."""
    with MisbehavingReplica() as fake:
        cluster = Cluster(procs, tmp_path)
        cluster.start_controller(["us", "eu"])
        [us_r] = cluster.start_emulator(1, *FAST, name="emu-us")
        us = cluster.start_balancer("us", ["us", "eu"], peer_urls={"eu": fake.url})
        cluster.add_replica("us", us_r)
        cluster.start_balancer("eu", ["us", "eu"])  # registers eu; us reaches "eu" at the fake's URL
        cluster.wait_until(lambda: cluster.status("us")["peers"] and cluster.status("us")["peers"][0]["reason"],
                           what="eu probed")
        assert cluster.status("us")["peers"][0]["healthy"] is False
        cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="us models")
        status, body, _ = post_json(f"{us}/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "x"}]})
        assert status == 200, body


# -- malformed credentials and the log ----------------------------------------------------------------------------
PEER_TOKEN = "bad-input-peer-token-0123456789abcdef"


def _keyed_balancer(procs, tmp_path):
    """A static balancer with a peer token and one client API key in front of one emulated replica; returns
    (cluster, its URL, its Proc)."""
    cluster = Cluster(procs, tmp_path, balancer={"api_keys": ["client-key-0123456789"]}, peer_token=PEER_TOKEN)
    [replica] = cluster.start_emulator(1, *FAST, name="emu")
    proc = cluster.start_static_balancer([replica], engine="vllm")
    return cluster, cluster.balancers["local"], proc


def _raw_request(url: str, method: str, path: str, headers: list[tuple[str, bytes]], body: bytes = b"", *,
                 source: str | None = None):
    """Send one request whose header values are raw bytes (any bytes), from the loopback address ``source`` when
    given; (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0) if source else None)
    try:
        conn.putrequest(method, path)
        for name, value in headers:
            conn.putheader(name, value)
        if body:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_malformed_credentials_are_401_or_403_in_the_apis_shape_never_500(procs, tmp_path):
    """Invalid UTF-8 in Authorization or X-SkyLB-Token, from any client, and status-page session cookies whose
    expiry is not ASCII digits (Arabic-Indic, superscript) or whose bytes are not UTF-8: 401 / 403 in the API's
    own shape (OpenAI's, Ollama's on /api/*), never a 500."""
    _, url, _ = _keyed_balancer(procs, tmp_path)
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    ollama = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    cookie = "skylb_peer_session="
    cases = [
        ("POST", "/v1/chat/completions", [("Authorization", b"Bearer \xff\xfe\xc3(")], chat, 401, "openai"),
        ("POST", "/api/chat", [("Authorization", b"Bearer \xff\xfe")], ollama, 401, "ollama"),
        ("POST", "/v1/chat/completions", [("X-SkyLB-Token", b"\xff\xfe")], chat, 401, "openai"),
        ("POST", "/api/chat", [("X-SkyLB-Token", b"\xc3(")], ollama, 401, "ollama"),
        ("GET", "/skylb/v1/status?format=json", [("X-SkyLB-Token", b"\xff" * 40)], b"", 403, "openai"),
        ("GET", "/metrics", [("Authorization", b"Bearer \xed\xa0\x80")], b"", 403, "openai"),
        ("GET", "/skylb/v1/status?format=json", [("Cookie", (cookie + "١٧٩٩٩٩٩٩٩٩.abc").encode())], b"", 403,
         "openai"),
        ("GET", "/skylb/v1/status?format=json", [("Cookie", (cookie + "²²²²²²²²²².abc").encode())], b"", 403,
         "openai"),
        ("GET", "/skylb/v1/status?format=json", [("Cookie", cookie.encode() + b"1799999999.\xff\xfe")], b"", 403,
         "openai"),
    ]
    # Each case from its own address: more than 5 wrong credentials from one would be throttled (429).
    for i, (method, path, headers, body, status, api) in enumerate(cases):
        got, answer_headers, answer = _raw_request(url, method, path, headers, body, source=f"127.0.2.{i + 1}")
        assert got == status, (path, headers, got, answer[:300])
        error = json.loads(answer)["error"]
        assert isinstance(error, str) if api == "ollama" else isinstance(error["message"], str), (path, answer)
    # The status page itself: a tampered cookie is no session (the login form), not a 500.
    got, _, _ = _raw_request(url, "GET", "/", [("Accept", b"text/html"),
                                               ("Cookie", (cookie + "²²²²²²²²²².abc").encode())])
    assert got < 500


_MALFORMED_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad Name: 1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-\xff: \xfe\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3(\r\n\r\n",
]


def test_every_line_the_balancer_logs_is_one_json_object_whatever_clients_send(procs, tmp_path):
    """Malformed requests (bad request lines, bad headers, invalid UTF-8, bad lengths and chunks) are logged as the
    client's errors (``client_error``, at info: skylb/listener.py), aiohttp's own lines going through the standard
    library's logging; every line the balancer writes is still one JSON object (aiohttp's included, with logger and
    level)."""
    _, url, proc = _keyed_balancer(procs, tmp_path)
    host, port = url.removeprefix("http://").split(":")
    for raw in _MALFORMED_REQUESTS:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
    assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
    deadline = time.monotonic() + 5
    while proc.log().count('"client_error"') < len(_MALFORMED_REQUESTS) - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [json.loads(line) for line in proc.log().splitlines()]
    assert all(isinstance(line, dict) for line in lines)
    client_errors = [line for line in lines if line["event"] == "client_error"]
    # Two heads are whole (a chunked body cut short, a key that is not UTF-8): handlers get them, the rest is aiohttp's.
    assert len(client_errors) >= len(_MALFORMED_REQUESTS) - 2, client_errors
    assert all(line["level"] == "info" and line["status"] == 400 for line in client_errors)
    assert "a" * 20 not in proc.log()  # the over-long header line's bytes (it could have been a credential)
    assert all(line["level"] in ("error", "warning", "info") and line["event"]
               for line in lines if line.get("logger") == "aiohttp.server")


class _BadIdsReplica(MisbehavingReplica):
    """A MisbehavingReplica that lists model ids no client should see: with CR/LF (a header split in two), with a
    control character, empty, not a string, and one far too long; ``text-json`` stays a model it answers."""

    MODELS = ("text-json", "evil\r\nX-Injected: 1", "tab\there", "", 7, "x" * 1000)


def test_model_ids_a_replica_lists_are_validated_before_they_reach_a_client(procs, tmp_path):
    """A replica listing a model id with CR/LF (or a control character, empty, not a string, too long): the id is
    skipped with a warning naming the replica, so a request for it is a clean 404 in the API's shape instead of a
    dropped connection logged as 200; the replica's valid model still answers, with its headers intact."""
    with _BadIdsReplica() as replica:
        cluster = Cluster(procs, tmp_path)
        balancer = cluster.start_static_balancer([replica.url], engine="openai")
        url = cluster.balancers["local"]
        msg = [{"role": "user", "content": "hi"}]
        status, body, headers = post_json(f"{url}/v1/chat/completions", {"model": "evil\r\nX-Injected: 1",
                                                                         "messages": msg})
        assert status == 404 and "X-Injected" not in headers, (status, body, headers)
        assert body["error"]["param"] == "model"
        status, body, headers = post_json(f"{url}/v1/chat/completions", {"model": "text-json", "messages": msg})
        assert status == 200 and headers["X-SkyLB-Model"] == "text-json"
        listed = {m["id"] for m in requests.get(f"{url}/v1/models", timeout=5).json()["data"]}
        assert listed == {"text-json"}
    skipped = [json.loads(line) for line in balancer.log().splitlines() if "replica_model_ids_skipped" in line]
    assert skipped and skipped[0]["level"] == "warning" and skipped[0]["skipped"] == 5
