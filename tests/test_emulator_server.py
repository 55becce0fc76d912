"""The emulator as a real process (`python -m skylb emulator`): vLLM's HTTP API, streaming, metrics, errors."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import openai
import pytest

from tests.procs import ProcGroup, free_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: 0.02: a decode step is about 1.1 ms, a 512-token prefill 6 ms.
TIME_SCALE = "0.02"
MAX_NUM_SEQS = 2
TIMEOUT = aiohttp.ClientTimeout(total=15)

# One xdist worker runs the whole module (--dist loadgroup): it shares one emulator process (module fixture emulator),
# started once, not once per worker.
pytestmark = [pytest.mark.timeout(30), pytest.mark.xdist_group("emulator_server")]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """One emulator process with two replicas (ports), 2 running slots each; shared by this module's tests."""
    ports = free_ports(2)
    group = ProcGroup(tmp_path_factory.mktemp("emulator-logs"))
    try:
        group.skylb("emulator", "--port", str(ports[0]), "--port", str(ports[1]), "--time-scale", TIME_SCALE,
                    "--max-num-seqs", str(MAX_NUM_SEQS), name="emu",
                    wait_url=f"http://127.0.0.1:{ports[1]}/health")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        group.stop_all()


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` plus ``{"name": value}`` summed over labels, from Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = float(value)
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value) if name != series else float(value)
    return out


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """One scrape of ``base``/metrics, parsed."""
    async with session.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        return parse_metrics(await resp.text())


async def stream_lines(resp: aiohttp.ClientResponse, limit: int = 10_000):
    """Yield the ``data:`` payloads of an SSE response (bounded)."""
    for _ in range(limit):
        line = await resp.content.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data: "):
            yield line[len(b"data: "):].decode()


def long_request(tag: str, max_tokens: int = 150) -> dict:
    """A streaming completion body that runs about max_tokens x 1.1 ms."""
    return {"model": MODEL, "prompt": f"{tag} " * 20, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


async def run_streaming(session: aiohttp.ClientSession, url: str, body: dict) -> list[str]:
    """POST a streaming request and return its data payloads."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return [data async for data in stream_lines(resp)]


async def test_health_models_and_version(emulator):
    """/health is 200 with an empty body; /v1/models lists the served model; /version answers JSON."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{emulator[0]}/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with session.get(f"{emulator[0]}/v1/models") as resp:
            body = await resp.json()
            assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
        async with session.get(f"{emulator[0]}/version") as resp:
            assert "version" in await resp.json()


async def test_waiting_appears_when_more_requests_than_slots_and_clears_after(emulator):
    """With more concurrent requests than --max-num-seqs, /metrics shows num_requests_waiting > 0, then 0."""
    url = f"{emulator[0]}/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        tasks = [asyncio.create_task(run_streaming(session, url, long_request(f"wait{i}"))) for i in range(6)]
        seen = {"waiting": 0.0, "running": 0.0}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(t.done() for t in tasks):
            m = await metrics(session, emulator[0])
            seen["waiting"] = max(seen["waiting"], m["vllm:num_requests_waiting"])
            seen["running"] = max(seen["running"], m["vllm:num_requests_running"])
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*tasks)
        assert all(r[-1] == "[DONE]" for r in results)
        assert seen["waiting"] > 0 and seen["running"] == MAX_NUM_SEQS
        m = await metrics(session, emulator[0])
        assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0


async def test_metrics_have_vllm_names_and_labels(emulator):
    """/metrics exposes vLLM's gauges and _total counters with labels model_name and engine="0"."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{emulator[1]}/metrics") as resp:
            text = await resp.text()
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for series in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f"\n{series}{labels} " in text, series
    assert "# TYPE vllm:num_requests_waiting gauge" in text


async def test_chat_stream_arrives_incrementally_with_usage_and_done(emulator):
    """Chat chunks arrive one token at a time over the request's lifetime, then usage (choices: []) and [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream please " * 10}], "max_tokens": 100,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    payloads: list[str] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(f"{emulator[0]}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            async for data in stream_lines(resp):
                arrivals.append(time.monotonic())
                payloads.append(data)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 100
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert len(text.split()) == 100
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 100 and usage["usage"]["prompt_tokens"] == 21
    assert usage["usage"]["total_tokens"] == 121 and "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    # 100 decode steps of ~1.1 ms: the chunks spread over time instead of arriving in one burst.
    assert arrivals[-2] - arrivals[1] > 0.05


async def test_completion_stream_without_usage(emulator):
    """Completion chunks are text_completion objects; without include_usage no usage chunk is sent."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        payloads = await run_streaming(session, f"{emulator[0]}/v1/completions", long_request("nousage", 5))
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and len(chunks) == 5
    assert all(c["object"] == "text_completion" and c["choices"] and "usage" not in c for c in chunks)


async def test_repeated_prompt_reports_cached_tokens(emulator):
    """The second identical prompt reports prompt_tokens_details.cached_tokens in full 16-token blocks."""
    body = {"model": MODEL, "prompt": " ".join(f"cache{i}" for i in range(100)), "max_tokens": 3,
            "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await metrics(session, emulator[1])
        usages = []
        for _ in range(2):
            async with session.post(f"{emulator[1]}/v1/completions", json=body) as resp:
                assert resp.status == 200
                usages.append((await resp.json())["usage"])
        after = await metrics(session, emulator[1])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 96]
    assert usages[1]["prompt_tokens"] == 100 and usages[1]["completion_tokens"] == 3
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 96
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 200


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/completions", b"{not json", 400, "Invalid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "role"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n=2"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream=True"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi " * 100, "max_tokens": 32700}, 400, "maximum context length"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "The model `no-such-model` does not exist."),
])
async def test_bad_requests_get_vllm_error_shapes(emulator, path, body, status, needle):
    """Bad input gets vLLM's nested error with code = HTTP status (400 or 404), never a 500."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        async with session.post(f"{emulator[0]}{path}", **kwargs) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and needle in error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_two_ports_are_independent_replicas(emulator):
    """Load on one port's replica shows in its metrics only; the other port keeps serving at once."""
    first, second = emulator
    url = f"{first}/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        tasks = [asyncio.create_task(run_streaming(session, url, long_request(f"indep{i}", 300)))
                 for i in range(MAX_NUM_SEQS + 1)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            m1 = await metrics(session, first)
            if m1["vllm:num_requests_waiting"] > 0:
                break
            await asyncio.sleep(0.01)
        assert m1["vllm:num_requests_waiting"] == 1 and m1["vllm:num_requests_running"] == MAX_NUM_SEQS
        m2 = await metrics(session, second)
        assert m2["vllm:num_requests_waiting"] == 0 and m2["vllm:num_requests_running"] == 0
        async with session.post(f"{second}/v1/completions",
                                json={"prompt": "quick one", "max_tokens": 2, "ignore_eos": True}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 2
        await asyncio.gather(*tasks)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_request(emulator, stream):
    """A client that drops its connection mid-request cancels it in the engine: its slot frees at once."""
    base = emulator[1]
    body = {**long_request("bye", 5000), "stream": stream}  # ~5.5 s of decoding
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await metrics(session, base)
        if stream:
            resp = await session.post(f"{base}/v1/completions", json=body)
            await resp.content.readline()
            running = (await metrics(session, base))["vllm:num_requests_running"]
            resp.close()  # drops the connection
        else:
            request = asyncio.create_task(session.post(f"{base}/v1/completions", json=body))
            await asyncio.sleep(0.3)
            running = (await metrics(session, base))["vllm:num_requests_running"]
            request.cancel()  # aiohttp closes the connection of a cancelled request
            await asyncio.gather(request, return_exceptions=True)
        assert running == 1
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            m = await metrics(session, base)
            if m["vllm:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.02)
    assert m["vllm:num_requests_running"] == 0
    abort = f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}'
    assert m[abort] == before[abort] + 1


async def test_openai_client_chat_and_completions(emulator):
    """The official openai client works for chat and completions, streamed and not, with ignore_eos."""
    client = openai.AsyncOpenAI(base_url=f"{emulator[1]}/v1", api_key="unused", timeout=10, max_retries=0)
    extra = {"ignore_eos": True}
    try:
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=7, extra_body=extra)
        assert chat.choices[0].message.role == "assistant"
        assert len(chat.choices[0].message.content.split()) == 7 and chat.usage.completion_tokens == 7
        assert chat.usage.prompt_tokens == 2 and chat.usage.prompt_tokens_details.cached_tokens == 0

        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert len("".join(pieces).split()) == 6 and usage.completion_tokens == 6

        completion = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=4,
                                                     extra_body=extra)
        assert len(completion.choices[0].text.split()) == 4 and completion.choices[0].finish_reason == "length"
        assert completion.usage.total_tokens == 7

        stream = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=5, stream=True,
                                                 extra_body=extra)
        texts = [chunk.choices[0].text async for chunk in stream]
        assert len("".join(texts).split()) == 5

        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=1)
    finally:
        await client.close()


async def test_kv_exhaustion_preempts_and_metrics_count_it(procs):
    """With a tiny KV cache, two long requests cannot both grow: one is preempted and recomputed, both still stream
    every token once, and /metrics counts it in vllm:num_preemptions_total (a counter)."""
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    # 16 blocks of 16 tokens: each request's 100-token prompt fits (7 blocks), but not two at 179 tokens (12 each).
    procs.skylb("emulator", "--port", str(port), "--time-scale", TIME_SCALE, "--kv-cache-tokens", "256",
                name="emu-preempt", wait_url=f"{base}/health")
    bodies = [{"model": MODEL, "prompt": " ".join(f"{tag}{i}" for i in range(100)), "max_tokens": 80,
               "ignore_eos": True, "stream": True} for tag in ("p", "q")]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        results = await asyncio.gather(*(run_streaming(session, f"{base}/v1/completions", b) for b in bodies))
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
    for lines in results:
        assert lines[-1] == "[DONE]"
        assert len("".join(json.loads(d)["choices"][0]["text"] for d in lines[:-1]).split()) == 80
    assert "# TYPE vllm:num_preemptions_total counter" in text
    m = parse_metrics(text)
    assert m[f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}}'] >= 1
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_sigterm_stops_the_emulator_cleanly(procs):
    """SIGTERM makes the process stop its replicas and exit with status 0."""
    (port,) = free_ports(1)
    proc = procs.skylb("emulator", "--port", str(port), "--time-scale", TIME_SCALE, name="emu-term",
                       wait_url=f"http://127.0.0.1:{port}/health")
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0
    assert "emulator_stopped" in proc.log()


def test_bad_flags_exit_with_status_2(procs):
    """Inconsistent flags are refused before anything listens."""
    (port,) = free_ports(1)
    proc = procs.skylb("emulator", "--port", str(port), "--max-num-seqs", "4096", "--max-num-batched-tokens",
                       "100", name="emu-bad")
    assert proc.popen.wait(timeout=10) == 2
    assert "max_num_batched_tokens" in proc.log()
