"""A streaming client that goes away: after its stream's last event was on its way it has its answer (no error on
the relay outcome, so no error on the relay span and its usage is the answer's); before that, "client disconnected";
an upstream failure stays the outcome's error whatever the client does. In-process: the relay's stream loop with an
aiohttp mocked request, the client's reset made to happen at a chosen write."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from skylb.balancer.framing import StreamFramer
from skylb.balancer.relay import Relay
from skylb.core import Decision

LAST = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\ndata: [DONE]\n\n'
FIRST = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


class _Content:
    def __init__(self, chunks: list[bytes]):
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def at_eof(self) -> bool:
        return not self.chunks


class _Upstream:
    status = 200

    def __init__(self, chunks: list[bytes]):
        self.content = _Content(chunks)


def _run(first: bytes, rest: list[bytes], monkeypatch, *, reset_at: str):
    """Relay ``first`` then ``rest`` to a mocked client whose connection resets at ``reset_at``: "eof" (the end of
    the response) or "write" (the first write after ``first``)."""
    writes = []

    async def write(self, data):
        writes.append(data)
        if reset_at == "write" and len(writes) > 1:
            raise ConnectionResetError

    async def write_eof(self, data=b""):
        if reset_at == "eof":
            raise ConnectionResetError

    async def prepare(self, request):
        return None

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    framer = StreamFramer("sse")
    head = framer.feed(first)
    relay = Relay(None, region="us", peer_token=None, session_header="X-Session-ID", idle_timeout_s=5)
    request = make_mocked_request("POST", "/v1/chat/completions")
    decision = Decision(None, "local", "us-1", "http://r", 0.0)
    return asyncio.run(relay._relay_stream(request, _Upstream(rest), framer, head, False, {}, decision,
                                           arrived_at=0.0, on_first_byte=None))


def test_a_client_that_resets_after_the_last_event_has_its_answer(monkeypatch):
    outcome = _run(FIRST, [LAST], monkeypatch, reset_at="eof")
    assert outcome.status == 200 and outcome.error is None and outcome.failure is None
    assert outcome.usage is not None and outcome.usage.output_tokens == 4


def test_a_client_that_resets_before_the_last_event_disconnected(monkeypatch):
    outcome = _run(FIRST, [FIRST, LAST], monkeypatch, reset_at="write")  # at the second event of three
    assert outcome.error == "client disconnected"


@pytest.mark.parametrize("reset_at", ["eof", "none"])
def test_an_upstream_that_ends_early_is_its_failure_whatever_the_client_does(monkeypatch, reset_at):
    outcome = _run(FIRST, [], monkeypatch, reset_at=reset_at)
    assert outcome.failure == "gateway" and "ended the stream before its last event" in outcome.error
