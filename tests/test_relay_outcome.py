"""RelayOutcome.relayed: the client's answer is the target's own (passed on with X-SkyLB-Route), or an error the
balancer wrote after the target failed. The status counts a forward only in the first case (Router.forward_answered),
as a client's report counts it by that header. In-process: the relay against a real aiohttp server and against a
closed port."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request

from skylb.balancer.relay import Relay
from skylb.core import Decision, Request
from tests.procs import free_port


async def _relay(url: str) -> object:
    request = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"})
    decision = Decision(Request(id="r1", text="hi", arrived_at=0.0, model="m"), "peer", "eu", url, 0.0, 0.0)
    async with aiohttp.ClientSession() as session:
        relay = Relay(session, region="us", peer_token="t", session_header="X-Session-ID", first_byte_timeout_s=5,
                      response_timeout_s=5)
        return await relay.relay(request, b'{"model": "m", "prompt": "hi"}', decision, request_id="b1",
                                 arrived_at=0.0, retry_allowed=False, stream=False)


async def test_the_targets_answer_is_relayed_and_a_balancers_own_error_is_not():
    async def complete(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    async with TestServer(app, host="127.0.0.1") as server:
        answered = await _relay(str(server.make_url("")).rstrip("/"))
    assert answered.status == 200 and answered.relayed
    refused = await _relay(f"http://127.0.0.1:{free_port()}")  # nothing listens: the balancer's own 502
    assert refused.status == 502 and refused.response is not None and not refused.relayed
