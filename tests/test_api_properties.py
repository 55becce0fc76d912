"""Property-based tests (hypothesis) of what the balancer reads from clients and peers and what it writes back: the
Responses API parser, the Ollama -> OpenAI request translation and the OpenAI -> Ollama answer translation, and the
peer status's msgpack encoding. Each test's docstring states the invariant it checks. In-process and fast (no
server); tests/test_bad_input.py fuzzes the chat, completions, embeddings and Ollama parsers, SSE / NDJSON framing
and msgpack values of the status."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from skylb.balancer.api import BadRequest, parse_ollama, parse_openai
from skylb.balancer.framing import FramingError
from skylb.balancer.protocol import MAX_STATUS_BYTES, ProtocolError, decode_status, encode_status
from skylb.balancer.translate import Translation, Untranslatable, translate_request
from skylb.core import PeerStatus

PROPERTY = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)
#: Cheap values of the wrong type for a field (drawn far faster than _json_values).
_odd = st.sampled_from([None, 0, -1, 2.5, True, "", "x", [], [1], {}, {"a": 1}, [{"b": None}]])


# -- the Responses API parser -----------------------------------------------------------------------------------------
_part = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["input_text", "output_text", "input_image", "text"]) | _odd,
    "text": st.text(max_size=8) | _odd})
_item = (st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _odd},
                               optional={"content": st.text(max_size=8) | st.lists(_part, max_size=3)
                                         | _odd})
         | st.fixed_dictionaries({"type": st.just("function_call_output"), "output": st.text(max_size=8)
                                  | _odd})
         | _odd)
_responses_request = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["m", ""]) | _odd,
    "input": st.text(max_size=10) | st.lists(_item, max_size=3) | _odd,
    "instructions": st.text(max_size=6) | _odd,
    "previous_response_id": st.sampled_from(["resp_1", "resp", "msg_1", ""]) | _odd,
    "store": st.booleans() | _odd, "stream": st.booleans() | _odd,
    "max_output_tokens": st.integers(-2, 5) | _odd,
    "prompt_cache_key": st.text(max_size=4) | _odd, "user": st.text(max_size=4) | _odd})


@PROPERTY
@given(data=_responses_request, session=st.none() | st.text(max_size=6))
def test_any_responses_api_body_parses_to_a_request_or_raises_bad_request(data, session):
    """Any JSON object on /v1/responses yields either a ParsedRequest whose fields have their documented types
    (stream and store booleans, previous_response_id None or beginning with "resp", max_tokens None or a positive
    integer, the instructions ahead of the input text) or BadRequest naming a reason (the 400 in OpenAI's shape),
    never another exception."""
    body = json.dumps(data).encode()
    try:
        parsed = parse_openai("/v1/responses", body, session_header_value=session)
    except BadRequest as exc:
        assert str(exc) and exc.reason in ("invalid_json", "invalid_field")
        return
    assert parsed.model == data["model"] and parsed.body == body and isinstance(parsed.text, str)
    assert isinstance(parsed.stream, bool) and isinstance(parsed.store, bool)
    assert parsed.previous_response_id is None or parsed.previous_response_id.startswith("resp")
    assert parsed.max_tokens is None or (type(parsed.max_tokens) is int and parsed.max_tokens > 0)
    assert parsed.session_key is None or isinstance(parsed.session_key, str)
    if data.get("instructions"):
        assert parsed.text.startswith(data["instructions"] + "\n")
    if isinstance(data["input"], str):
        assert parsed.text.endswith(data["input"])


# -- Ollama -> OpenAI: requests ---------------------------------------------------------------------------------------
_OPTION_NAMES = ["temperature", "top_p", "seed", "stop", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
                 "num_predict", "num_ctx", "num_thread", "mirostat", "typical_p", "tfs_z", "unknown_option"]
_OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop", "top_k": "top_k",
                  "min_p": "min_p", "repeat_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty"}
_image = st.sampled_from(["iVBORw0KGgo=", "R0lGODlh", "/9j/4AAQ", "not base64!", "é"]) | _odd
_ollama_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"])},
    optional={"content": st.text(max_size=8) | st.none() | _odd,
              "images": st.lists(_image, max_size=2) | _odd,
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": st.text(max_size=4), "arguments": st.dictionaries(st.text(max_size=3), _json_values,
                                                                             max_size=2)})}), max_size=2)
              | _odd})
_ollama_request = st.fixed_dictionaries({"model": st.just("m")}, optional={
    "messages": st.lists(_ollama_message, max_size=4) | _odd,
    "prompt": st.text(max_size=8) | _odd, "system": st.text(max_size=4) | _odd,
    "raw": st.booleans(), "images": st.lists(_image, max_size=2) | _odd,
    "input": st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=2) | _odd,
    "stream": st.booleans() | _odd, "think": st.booleans(),
    "options": st.dictionaries(st.sampled_from(_OPTION_NAMES), _json_values | st.integers(-2, 100), max_size=4)
    | _odd,
    "format": st.just("json") | st.dictionaries(st.text(max_size=4), _json_values, max_size=2) | _odd,
    "tools": st.lists(st.dictionaries(st.text(max_size=4), _json_values, max_size=2), max_size=2) | _odd,
    "template": st.sampled_from(["", "{{ .Prompt }}"]), "dimensions": st.integers(1, 8) | _odd})


def _text_of(content) -> str:
    """An OpenAI message's text: the string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if p.get("type") == "text")
    return content


@PROPERTY
@given(endpoint=st.sampled_from(["/api/chat", "/api/generate", "/api/embed", "/api/embeddings"]),
       data=_ollama_request)
def test_an_ollama_request_translates_to_a_valid_openai_request_keeping_messages_and_options(endpoint, data):
    """Every Ollama request the parser accepts either translates (or asks only to load the model: None, exactly
    when there is nothing to generate) or raises Untranslatable naming a field, never another exception; a
    translation is a request the OpenAI parser accepts, for the same model, with the same stream flag and output
    bound, whose messages keep the Ollama messages' roles and text in order (images as extra parts), whose options
    keep their values under their OpenAI names, and which carries none of the runner's options (num_ctx, ...)."""
    body = json.dumps(data).encode()
    try:
        parsed = parse_ollama(endpoint, body, session_header_value=None)
    except BadRequest:
        return
    try:
        translation = translate_request(endpoint, data, model="served", arrived_at=0.0)
    except Untranslatable as exc:
        assert str(exc) and exc.param
        return
    if translation is None:
        assert endpoint in ("/api/chat", "/api/generate")
        assert not (data.get("messages") if endpoint == "/api/chat" else data.get("prompt"))
        return
    again = parse_openai(translation.path, translation.body, session_header_value=None)
    sent = json.loads(translation.body)
    assert again.model == "served"
    if endpoint in ("/api/embed", "/api/embeddings"):
        assert translation.path == "/v1/embeddings"
        assert sent["input"] == (data.get("input", "") if endpoint == "/api/embed" else data.get("prompt", ""))
        return
    assert again.stream == bool(data.get("stream", True)) and again.max_tokens == parsed.max_tokens
    if endpoint == "/api/chat":
        assert [(m["role"], _text_of(m["content"])) for m in sent["messages"]] == [
            (m["role"], m.get("content") or "") for m in data["messages"]]
    elif translation.path == "/v1/completions":
        assert data.get("raw") and sent["prompt"] == data["prompt"]
    else:
        assert [_text_of(m["content"]) for m in sent["messages"]] == (
            [data["system"]] if data.get("system") else []) + [data["prompt"]]
    for name, value in (data.get("options") or {}).items():
        if name in _OPTION_FIELDS and value is not None:
            assert sent[_OPTION_FIELDS[name]] == value, name
    assert not {"num_ctx", "num_thread", "num_predict", "options"} & set(sent)


# -- OpenAI -> Ollama: answers ----------------------------------------------------------------------------------------
_finish = st.sampled_from(["stop", "length", "tool_calls"])


@PROPERTY
@given(endpoint=st.sampled_from(["/api/chat", "/api/generate"]), text=st.text(max_size=20), finish=_finish,
       usage=st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)))
def test_a_whole_openai_answer_becomes_one_ollama_answer_with_the_same_text_and_counts(endpoint, text, finish,
                                                                                       usage):
    """A whole OpenAI answer (chat's ``message`` or completions' ``text``) becomes one Ollama object, done, with the
    same text (``message.content`` for chat, ``response`` for generate), its finish reason as ``done_reason`` and
    its token counts as ``prompt_eval_count`` and ``eval_count``."""
    t = Translation(endpoint, "/v1/chat/completions", b"{}", "served", arrived_at=0.0, now=lambda: 1.0)
    choice = {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    out = json.loads(t.answer({"choices": [choice], "usage": {"prompt_tokens": usage[0],
                                                              "completion_tokens": usage[1]}}))
    assert (out["message"]["content"] if endpoint == "/api/chat" else out["response"]) == text
    assert out["done"] is True and out["done_reason"] == finish and out["model"] == "served"
    assert (out["prompt_eval_count"], out["eval_count"]) == usage and out["total_duration"] == 1_000_000_000


@PROPERTY
@given(endpoint=st.sampled_from(["/api/chat", "/api/generate"]), pieces=st.lists(st.text(max_size=6), max_size=8),
       finish=_finish, groups=st.lists(st.integers(1, 4), max_size=10), completion_tokens=st.integers(0, 500))
def test_a_streamed_answer_keeps_its_text_whatever_the_chunks_and_ends_with_one_done_object(
        endpoint, pieces, finish, groups, completion_tokens):
    """An OpenAI SSE stream, its text cut into any pieces and its events handed over in any grouping, becomes
    Ollama NDJSON whose not-done lines carry exactly that text in order (no piece lost, doubled or reordered) and
    whose last line, and only that one, is the done object with the finish reason and the usage's counts."""
    t = Translation(endpoint, "/v1/chat/completions", b"{}", "served", arrived_at=0.0)
    events = [b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}).encode() + b"\n\n"
              for p in pieces]
    events.append(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}).encode()
                  + b"\n\n")
    events.append(b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3,
                                                                   "completion_tokens": completion_tokens}}).encode()
                  + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    stream, lines, at = t.stream(), [], 0
    for size in [*groups, len(events)]:
        lines += stream.feed(b"".join(events[at:at + size])).splitlines()
        at += size
    objects = [json.loads(line) for line in lines]
    key = (lambda o: o["message"]["content"]) if endpoint == "/api/chat" else (lambda o: o["response"])
    assert "".join(key(o) for o in objects if not o["done"]) == "".join(pieces)
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    assert objects[-1]["done_reason"] == finish and objects[-1]["eval_count"] == completion_tokens


@PROPERTY
@given(events=st.binary(max_size=80) | st.builds(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n",
                                                 _json_values))
@example(events=b"data: " + b"[" * 100_000 + b"\n\n")  # nested past Python's recursion limit
def test_arbitrary_sse_events_give_ndjson_lines_or_a_framing_error(events):
    """Whatever a replica sends as SSE events, the stream translator returns NDJSON lines (each one JSON object) or
    raises FramingError (the relay's 502 or error event), never another exception."""
    t = Translation("/api/chat", "/v1/chat/completions", b"{}", "served", arrived_at=0.0)
    try:
        out = t.stream().feed(events)
    except FramingError:
        return
    assert all(isinstance(json.loads(line), dict) for line in out.splitlines())


# -- the peer status: msgpack -----------------------------------------------------------------------------------------
_count = st.integers(0, 2 ** 63 - 1)
_ms = st.none() | st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)
_status = st.builds(
    PeerStatus, region=st.text(max_size=12), available_replicas=_count, replicas=_count, queue_len=_count,
    models=st.none() | st.dictionaries(st.sampled_from(["openai", "ollama"]),
                                       st.dictionaries(st.text(max_size=10), _count, max_size=3), max_size=2),
    wait_ms=_ms, queue_age_ms=_ms, dispatch_rate=_ms, backlog_tokens=_ms, prefill_fixed_ms=_ms,
    prefill_ms_per_token=_ms, load_per_replica=_ms)


@PROPERTY
@given(status=_status)
def test_a_peer_status_round_trips_through_msgpack(status):
    """decode(encode(status)) == status for every status a balancer can send: any region text, counts up to
    2^63 - 1, per-API model counts or none, and every optional estimate set, unset or 0."""
    assert decode_status(encode_status(status)) == status


@PROPERTY
@given(data=st.binary(max_size=300))
@example(data=b"\x81\xa1v\x01" + b"\x91" * 5000)  # a map, then lists nested 5000 deep
@example(data=b"\xc0" * (MAX_STATUS_BYTES + 1))
def test_arbitrary_bytes_as_a_peer_status_raise_only_protocol_error(data):
    """Any bytes a peer answers decode to a PeerStatus whose counts are non-negative integers and whose estimates
    are finite and non-negative, or raise ProtocolError (the peer is marked unhealthy with that reason), never
    another exception."""
    try:
        status = decode_status(data)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert min(status.available_replicas, status.replicas, status.queue_len) >= 0
    for value in (status.wait_ms, status.queue_age_ms, status.dispatch_rate, status.backlog_tokens):
        assert value is None or (math.isfinite(value) and value >= 0)
