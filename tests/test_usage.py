"""Reading token counts and engine durations from relayed answers (skylb/balancer/usage.py): Ollama's final
object (whole body or last NDJSON line), OpenAI ``usage`` (whole body or the last SSE chunk), and garbage."""

from __future__ import annotations

import json

import pytest

from skylb.balancer.usage import UsageTap, usage_of, usage_of_body
from skylb.core.rates import Usage

OLLAMA_FINAL = {"model": "m", "done": True, "prompt_eval_count": 12, "prompt_eval_duration": 24_000_000,
                "eval_count": 30, "eval_duration": 900_000_000, "total_duration": 1_000_000_000}


def test_ollama_whole_body():
    assert usage_of_body(json.dumps(OLLAMA_FINAL).encode()) == Usage(12, 12, 30, 0.024, 0.9)


def test_openai_whole_body_excludes_cached_tokens_from_prefill():
    body = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                                     "prompt_tokens_details": {"cached_tokens": 64}}}
    assert usage_of_body(json.dumps(body).encode()) == Usage(100, 36, 7, None, None)


def test_ndjson_stream_keeps_the_final_object_across_chunks():
    tap = UsageTap("ndjson")
    tap.feed(b'{"response":"a","done":false}\n{"response":"usage","done":false}\n')
    assert tap.usage is None
    tap.feed(json.dumps(OLLAMA_FINAL).encode() + b"\n")
    assert tap.usage == Usage(12, 12, 30, 0.024, 0.9)


def test_sse_stream_with_include_usage():
    chunk = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
    last = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    tap = UsageTap("sse")
    tap.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert tap.usage is None
    tap.feed(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    assert tap.usage == Usage(5, 5, 3, None, None)


@pytest.mark.parametrize("obj", [
    None, [], "x", {"usage": None}, {"usage": {"prompt_tokens": "5", "completion_tokens": 3}},
    {"usage": {"prompt_tokens": -1, "completion_tokens": 3}}, {"eval_count": True, "prompt_eval_count": None},
])
def test_malformed_or_missing_counts_are_ignored(obj):
    assert usage_of(obj) is None


def test_garbage_body_is_ignored():
    assert usage_of_body(b'{"usage": ') is None
    assert usage_of_body(b"no json at all") is None
