"""The request's chain of stages: built from the settings in one place, a disabled feature absent, end hooks run
exactly once however a request ends (answered, rejected, cancelled while queued, cancelled mid-stream)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from skylb.balancer.balancer import Balancer
from skylb.balancer.stages import STAGE_ORDER, Chain, RequestContext
from skylb.balancer.stages.parse import ParseStage
from skylb.config import BalancerConfig

ALL_ON = {"embedding_cache": {"enabled": True}, "ollama_fleet": {"num_ctx": {"llama3": 4096}},
          "quota": {"enabled": True}, "kv_events": True}
ALL_OFF = {"embedding_cache": {"enabled": False}, "quota": {"enabled": False}, "kv_events": False}


async def _chain_names(settings: dict) -> list[str]:
    balancer = Balancer(BalancerConfig(**settings), region="us", advertise_url="http://127.0.0.1:1")
    await balancer.start()
    try:
        return balancer.chain.names
    finally:
        await balancer.stop()


async def test_a_chain_with_every_optional_feature_off_has_none_of_their_stages():
    """Embedding cache, num_ctx pinning, model groups and the quota gate off: only the stages every request
    needs (and the translate check), in order."""
    assert await _chain_names(ALL_OFF) == ["parse", "classify", "translate", "resolve_model", "responses",
                                              "route"]


async def test_a_chain_with_every_optional_feature_on_has_each_stage_once_in_order():
    """Every optional feature on: each stage of STAGE_ORDER exactly once, in that order."""
    assert await _chain_names(ALL_ON) == list(STAGE_ORDER)


class _Hooked:
    """A stage that registers an end hook counting its calls."""

    name = "hooked"

    def __init__(self):
        self.ended = 0

    async def handle(self, ctx):
        def end(ctx):
            self.ended += 1
        ctx.on_end(end)
        return None


class _Terminal:
    """A terminal stage that waits (as a queued request does) or streams one chunk and then waits (mid-stream)."""

    name = "terminal"

    def __init__(self, mode: str):
        self.mode = mode
        self.reached = asyncio.Event()

    async def handle(self, ctx):
        if self.mode == "answer":
            return web.json_response({"ok": True})
        if self.mode == "stream":
            response = web.StreamResponse()
            await response.prepare(ctx.http)
            await response.write(b"data: {}\n\n")
        self.reached.set()
        await asyncio.sleep(30)  # cancelled by the client's disconnect long before
        return web.json_response({"late": True})


class _Log:
    def __init__(self):
        self.finished = 0

    def finish(self, ctx, response):
        self.finished += 1
        return response


async def _serve(chain: Chain):
    async def handler(request):
        ctx = RequestContext(http=request, api="openai", request_id="r1", client_id=None, arrived_at=0.0,
                             started=0.0)
        return await chain.run(ctx)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/v1/completions"


@pytest.mark.parametrize("mode", ["queued", "stream"])
async def test_end_hooks_run_once_when_the_client_goes_away(mode):
    """A client that disconnects while its request waits (queued) or after the first chunk (mid-stream) cancels
    the chain: every end hook runs exactly once, and no response is counted (nobody to answer)."""
    hooked, terminal, request_log = _Hooked(), _Terminal(mode), _Log()
    chain = Chain([ParseStage(max_body_bytes=1 << 20, session_header="X-Session-Id", peer_token=None), hooked,
                   terminal], request_log=request_log)
    runner, url = await _serve(chain)
    try:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(url, json={"model": "m", "prompt": "hi"}).__aenter__())
            await asyncio.wait_for(terminal.reached.wait(), 10)
            if mode == "stream":
                response = await asyncio.wait_for(task, 10)
                assert await response.content.readline() == b"data: {}\n"
                response.close()
            else:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):  # the server notices the closed connection and cancels the handler
            if hooked.ended:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert hooked.ended == 1 and request_log.finished == 0
    finally:
        await runner.cleanup()


async def test_end_hooks_run_once_for_an_answer_and_for_a_rejection():
    """An answered request and one a stage rejects (a bad body: 400) each run their end hooks once and are counted
    once."""
    hooked, request_log = _Hooked(), _Log()
    chain = Chain([hooked, ParseStage(max_body_bytes=1 << 20, session_header="X-Session-Id", peer_token=None),
                   _Terminal("answer")], request_log=request_log)
    runner, url = await _serve(chain)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"model": "m", "prompt": "hi"}) as ok:
                assert ok.status == 200
            async with session.post(url, data=b"{not json") as bad:
                assert bad.status == 400 and (await bad.json())["error"]["type"] == "invalid_request_error"
        assert hooked.ended == 2 and request_log.finished == 2
    finally:
        await runner.cleanup()


def test_no_stage_or_feature_module_imports_the_balancer():
    """The stages, the Ollama fleet's actions and the quota package get narrow dependencies: none of them imports
    skylb/balancer/balancer.py, not even for type hints."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules = [*sorted((root / "skylb" / "balancer" / "stages").glob("*.py")),
               root / "skylb" / "balancer" / "ollama_fleet.py", *sorted((root / "skylb" / "quota").glob("*.py"))]
    assert len(modules) > 15
    found = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n == "skylb.balancer.balancer"]
    assert found == []


def test_the_routed_request_carries_the_clients_max_tokens():
    """The core's Request gets the output limit the client gave (OpenAI ``max_tokens`` times ``n``, Ollama
    ``num_predict``), which an engine reserving KV cache for output reserves (skylb/core/plugins/kv_admission.py)."""
    import json
    from types import SimpleNamespace

    from skylb.balancer.api import parse_ollama, parse_openai
    from skylb.balancer.stages.route import RouteStage

    def routed(parsed):
        ctx = SimpleNamespace(request_id="r1", arrived_at=0.0, parsed=parsed, forwarded=False, forwarded_from=None,
                              route_api="openai", embedding=False, priority="normal", tenant="default", pin=None,
                              block_hashes=None, prompt_tokens=None)
        return RouteStage._core_request(SimpleNamespace(), ctx)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "n": 2}
    assert routed(parse_openai("/v1/chat/completions", json.dumps(body).encode(),
                               session_header_value=None)).max_tokens == 600
    del body["max_tokens"]
    assert routed(parse_openai("/v1/chat/completions", json.dumps(body).encode(),
                               session_header_value=None)).max_tokens is None
    ollama = {"model": "m", "prompt": "hi", "options": {"num_predict": 128}}
    assert routed(parse_ollama("/api/generate", json.dumps(ollama).encode(),
                               session_header_value=None)).max_tokens == 128
