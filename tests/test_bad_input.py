"""Bad input, from clients, replicas and peers: always a clear error in the API's shape, counted and logged, never a
500 or a hang. In-process property-based tests (hypothesis) of request parsing."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skylb.balancer.api import BadRequest, parse_ollama, parse_openai

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
OLLAMA_PATHS = ("/api/generate", "/api/chat", "/api/embed")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
