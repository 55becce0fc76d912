"""The relay's streamed answers end to end, in-process (a real aiohttp upstream, the relay behind a real aiohttp
server, an aiohttp client): the client gets the upstream's events byte for byte with a well-formed end and the
stream's usage is read, whether the upstream's end comes in the read of its last event (the relay then ends the
client's stream in the same send), in a later read, or in the first read with the first event; garbage or a
missing end still closes the client's stream with an error event."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from skylb.balancer.relay import Relay
from skylb.core import Decision, Request

USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
EVENTS = [b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n',
          b'data: {"choices": [{"delta": {"content": "h\\u00e9"}}]}\n\n',
          b'data: {"choices": [{"delta": {"content": "llo"}}]}\n\n',
          b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b"}\n\n",
          b"data: [DONE]\n\n"]
# How the upstream sends EVENTS: a list of writes (the last one with its end when ``end_with_last``), pausing
# between writes so each is its own read.
SENDS = {
    "end with the last event": ([EVENTS[:1], EVENTS[1:3], EVENTS[3:]], True),
    "end in a later read": ([EVENTS[:1], EVENTS[1:3], EVENTS[3:]], False),
    "all in the first read": ([EVENTS], True),
    "last event cut in two": ([EVENTS[:4], [EVENTS[4][:7]], [EVENTS[4][7:]]], True),
}


async def _stream_through_relay(writes: list[bytes], end_with_last: bool) -> tuple[bytes, object]:
    """Serve ``writes`` as an SSE answer, relay it, and return what the client read and the relay's outcome."""
    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, data in enumerate(writes):
            if i == len(writes) - 1 and end_with_last:
                await response.write_eof(data)  # the data and the chunked end in one send
                return response
            await response.write(data)
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    outcomes = []

    async def front(request: web.Request) -> web.StreamResponse:
        decision = Decision(Request(id="r1", text="hi", arrived_at=0.0, model="m"), "local", "r1", upstream_url,
                            0.0, 0.0)
        outcome = await relay.relay(request, await request.read(), decision, request_id="b1", arrived_at=0.0,
                                    retry_allowed=False, stream=True)
        outcomes.append(outcome)
        return outcome.response

    back = web.Application()
    back.router.add_post("/v1/chat/completions", upstream)
    async with TestServer(back, host="127.0.0.1") as back_server, aiohttp.ClientSession() as session:
        upstream_url = str(back_server.make_url("")).rstrip("/")
        relay = Relay(session, region="us", peer_token=None, session_header="X-Session-ID", first_byte_timeout_s=5,
                      idle_timeout_s=5)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", front)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as client:
            async with client.post(server.make_url("/v1/chat/completions"), data=b'{"stream": true}') as answer:
                assert answer.status == 200 and answer.headers["Content-Type"] == "text/event-stream"
                body = await answer.read()  # raises unless the chunked body ends properly
    return body, outcomes[0]


@pytest.mark.parametrize("name", sorted(SENDS))
async def test_the_client_gets_the_stream_byte_for_byte_with_its_end_and_usage(name):
    """However the upstream's events and end are split into reads, the client gets every event unchanged and a
    well-formed end, and the relay reads the stream's usage."""
    groups, end_with_last = SENDS[name]
    body, outcome = await _stream_through_relay([b"".join(g) for g in groups], end_with_last)
    assert body == b"".join(EVENTS)
    assert outcome.error is None and outcome.failure is None
    assert (outcome.usage.prompt_tokens, outcome.usage.prefilled_tokens, outcome.usage.output_tokens) == (7, 4, 2)


@pytest.mark.parametrize("last,passed", [
    (b'data: {"choices": [}\n\n', False),  # garbage: not passed on
    (b'data: {"choices": []}\n\n', True),  # a good event, then the end without [DONE]
])
async def test_garbage_or_a_missing_end_closes_the_clients_stream_with_an_error_event(last, passed):
    """Garbage after the first events, or an upstream that ends without its last event, ends the client's stream
    with an error event after the events that were whole and good."""
    body, outcome = await _stream_through_relay([b"".join(EVENTS[:2]), last], True)
    good = b"".join(EVENTS[:2]) + (last if passed else b"")
    assert body.startswith(good) and body.endswith(b"data: [DONE]\n\n")
    error = json.loads(body[len(good):].split(b"\n\n")[0][len(b"data: "):])
    assert error["error"]["type"] == "server_error" and outcome.failure == "gateway"


@pytest.mark.parametrize("tail,error", [(b'data: {"x": 1}', False), (b'data: {"x', True)])
async def test_an_event_open_at_the_upstreams_end_is_judged_after_the_last_event(tail, error):
    """An event left open after [DONE] when the upstream ends is passed on if it lacks only its terminator, and ends
    the client's stream with an error event if it is garbage (the end read with it does not skip it)."""
    body, outcome = await _stream_through_relay([b"".join(EVENTS[:2]), b"".join(EVENTS[2:]) + tail], True)
    assert body.startswith(b"".join(EVENTS) + (b"" if error else tail))
    assert (outcome.failure == "gateway") == error and (b"server_error" in body[len(b"".join(EVENTS)):]) == error
