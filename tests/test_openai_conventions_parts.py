"""The parts behind OpenAI's conventions, without processes: the reset format of the rate-limit headers and the
choice of the tightest bucket (skylb/quota/headers.py), the bounded map of response ids (skylb/balancer/responses.py),
a Responses API stream ending without ``[DONE]`` (skylb/balancer/framing.py) and its usage (skylb/balancer/usage.py),
Responses requests parsed for routing (skylb/balancer/api.py), pinned placement in the routing core."""

from __future__ import annotations

import json

import pytest

from skylb.balancer.api import BadRequest, parse_openai
from skylb.balancer.framing import StreamFramer
from skylb.balancer.responses import ResponseBook, response_id_of
from skylb.balancer.usage import usage_of
from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
from skylb.quota.buckets import LocalLimits
from skylb.quota.headers import duration_text, rate_limit_headers
from skylb.quota.limits import Limit


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.0169, "17ms"), (1, "1s"), (1.5, "1.5s"), (59.9996, "1m0s"),
                                           (90.5, "1m30.5s"), (360, "6m0s"), (3723.25, "1h2m3.25s")])
def test_reset_durations_are_written_as_openai_writes_them(seconds, text):
    """Go's duration format to the millisecond, rounded up: what OpenAI's x-ratelimit-reset-* headers carry."""
    assert duration_text(seconds) == text


def test_headers_come_from_the_bucket_with_fewest_remaining_for_requests_and_tokens_separately():
    """A tenant bucket tight on requests and a model bucket tight on tokens: each header trio names its own one."""
    limits = LocalLimits()
    buckets = [("tenant/a/*", Limit(requests_per_minute=6, tokens_per_minute=100_000)),
               ("model/m", Limit(requests_per_minute=600, tokens_per_minute=1_000))]
    assert limits.acquire_now(buckets, 100, now=0.0).ok
    headers = rate_limit_headers(buckets, limits)
    assert headers == {"x-ratelimit-limit-requests": "6", "x-ratelimit-remaining-requests": "5",
                       "x-ratelimit-reset-requests": "10s", "x-ratelimit-limit-tokens": "1000",
                       "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "6s"}
    assert rate_limit_headers([("tenant/b/*", Limit(max_concurrent=2))], limits) == {}


def test_the_response_book_is_bounded_in_count_and_age():
    """At most max_entries ids (the least recently used dropped first), each forgotten ttl_s after its last use;
    another tenant finds none of them."""
    clock = [0.0]
    book = ResponseBook(max_entries=2, ttl_s=10.0, now=lambda: clock[0])
    book.record("resp_1", "local", "r1")
    book.record("resp_2", "peer", "eu")
    assert book.lookup("resp_1") == ("local", "r1")  # now the most recently used
    book.record("resp_3", "local", "r2")
    assert len(book) == 2 and book.lookup("resp_2") is None and book.lookup("resp_1") == ("local", "r1")
    assert book.lookup("resp_1", "another-tenant") is None
    clock[0] = 10.5
    assert book.lookup("resp_3") is None and book.lookup("resp_1") is None


def _event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def test_a_responses_stream_ends_with_its_completed_event_and_carries_its_id_and_usage():
    """vLLM sends no [DONE] after response.completed: the framer takes that event as the end; the id is read from
    the first events and the usage from the last."""
    response = {"id": "resp_abc", "object": "response", "usage": {"input_tokens": 12, "output_tokens": 3,
                                                                  "input_tokens_details": {"cached_tokens": 4}}}
    framer = StreamFramer("sse")
    head = framer.feed(_event("response.created", response={**response, "usage": None})
                       + _event("response.in_progress", response=response))
    assert response_id_of(head) == "resp_abc" and not framer.done
    framer.feed(_event("response.output_text.delta", delta="hi"))
    assert not framer.done
    framer.feed(_event("response.completed", response=response))
    assert framer.done
    usage = usage_of({"type": "response.completed", "response": response})
    assert (usage.prompt_tokens, usage.prefilled_tokens, usage.output_tokens) == (12, 8, 3)


def _parse(body: dict):
    return parse_openai("/v1/responses", json.dumps(body).encode(), session_header_value=None)


def test_a_responses_request_is_read_for_routing_and_bad_fields_are_named():
    """instructions then input (a string, or messages with text parts) are the prompt; max_output_tokens the cap;
    a malformed input, store or previous_response_id is a 400 naming the field."""
    parsed = _parse({"model": "m", "instructions": "be brief", "max_output_tokens": 7, "store": False,
                     "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                               {"type": "message", "role": "assistant", "content": "hi"}]})
    assert parsed.text == "be brief\nuser: hello\nassistant: hi\n" and parsed.max_tokens == 7
    assert parsed.store is False and parsed.previous_response_id is None
    assert _parse({"model": "m", "input": "x", "previous_response_id": "resp_1"}).previous_response_id == "resp_1"
    for body, param in (({"model": "m"}, "input"), ({"model": "m", "input": []}, "input"),
                        ({"model": "m", "input": ["x"]}, "input"),
                        ({"model": "m", "input": "x", "previous_response_id": "abc"}, "previous_response_id"),
                        ({"model": "m", "input": "x", "store": "yes"}, "store"),
                        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens")):
        with pytest.raises(BadRequest) as info:
            _parse(body)
        assert info.value.param == param, body


def test_a_pinned_request_goes_to_its_target_at_once_busy_or_not_and_never_elsewhere():
    """The routing core places a pinned request on its replica even with pending requests there (it is the only
    one that can serve it), leaves the queue alone, and says "gone" for a replica that left or a forwarded request
    pinned to a peer, "unavailable" for an unhealthy one."""
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules())
    router.set_replicas([("r0", "http://r0", "vllm"), ("r1", "http://r1", "vllm")])
    router.set_peers([("eu", "http://eu")])
    router.observe_replica("r0", now=0.0, healthy=True, pending=5)
    router.observe_replica("r1", now=0.0, healthy=False, error="refused")
    router.observe_peer("eu", now=0.0, status=PeerStatus("eu", available_replicas=1, replicas=1, queue_len=0))
    decision = router.place_pinned(Request("a", "hi", arrived_at=0.0, pin=("local", "r0")), now=0.1)
    assert (decision.route, decision.target) == ("local", "r0") and router.replicas["r0"].outstanding == 1
    assert len(router.queue) == 0
    assert router.place_pinned(Request("b", "hi", arrived_at=0.0, pin=("local", "r1")), now=0.1) is None
    assert router.pinned_unavailable_reason(("local", "r1"), 0.1)[0] == "unavailable"
    assert router.pinned_unavailable_reason(("local", "r9"), 0.1)[0] == "gone"
    assert router.pinned_unavailable_reason(("peer", "eu"), 0.1) is None
    assert router.pinned_unavailable_reason(("peer", "eu"), 0.1, may_forward=False)[0] == "gone"
    router.set_replicas([("r1", "http://r1", "vllm")])  # r0 leaves: draining while its request runs
    assert router.pinned_unavailable_reason(("local", "r0"), 0.1)[0] == "gone"
    router.finished(decision)
    assert "r0" not in router.replicas
