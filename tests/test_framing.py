"""The SSE / NDJSON framer (skylb/balancer/framing.py): whole events pass unchanged, garbage is a FramingError,
the stream's last event is recognised. Table-driven; tests/test_bad_input.py fuzzes the same framer."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skylb.balancer.framing import FramingError, StreamFramer
from skylb.balancer.usage import UsageTap


@pytest.mark.parametrize("event", [
    b'data: {"type": []}\n\n',  # unhashable where a Responses API event names its type
    b'data: {"type": {"a": 1}}\n\n',
    b'data: {"type": 5}\n\n',
])
def test_an_event_whose_type_is_no_string_is_passed_on_and_does_not_end_the_stream(event):
    """A ``type`` that is no string is no Responses API last event (and no crash: a list is unhashable)."""
    framer = StreamFramer("sse")
    assert framer.feed(event) == event and not framer.done


# -- the one-line "data: {...}" events, decoded without json.loads: garbage is still garbage ----------------------

PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _json_says(payload: bytes):
    """What json.loads makes of an event's data: its object, or "garbage"."""
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return "garbage"


def _framer_says(event: bytes):
    """What the framer makes of one whole SSE event: the object it hands on (None when none), or "garbage"."""
    seen = []
    framer = StreamFramer("sse", on_object=seen.append)
    try:
        out = framer.feed(event)
    except FramingError:
        return "garbage"
    assert out == event
    return seen[0] if seen else None


@pytest.mark.parametrize("payload", [
    b'{"a": 1', b'{"a": 1}}', b'{"a": 1} x', b'{"a": 1}{"b": 2}', b"{'a': 1}", b'{"a": "\xff"}', b'{"a": "\x01"}',
    b'{"a": tru}', b'{"a": 1,}', b"{", b"{}}", b'{"a": [1, 2}', b'{"a": "x\\q"}',
    b'{"a": 1} ', b'{"a": 1}\t', b'{"a": NaN}', b'{"a": "\\ud800"}', b'{"a": "\xed\xa0\x80"}', b"{}",
    b"{\x00}\x00",  # UTF-16-LE for {}: json.loads detects the encoding
    b"{" + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested past Python's recursion limit
])
def test_a_data_object_line_is_garbage_exactly_when_json_loads_says_so(payload):
    """A one-line ``data: {...}`` event (decoded without json.loads) passes exactly when json.loads takes its data,
    and hands on the same object."""
    want = _json_says(payload)
    assert _framer_says(b"data: " + payload + b"\n\n") == (want if isinstance(want, dict) or want == "garbage"
                                                           else None)


@PROPERTY
@given(payload=st.binary(max_size=60).map(lambda b: b"{" + b)
       | st.dictionaries(st.text(max_size=6), st.text(max_size=8) | st.integers() | st.none(), max_size=3).map(
           lambda d: json.dumps(d, ensure_ascii=False).encode()).flatmap(
           lambda b: st.integers(0, len(b)).flatmap(lambda cut: st.sampled_from(
               [b, b[:cut], b[:cut] + b"\"" + b[cut:], b[:cut] + b"\xc3" + b[cut:], b + b" ", b + b"}"]))))
def test_any_data_object_line_is_garbage_exactly_when_json_loads_says_so(payload):
    """Whatever follows ``data: `` on one line, the framer takes it exactly when json.loads does, with its object."""
    if b"\n" in payload or b"\r" in payload:
        return
    want = _json_says(payload)
    assert _framer_says(b"data: " + payload + b"\n\n") == (want if isinstance(want, dict) or want == "garbage"
                                                           else None)


@pytest.mark.parametrize("line", [
    b'{"a": 1', b'{"a": 1}}', b'{"a": 1} x', b'{"a": "\xff"}', b'{"a": "\x01"}', b"{", b'{"done": true,}',
    b'{"a": 1} ', b'{"a": 1}\r', b' {"a": 1}', b'{"a": NaN}', b"{}", b"{\x00}\x00", b"[1]", b"5", b"", b"  ",
])
def test_an_ndjson_line_is_garbage_exactly_when_json_loads_finds_no_object(line):
    """An NDJSON line (objects decoded without json.loads) passes exactly when json.loads makes an object of it (or
    it is blank), and hands on that object."""
    want = _json_says(line) if line.strip() else None
    seen = []
    framer = StreamFramer("ndjson", on_object=seen.append)
    try:
        framer.feed(line + b"\n")
        got = seen[0] if seen else None
    except FramingError:
        got = "garbage"
    assert got == (want if want is None or isinstance(want, dict) else "garbage")


@pytest.mark.parametrize("chunk,pending", [
    (b'data: {"a":\r1}\n\n', None), (b'data: {"a":\n1}\n\n', None), (b'data: {"a":\r\n1}\n\n', None),
    (b'data: {"a": 1}\n\n\n', b"\n"), (b'data: {"a": 1}\n\nx', b"x"),
])
def test_a_line_end_inside_an_event_ends_its_line_as_sse_says(chunk, pending):
    """A CR or LF is a line end in SSE even where JSON would take it as whitespace: an object cut by one is garbage
    (an SSE field named "1}"), and what follows an event's blank line is the next event (None: garbage)."""
    framer = StreamFramer("sse")
    if pending is None:
        with pytest.raises(FramingError):
            framer.feed(chunk)
    else:
        assert framer.feed(chunk) == b'data: {"a": 1}\n\n' and framer.pending == pending


def test_a_chunk_with_garbage_hands_on_no_object_and_no_bytes():
    """Events before garbage in one chunk are not passed on, so their objects (their usage) are not handed on."""
    seen = []
    framer = StreamFramer("sse", on_object=seen.append)
    with pytest.raises(FramingError):
        framer.feed(b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\ndata: {"a": \n\n')
    assert seen == []


# -- the objects handed on: the usage tap reads them instead of decoding the events again --------------------------

USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}}
RESPONSE = {"id": "resp_1", "usage": {"input_tokens": 12, "output_tokens": 3}}
OLLAMA_LAST = {"done": True, "prompt_eval_count": 12, "eval_count": 30, "eval_duration": 900_000_000}
STREAMS = {
    "vllm include_usage": ("sse", b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
                                  b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b"}\n\n"
                                  b"data: [DONE]\n\n"),
    "usage null in every chunk": ("sse", b'data: {"choices": [{"delta": {"content": "usage"}}], "usage": null}\n\n'
                                         b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b"}\n\n"
                                         b"data: [DONE]\n\n"),
    "crlf and comments": ("sse", b": keep-alive\r\n\r\ndata: {\"choices\": []}\r\n\r\n"
                                 b'data: {"choices": [],\r\ndata: "usage": ' + json.dumps(USAGE).encode()
                          + b"}\r\n\r\ndata: [DONE]\r\n\r\n"),
    "responses api": ("sse", b'event: response.created\ndata: {"type": "response.created", "response": {"usage": null}}'
                             b'\n\nevent: response.completed\ndata: ' + json.dumps(
                                 {"type": "response.completed", "response": RESPONSE}).encode() + b"\n\n"),
    "ollama": ("ndjson", b'{"response": "a", "done": false}\n' + json.dumps(OLLAMA_LAST).encode() + b"\n"),
    "ollama without its last newline": ("ndjson", b'{"response": "a", "done": false}\n'
                                        + json.dumps(OLLAMA_LAST).encode()),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_the_usage_seen_in_the_objects_is_the_usage_fed_bytes_read(name, step):
    """However a stream is cut, the usage the tap sees in the framer's objects is the one it reads from the bytes
    the framer passes on, and the stream ends."""
    kind, stream = STREAMS[name]
    seen, fed = UsageTap(kind), UsageTap(kind)
    framer = StreamFramer(kind, on_object=seen.see)
    out = [framer.feed(stream[at:at + step]) for at in range(0, len(stream), step)] + [framer.finish()]
    for events in out:
        fed.feed(events)
    assert b"".join(out) == stream and framer.done
    assert seen.usage is not None and seen.usage == fed.usage


@pytest.mark.parametrize("kind,stream", [
    ("sse", b"data: [DONE]\n\n"),
    ("sse", b'data: {"error": {"message": "x"}}\n\n'),  # vLLM's mid-stream error
    ("sse", b'data: {"error": "x", "type": "error"}\r\n\r\n'),
    ("sse", b"error: {\"message\": \"x\"}\n\n"),  # llama.cpp's error line
    ("sse", b'event: response.completed\ndata: {"type": "response.completed"}\n\n'),
    ("sse", b'data: {"type": "response.failed", "response": {}}\n\n'),
    ("ndjson", b'{"done": true}\n'),
    ("ndjson", b'{"error": "model not found"}\n'),
])
@pytest.mark.parametrize("before", [b"", b"first"])
def test_each_last_event_ends_the_stream(kind, stream, before):
    """[DONE], an error (an object's or llama.cpp's line), a Responses API last event, Ollama's done object or its
    error end the stream, alone or after an ordinary event."""
    if before:
        stream = (b'data: {"choices": []}\n\n' if kind == "sse" else b'{"done": false}\n') + stream
    framer = StreamFramer(kind)
    assert framer.feed(stream) == stream and framer.done


@pytest.mark.parametrize("kind,stream", [
    ("sse", b'data: {"choices": [], "done": true}\n\n'), ("sse", b'data: {"type": "response.output_text.delta"}\n\n'),
    ("sse", b'data: ["error"]\n\n'), ("ndjson", b'{"done": false, "response": "error"}\n'),
])
def test_other_events_do_not_end_the_stream(kind, stream):
    """An ordinary event, whatever words its values hold, does not end the stream."""
    framer = StreamFramer(kind)
    assert framer.feed(stream) == stream and not framer.done
