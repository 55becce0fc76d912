"""The Ollama API translated to the OpenAI API and back (skylb/balancer/translate.py), case by case, without
processes: the live path with the official ollama client is tests/test_engines_live.py."""

from __future__ import annotations

import base64
import json

import pytest
from aiohttp.test_utils import make_mocked_request

from skylb.balancer.api import parse_ollama, parse_openai
from skylb.balancer.framing import FramingError
from skylb.balancer.stages.context import RequestContext
from skylb.balancer.stages.translate import TranslateStage
from skylb.balancer.translate import Untranslatable, load_answer, translate_request

MODEL = "m"


def _translate(endpoint: str, data: dict, clock=None):
    ticks = iter(clock or [100.0 + i for i in range(100)])
    return translate_request(endpoint, {"model": MODEL, **data}, model=MODEL, arrived_at=100.0,
                             now=lambda: next(ticks))


def _body(translation) -> dict:
    return json.loads(translation.body)


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def _lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines() if line]


@pytest.mark.parametrize("endpoint, data, path, want", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "options": {"num_predict": 7, "temperature": 0.5, "top_k": 3, "repeat_penalty": 1.1, "num_ctx": 8192,
                               "mirostat": 0}},
     "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": MODEL, "stream": False,
                              "max_tokens": 7, "temperature": 0.5, "top_k": 3, "repetition_penalty": 1.1}),
    ("/api/generate", {"prompt": "tell", "system": "be brief", "options": {"num_predict": -1, "stop": ["\n"]}},
     "/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "tell"}], "model": MODEL, "stream": True,
                              "stream_options": {"include_usage": True}, "stop": ["\n"]}),
    ("/api/generate", {"prompt": "<s>raw", "raw": True, "stream": False, "format": "json"},
     "/v1/completions", {"prompt": "<s>raw", "model": MODEL, "stream": False,
                         "response_format": {"type": "json_object"}}),
    ("/api/embed", {"input": ["a", "b"], "dimensions": 8, "truncate": True},
     "/v1/embeddings", {"model": MODEL, "input": ["a", "b"], "encoding_format": "float", "dimensions": 8}),
    ("/api/embeddings", {"prompt": "a"}, "/v1/embeddings", {"model": MODEL, "input": "a", "encoding_format": "float"}),
])
def test_requests_become_the_openai_request_of_the_same_meaning(endpoint, data, path, want):
    """Each Ollama endpoint goes to its OpenAI endpoint; options map to OpenAI's names (and vLLM's extensions),
    runner options and neutral values are dropped, a stream asks for its usage, raw mode is a plain completion."""
    translation = _translate(endpoint, data)
    assert translation.path == path and _body(translation) == want


def test_images_and_tool_calls_become_openai_parts_and_ids():
    """Images become data-URL image parts with their media type; an assistant's tool calls get ids that the tool
    messages after it answer in order; tools and a JSON-schema format pass."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 20).decode()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = _body(_translate("/api/chat", {"format": schema, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "messages": [
        {"role": "user", "content": "look", "images": [png]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}},
                                                            {"function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "content": "1", "tool_name": "f"}, {"role": "tool", "content": "2", "tool_name": "g"}]}))
    user, assistant, first, second = body["messages"]
    assert user["content"][1] == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert (first["tool_call_id"], second["tool_call_id"]) == ("call_1_0", "call_1_1")
    assert body["response_format"]["json_schema"]["schema"] == schema and body["tools"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("endpoint, data, param", [
    ("/api/generate", {"prompt": "x", "options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/generate", {"prompt": "x", "options": {"typical_p": 0.5}}, "options.typical_p"),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("/api/generate", {"prompt": "x", "context": [1, 2]}, "context"),
    ("/api/generate", {"prompt": "x", "raw": True, "images": ["aGk="]}, "images"),
    ("/api/generate", {"prompt": "x", "format": 5}, "format"),
    ("/api/chat", {"messages": [{"role": "tool", "content": "orphan"}]}, "messages"),
    ("/api/chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
])
def test_what_the_openai_api_cannot_say_is_refused_by_name(endpoint, data, param):
    """A sampling option without an OpenAI counterpart (set to anything but neutral), a template, a suffix, a
    context, images in raw mode, a bad format or a tool result answering nothing: Untranslatable naming the field."""
    with pytest.raises(Untranslatable) as refused:
        _translate(endpoint, data)
    assert refused.value.param == param


def test_nothing_to_generate_is_a_load_request():
    """An empty prompt or message list asks Ollama to load the model: no OpenAI request, a done "load" answer."""
    assert _translate("/api/generate", {"prompt": ""}) is None and _translate("/api/chat", {"messages": []}) is None
    assert load_answer("/api/chat", MODEL)["message"] == {"role": "assistant", "content": ""}
    assert load_answer("/api/generate", MODEL)["done_reason"] == "load"


def test_a_stream_becomes_ndjson_ending_with_the_done_object():
    """Content and reasoning deltas become NDJSON lines (role-only chunks say nothing); ``[DONE]`` becomes the done
    object with the finish reason, the usage's counts, the total time since arrival and the decode time between
    the first and last token, in ns."""
    stream = _translate("/api/chat", {"messages": [{"role": "user", "content": "hi"}]},
                        clock=[101.0, 101.5, 102.0]).stream()
    out = _lines(stream.feed(_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                                  {"choices": [{"delta": {"reasoning_content": "hmm"}}]})))
    assert [o["message"] for o in out] == [{"role": "assistant", "content": "", "thinking": "hmm"}]
    out += _lines(stream.feed(b": keep-alive\n\n" + _sse(
        {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, b"[DONE]")))
    assert [o["message"]["content"] for o in out] == ["", "Hi", ""] and [o["done"] for o in out] == [False] * 2 + [True]
    done = out[-1]
    assert (done["done_reason"], done["prompt_eval_count"], done["eval_count"]) == ("length", 9, 2)
    assert done["total_duration"] == 2_000_000_000 and done["eval_duration"] == 500_000_000
    assert "load_duration" not in done and done["model"] == MODEL


def test_streamed_tool_calls_are_gathered_and_engine_timings_used():
    """Tool-call fragments are gathered into one message before the done object; llama.cpp's own timings (ms) give
    the prompt and decode durations; generate answers carry ``response``."""
    stream = _translate("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}).stream()
    out = _lines(stream.feed(_sse(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\": "}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                      "finish_reason": "tool_calls"}], "timings": {"prompt_ms": 12.5, "predicted_ms": 40}},
        b"[DONE]")))
    assert out[0]["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"x": 1}}}]
    assert out[1]["done_reason"] == "tool_calls"
    assert (out[1]["prompt_eval_duration"], out[1]["eval_duration"]) == (12_500_000, 40_000_000)
    generate = _translate("/api/generate", {"prompt": "x"}).stream()
    assert _lines(generate.feed(_sse({"choices": [{"delta": {"content": "y"}}]})))[0]["response"] == "y"


def test_whole_answers_and_errors_come_back_in_ollama_shape():
    """A whole chat, completion or embedding answer becomes Ollama's; an OpenAI error object (nested or TGI's flat
    one), mid-stream or whole, becomes ``{"error": "..."}``; an answer in no OpenAI shape raises FramingError."""
    chat = _translate("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False})
    out = json.loads(chat.answer({"choices": [{"message": {"content": "ok", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}))
    assert out["message"]["content"] == "ok" and out["message"]["tool_calls"][0]["function"]["name"] == "f"
    assert (out["done"], out["prompt_eval_count"], out["eval_count"]) == (True, 3, 1) and "eval_duration" not in out
    raw = _translate("/api/generate", {"prompt": "x", "raw": True, "stream": False})
    assert json.loads(raw.answer({"choices": [{"text": "t", "finish_reason": "length"}]}))["response"] == "t"
    embed = _translate("/api/embed", {"input": ["a", "b"]})
    out = json.loads(embed.answer({"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
                                   "usage": {"prompt_tokens": 2}}))
    assert out["embeddings"] == [[1.0], [2.0]] and out["prompt_eval_count"] == 2
    assert json.loads(_translate("/api/embeddings", {"prompt": "a"}).answer(
        {"data": [{"embedding": [1.0]}]})) == {"embedding": [1.0]}
    assert json.loads(chat.answer({"error": {"message": "bad", "type": "BadRequestError"}})) == {"error": "bad"}
    assert json.loads(chat.answer({"error": "Model is overloaded", "error_type": "overloaded"})) == {
        "error": "Model is overloaded"}
    assert _lines(chat.stream().feed(_sse({"error": {"message": "died"}}, b"[DONE]"))) == [{"error": "died"}]
    assert _lines(chat.stream().feed(b"error: {\"code\": 500}\n\n")) == [{"error": "{\"code\": 500}"}]
    with pytest.raises(FramingError):
        chat.answer({"choices": ["not an object"]})
    with pytest.raises(FramingError):
        chat.stream().feed(_sse({"choices": [{"delta": {"content": 5}}]}))


# ---- the stage: when a request is translated -----------------------------------------------------------------------

SERVED = {"ollama": {"llama3:latest"}, "openai": {"llama3:latest", "vllm-model"}}


def _stage():
    return TranslateStage(served_models=lambda api, with_peers=True: SERVED[api], is_group=lambda name: name == "grp",
                          any_served=lambda model, served: model in served, now=lambda: 0.0)


def _ctx(path: str, data: dict, api: str = "ollama") -> RequestContext:
    body = json.dumps(data).encode()
    parse = parse_ollama if api == "ollama" else parse_openai
    return RequestContext(http=make_mocked_request("POST", path), api=api, request_id="r", client_id=None,
                          arrived_at=0.0, started=0.0, body=body, parsed=parse(path, body, session_header_value=None))


@pytest.mark.parametrize("path, data, api, translated", [
    ("/api/chat", {"model": "vllm-model", "messages": [{"role": "user", "content": "x"}]}, "ollama", True),
    ("/api/chat", {"model": "llama3", "messages": [{"role": "user", "content": "x"}]}, "ollama", False),
    ("/api/chat", {"model": "grp", "messages": [{"role": "user", "content": "x"}]}, "ollama", False),
    ("/api/chat", {"model": "nobody", "messages": [{"role": "user", "content": "x"}]}, "ollama", False),
    ("/v1/chat/completions", {"model": "vllm-model", "messages": [{"role": "user", "content": "x"}]}, "openai", False),
])
async def test_the_stage_translates_only_what_no_ollama_replica_serves(path, data, api, translated):
    """Only an Ollama request for a model served in the OpenAI dialect alone is translated (routed as OpenAI); one an
    Ollama replica serves (by Ollama's name rules), a model group, an unknown model (resolve_model's 404) and an
    OpenAI request pass unchanged."""
    ctx = _ctx(path, data, api)
    body = ctx.body
    assert await _stage().handle(ctx) is None
    assert (ctx.translation is not None) == translated and ctx.route_api == ("openai" if translated else api)
    assert (ctx.body != body) == translated
    if translated:
        assert json.loads(ctx.body)["messages"] == data["messages"] and ctx.translation.path == "/v1/chat/completions"


async def test_the_stage_answers_a_load_request_and_refuses_by_the_serving_api():
    """An empty prompt is answered at once (done_reason "load"); an untranslatable request gets a 400 in Ollama's
    shape naming the OpenAI API that serves the model, counted as "untranslatable"."""
    loaded = await _stage().handle(_ctx("/api/generate", {"model": "vllm-model", "prompt": ""}))
    assert loaded.status == 200 and json.loads(loaded.body)["done_reason"] == "load"
    ctx = _ctx("/api/generate", {"model": "vllm-model", "prompt": "x", "suffix": "y"})
    refused = await _stage().handle(ctx)
    error = json.loads(refused.body)["error"]
    assert refused.status == 400 and "OpenAI API (/v1/chat/completions)" in error and "'suffix'" in error
    assert ctx.reason == "untranslatable" and ctx.rejected
