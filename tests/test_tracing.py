"""Traces across regions (skylb/balancer/tracing.py, skylb/balancer/spans.py): a forwarded request is one trace with
spans from both balancers, exported over OTLP/HTTP to a receiver that decodes the protobuf (bench/launch/otlp_sink.py); the
client's W3C traceparent is honoured and reaches the replica; the TTFT histogram carries the trace as an exemplar;
tracing off loads no SDK."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import aiohttp
import openai
import pytest
from aiohttp import web

from bench.emulator.model import EngineParams
from bench.emulator.personalities import PersonalityOptions
from bench.emulator.server import serve
from bench.launch.otlp_sink import OtlpSink
from skylb.balancer.process import BALANCER, build_app
from skylb.balancer.tracing import TracingSettings, traces_endpoint
from skylb.config import BalancerConfig
from tests.cluster import MODEL, Cluster, post_json
from tests.procs import free_ports, wait_http

# Emulated durations x 0.2: a few tokens take tens of milliseconds.
FAST = ("--time-scale", "0.2")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
UNSAMPLED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def _metrics(url: str, accept: str | None = None, *, token: str | None = None) -> tuple[str, str]:
    """A balancer's /metrics: (its Content-Type, its text); ``token``: the peer token, when the balancer has one."""
    headers = {**({"Accept": accept} if accept else {}), **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def _one(spans, **where):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (where, [(s.name, s.kind, s.resource.get("skylb.region")) for s in spans])
    return found[0]


def _region_spans(spans, region: str):
    return [s for s in spans if s.resource.get("skylb.region") == region]


def _whole_trace(trace_id: str):
    """A predicate on the spans received: the spans of ``trace_id`` once both balancers' SERVER and relay spans are
    among them (those end last; the batch processor exports spans in the order they end), else None."""
    def whole(received):
        mine = [s for s in received if s.trace_id == trace_id]
        return mine if sum(s.kind in ("server", "client") for s in mine) == 4 else None
    return whole


def _check_balancer_spans(spans, region: str, parent_id: str, *, route: str, target: str, provider: str):
    """``region``'s spans of the trace: a SERVER span under ``parent_id`` and its queue, route and relay children.
    Returns (server span, relay span)."""
    mine = _region_spans(spans, region)
    server = _one(mine, kind="server")
    assert server.name == "POST /v1/chat/completions" and server.parent_span_id == parent_id
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == MODEL and server.attributes["skylb.route"] == route
    assert {s.parent_span_id for s in mine if s is not server} == {server.span_id}
    queue, routed = _one(mine, name="skylb.queue"), _one(mine, name="skylb.route")
    assert queue.attributes["skylb.queue.wait_s"] >= 0 and queue.end_ns <= routed.start_ns
    assert (routed.attributes["skylb.route"], routed.attributes["skylb.target"]) == (route, target)
    assert routed.attributes["skylb.rule"]  # the profile's plugin that chose the target
    relay = _one(mine, kind="client")
    assert relay.name == f"chat {MODEL}" and routed.end_ns <= relay.start_ns <= relay.end_ns <= server.end_ns
    assert relay.attributes["gen_ai.operation.name"] == "chat"
    assert relay.attributes["gen_ai.provider.name"] == provider
    assert relay.attributes["gen_ai.request.model"] == MODEL and relay.attributes["gen_ai.request.stream"] is True
    assert relay.attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert relay.status_code != 2, f"relay span in error: {relay.attributes.get('error.type')}; {relay.attributes}"
    return server, relay


def test_a_forwarded_request_is_one_trace_across_both_balancers(procs, tmp_path):
    """us has no replica, so it forwards to eu. The client's traceparent starts the trace: us's SERVER span is the
    client span's child, eu's SERVER span the child of us's relay span, and the replica receives eu's relay span as
    its parent, with the client's tracestate; both balancers' TTFT histograms point at the trace (exemplars). A
    traceparent whose sampled flag is 0 is honoured too: nothing recorded, the trace id still reaches the replica."""
    with OtlpSink() as sink:
        cluster = Cluster(procs, tmp_path)
        # The SDK's own variables: where to export (turns tracing on), and batches every 100 ms instead of 5 s.
        cluster.env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink.url, OTEL_BSP_SCHEDULE_DELAY="100")
        # Processes start together where they can (each takes seconds to import): the controller with the
        # replica, then both balancers while the replica is registered.
        controller = cluster.start_controller(["us", "eu"], wait=False)
        [replica] = cluster.start_emulator(1, *FAST, wait=False)
        wait_http(f"{controller}/healthz", timeout_s=30, proc=procs.procs[-2].popen)
        eu, us = (cluster.start_balancer(region, ["us", "eu"], wait=False) for region in ("eu", "us"))
        assert post_json(f"{controller}/v1/replicas", {"region": "eu", "url": replica, "id": "eu-0"})[0] == 201
        for proc, url in zip(procs.procs[-3:], (f"{replica}/health", f"{eu}/healthz", f"{us}/healthz")):
            wait_http(url, timeout_s=30, proc=proc.popen)
        cluster.wait_until(lambda: [p["available"] for p in cluster.status("us")["peers"]] == [True],
                           what="eu available to us")
        client = openai.OpenAI(base_url=f"{us}/v1", api_key="unused", max_retries=0)
        # First a trace the client does not record (flags 00): honoured, so no balancer records it either.
        for trace_id, flags in ((UNSAMPLED_TRACE_ID, "00"), (CLIENT_TRACE_ID, "01")):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-{flags}", "tracestate": "congo=t61"})
            assert raw.headers["X-SkyLB-Route"] == "peer:eu"
            assert [c for c in raw.parse() if c.usage is not None][0].usage.completion_tokens == 4

        spans = sink.wait_for(_whole_trace(CLIENT_TRACE_ID), what="both balancers' server and relay spans")
        assert {s.resource.get("skylb.region") for s in spans} == {"us", "eu"}
        assert {s.resource["service.name"] for s in spans} == {"skylb-balancer"}
        _, us_relay = _check_balancer_spans(spans, "us", CLIENT_SPAN_ID, route="peer", target="eu",
                                            provider="skylb")
        eu_server, eu_relay = _check_balancer_spans(spans, "eu", us_relay.span_id, route="local", target="eu-0",
                                                    provider="vllm")
        assert eu_server.attributes["skylb.forwarded_from"] == "us"
        assert us_relay.attributes["server.port"] == int(eu.rsplit(":", 1)[1])
        assert eu_relay.attributes["server.port"] == int(replica.rsplit(":", 1)[1])
        assert (eu_relay.attributes["gen_ai.usage.output_tokens"], eu_relay.attributes["gen_ai.usage.input_tokens"]) \
            == (4, us_relay.attributes["gen_ai.usage.input_tokens"])

        assert not [s for s in sink.spans() if s.trace_id == UNSAMPLED_TRACE_ID]

        emulator_log = next(p for p in procs.procs if p.name == "emulator").log()
        received = [json.loads(line) for line in emulator_log.splitlines() if '"trace_context"' in line]
        unsampled, sampled = [(r["traceparent"].split("-"), r["tracestate"]) for r in received]
        assert sampled == (["00", CLIENT_TRACE_ID, eu_relay.span_id, "01"], "congo=t61")
        assert unsampled[0][1] == UNSAMPLED_TRACE_ID and int(unsampled[0][3], 16) & 1 == 0

        for url, route, relay in ((us, "peer", us_relay), (eu, "local", eu_relay)):
            content_type, text = _metrics(url, "application/openmetrics-text; version=1.0.0",
                                          token=cluster.peer_token)
            assert content_type.startswith("application/openmetrics-text") and text.endswith("# EOF\n")
            exemplars = re.findall(r'^skylb_ttft_seconds_bucket\{[^}]*route="' + route + r'"[^}]*\} \S+ '
                                   r'# \{([^}]*)\}', text, re.M)
            assert f'span_id="{relay.span_id}",trace_id="{CLIENT_TRACE_ID}"' in exemplars
            assert UNSAMPLED_TRACE_ID not in text
        # A scraper that asks for nothing gets Prometheus text, no exemplar.
        content_type, text = _metrics(us, token=cluster.peer_token)
        assert content_type.startswith("text/plain") and CLIENT_TRACE_ID not in text
        assert sink.rejected == 0


async def _serve_replica(port: int, stop: asyncio.Event) -> asyncio.Task:
    """An emulated vLLM replica in this event loop (bench/emulator/server.py ``serve``) until ``stop`` is set."""
    task = asyncio.create_task(serve(engine="vllm", host="127.0.0.1", ports=[port], params=EngineParams(
        time_scale=0.05), options=PersonalityOptions(models=(MODEL,)), stop=stop))
    async with aiohttp.ClientSession() as session:
        for _ in range(600):  # bounded: 30 s (a loaded 2-core machine starts it late)
            if task.done():  # it failed to start (its port taken, ...): say why
                raise AssertionError(f"emulated replica on port {port} did not start: {task.exception()!r}")
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    if resp.status == 200:
                        return task
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"emulated replica on port {port} did not start")


async def test_a_retry_is_a_span_between_the_failed_attempt_and_the_next(tmp_path, monkeypatch):
    """Two replicas probed healthy, then one stops (probes are a minute apart, so the balancer still thinks it
    healthy): round robin sends at least one of two requests there first, the connection is refused, and the
    request is retried on the other. Its trace holds, under one SERVER span, attempt 0 (queue, route, a relay span
    that erred with 502), a ``skylb.retry`` span, then attempt 1 whose relay span has http.request.resend_count 1."""
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    ports = free_ports(3)
    stops = [asyncio.Event(), asyncio.Event()]
    replicas = [await _serve_replica(port, stop) for port, stop in zip(ports, stops)]
    (tmp_path / "membership-us.json").write_text(json.dumps({"replicas": [
        {"id": f"r{i}", "url": f"http://127.0.0.1:{port}", "region": "us", "engine": "vllm"}
        for i, port in enumerate(ports[:2])]}))
    with OtlpSink() as sink:
        cfg = BalancerConfig(state_dir=str(tmp_path), policy="round-robin", probe_interval_ms=60_000,
                             stale_after_intervals=100, tracing={"otlp_endpoint": sink.url})
        runner = web.AppRunner(build_app(cfg, region="us", advertise_url=f"http://127.0.0.1:{ports[2]}"))
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", ports[2]).start()
            balancer = runner.app[BALANCER]
            for _ in range(200):  # bounded: the start's probe round marks both healthy
                if all(r.healthy for r in balancer.router.replicas.values()):
                    break
                await asyncio.sleep(0.05)
            stops[0].set()
            await replicas[0]
            async with aiohttp.ClientSession() as session:
                for i in range(2):
                    async with session.post(f"http://127.0.0.1:{ports[2]}/v1/completions", json={
                            "model": MODEL, "prompt": f"retry {i}", "max_tokens": 2, "stream": True}) as resp:
                        assert resp.status == 200 and resp.headers["X-SkyLB-Served-By"] == "us/r1"
                        await resp.read()
            retry = await asyncio.to_thread(sink.wait_for, lambda got: [s for s in got if s.name == "skylb.retry"],
                                            what="a retry span")
        finally:
            await runner.cleanup()
            stops[1].set()
            await replicas[1]
    spans = sorted((s for s in sink.spans() if s.trace_id == retry[0].trace_id), key=lambda s: s.start_ns)
    server = _one(spans, kind="server")
    assert {s.parent_span_id for s in spans if s is not server} == {server.span_id}
    assert [(s.name, s.attributes.get("skylb.attempt")) for s in spans if s is not server] == [
        ("skylb.queue", 0), ("skylb.route", None), (f"text_completion {MODEL}", 0), ("skylb.retry", 1),
        ("skylb.queue", 1), ("skylb.route", None), (f"text_completion {MODEL}", 1)]
    failed, succeeded = [s for s in spans if s.kind == "client"]
    assert (failed.attributes["error.type"], failed.status_code, failed.attributes["skylb.target"]) == ("502", 2, "r0")
    assert retry[0].attributes["skylb.failed_target"] == "r0" and retry[0].attributes["skylb.retry.backoff_s"] >= 0
    assert (succeeded.attributes["skylb.target"], succeeded.attributes["http.request.resend_count"]) == ("r1", 1)
    assert "error.type" not in succeeded.attributes and server.attributes["http.response.status_code"] == 200


def test_tracing_is_off_by_default_and_loads_no_sdk(tmp_path):
    """A balancer started with no endpoint configured runs its chain untraced and never imports the tracing SDK,
    its exporter or the span module (a fresh interpreter; the retry test above turns it on through
    ``balancer.tracing.otlp_endpoint``)."""
    script = f"""
import asyncio, sys
from skylb.balancer.balancer import Balancer
from skylb.config import BalancerConfig

async def start():
    balancer = Balancer(BalancerConfig(state_dir={str(tmp_path)!r}), region="us", advertise_url="http://127.0.0.1:1")
    await balancer.start()
    await balancer.stop()
    return balancer

off = asyncio.run(start())
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter",
                                                        "skylb.balancer.spans")))
print("RESULT", off.tracing, type(off.chain).__name__, loaded)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    [result] = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert result == ["None", "Chain", "[]"]


@pytest.mark.parametrize(("configured", "environ", "expected"), [
    (None, {}, None),
    ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318/v1/traces", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318/"}, "http://env:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
     "http://t/x"),
    ("http://collector:4318", {"OTEL_SDK_DISABLED": "TRUE"}, None),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
])
def test_the_endpoint_comes_from_the_environment_then_the_config(configured, environ, expected):
    """The OpenTelemetry SDK's variables override balancer.tracing.otlp_endpoint (the traces path appended to a base
    URL, a traces URL taken as it is); OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn tracing off."""
    assert traces_endpoint(TracingSettings(otlp_endpoint=configured), environ) == expected


def test_an_endpoint_that_is_not_a_url_is_a_config_error():
    """balancer.tracing.otlp_endpoint must be an http(s) URL; a bare host:port is refused at load."""
    with pytest.raises(ValueError, match="otlp_endpoint must be an http"):
        TracingSettings(otlp_endpoint="collector:4318")
