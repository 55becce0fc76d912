"""The least an aiohttp balancer costs: a pass-through proxy with no routing, queue, metrics or logs.

`python -m bench.live.aiohttp_floor --port PORT --upstream URL` forwards every POST to ``URL`` + its path over one
keep-alive session (uvloop, as the balancer runs), reads the whole answer, checks it is JSON (the balancer reads an
answer's usage) and returns it; an SSE answer is passed on chunk by chunk as it arrives, unchecked. bench/live/overhead.py part (a) runs it beside SkyLB: the gap between this and the SGLang
router (Rust) is what Python and aiohttp cost by themselves; the gap between SkyLB and this is SkyLB's own work per
request (parsing, placement, accounting, headers, metrics, its log line).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web

from skylb import aio

__all__ = ["build_app", "serve", "main"]


def build_app(upstream: str) -> web.Application:
    """An aiohttp application forwarding every POST to ``upstream`` (a base URL) at the same path."""
    app = web.Application()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        json.loads(body)  # the balancer parses every request
        async with app["session"].post(upstream + request.rel_url.path_qs, data=body,
                                       headers={"Content-Type": "application/json"}) as answer:
            if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
                # A stream: each chunk passed on as it arrives, nothing checked (the least any relay does).
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                while chunk := await answer.content.readany():
                    await response.write(chunk)
                await response.write_eof()
                return response
            data = await answer.read()
            json.loads(data)
            return web.Response(status=answer.status, body=data, headers={"Content-Type": "application/json"})

    async def session(app: web.Application):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(session)
    app.router.add_get("/healthz", health)
    app.router.add_post("/{path:.*}", forward)
    return app


async def serve(upstream: str, port: int) -> None:
    """Serve :func:`build_app` on 127.0.0.1:``port`` until cancelled."""
    runner = web.AppRunner(build_app(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Serve the proxy until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m bench.live.aiohttp_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="port to listen on (127.0.0.1)")
    parser.add_argument("--upstream", required=True, help="base URL of the replica, e.g. http://127.0.0.1:8001")
    args = parser.parse_args(argv)
    aio.run(serve(args.upstream.rstrip("/"), args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
