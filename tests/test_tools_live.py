"""Tool calls through the balancer on real processes: the official openai client's ``tools`` and the ollama
client's (translated to the OpenAI API) reach an emulated vLLM replica through a forwarding hop, and its tool calls
come back in each API's shape, streamed and not; a tool result then gets a text answer. (JSON-schema answers from a
real llama-server through the same hop: tests/test_llamacpp.py.)"""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from tests.cluster import MODEL, Cluster
from tests.procs import ProcGroup

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
EXPECTED = {"city": "emulated", "unit": "celsius"}  # the emulator's arguments for WEATHER's schema


@pytest.fixture(scope="module")
def forwarded(tmp_path_factory):
    """us with no replica, eu with one emulated vLLM replica: every request to us is forwarded to eu."""
    tmp = tmp_path_factory.mktemp("tools")
    with ProcGroup(tmp / "logs") as procs:  # every process stopped at the end, also on failure
        cluster = Cluster(procs, tmp)
        cluster.start_controller(["us", "eu"])
        [replica] = cluster.start_emulator(1, "--time-scale", "0.05")
        cluster.add_replica("eu", replica, replica_id="eu-0")
        for region in ("eu", "us"):
            cluster.start_balancer(region, ["us", "eu"])
        cluster.wait_replicas_healthy("eu", 1)
        cluster.wait_until(lambda: any(MODEL in ((p["models"] or {}).get("openai") or {})
                                       for p in cluster.status("us")["peers"]), timeout_s=15, what="us sees eu")
        yield cluster


def test_the_openai_client_gets_tool_calls_through_a_forwarding_hop(forwarded):
    """A named tool choice and "auto" give one call of the right function with the schema's arguments, streamed and
    not, served by eu through us; the conversation with the tool's result gets a text answer."""
    client = openai.OpenAI(base_url=f"{forwarded.balancers['us']}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "What time is it in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=16,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert raw.headers["X-SkyLB-Route"] == "peer:eu" and raw.headers["X-SkyLB-Served-By"].startswith("eu/")
    choice = raw.parse().choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.type == "function" and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "emulated"}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=16,
                                            stream=True)
    names, arguments, reasons = [], "", []
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices and chunk.choices[0].finish_reason else []
    assert names == ["get_weather"] and json.loads(arguments) == EXPECTED and reasons == ["tool_calls"]
    answered = client.chat.completions.create(model=MODEL, max_tokens=4, tools=[WEATHER, TIME], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_ollama_client_gets_tool_calls_through_translation_and_a_hop(forwarded, streamed):
    """Ollama's ``tools`` pass to the OpenAI API unchanged; the call comes back as Ollama's ``tool_calls`` with
    decoded arguments (streamed: the pieces gathered into one call), and a ``tool`` message answering it gets text."""
    seen: list = []
    client = ollama.Client(host=forwarded.balancers["us"], timeout=30,
                           event_hooks={"response": [lambda r: seen.append(r.headers)]})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if streamed:
        parts = list(client.chat(model=MODEL, messages=messages, tools=[WEATHER], stream=True,
                                 options={"num_predict": 16}))
        calls = [c for p in parts for c in p.message.tool_calls or []]
        assert parts[-1].done
    else:
        reply = client.chat(model=MODEL, messages=messages, tools=[WEATHER], options={"num_predict": 16})
        calls = reply.message.tool_calls
    assert seen[-1]["X-SkyLB-Route"] == "peer:eu"
    [call] = calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == EXPECTED
    answer = client.chat(model=MODEL, tools=[WEATHER], options={"num_predict": 4}, messages=[
        *messages, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"}])
    assert answer.message.content and not answer.message.tool_calls
