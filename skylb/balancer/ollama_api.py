"""Ollama's metadata endpoints on the balancer, answered without queueing (they cost the engines no GPU work).

``GET /`` and ``HEAD /`` ("Ollama is running", which Ollama clients check), ``GET /api/version``, ``GET /api/tags``
(every model the region can serve: its Ollama replicas' entries, plus the models of its other replicas and of its
peers, since those are forwarded), ``GET /api/ps`` (models loaded on the local Ollama replicas), ``POST /api/show``
(asked of a local Ollama replica serving the model, else of a peer that serves it).
Sources: Ollama's API docs (``docs/api.md``); "Why I Built a Priority Queue for Ollama" (pass-through endpoints).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from skylb import __version__, status_page
from skylb.balancer.api import ollama_error
from skylb.balancer.protocol import TOKEN_HEADER
from skylb.balancer.status import BALANCER

__all__ = ["ROUTES"]

_TIMEOUT = aiohttp.ClientTimeout(total=5)


def _ollama_replicas(request):
    balancer = request.app[BALANCER]
    return balancer, [r for r in balancer.router.replicas.values()
                      if "ollama" in r.apis and r.healthy and not r.draining]


async def _fetch_all(balancer, replicas, path):
    async def one(r):
        try:
            async with balancer.session.get(r.url + path, timeout=_TIMEOUT) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
    return [a for a in await asyncio.gather(*(one(r) for r in replicas)) if isinstance(a, dict)]


async def _root(request: web.Request) -> web.Response:
    """``GET /``: Ollama's "is it running" answer; to a browser (``Accept: text/html``), the status page."""
    if status_page.wants_html(request):
        return await status_page.handle_page(request)
    return web.Response(text="Ollama is running")


async def _version(request: web.Request) -> web.Response:
    balancer, replicas = _ollama_replicas(request)
    for answer in await _fetch_all(balancer, replicas[:1], "/api/version"):
        return web.json_response(answer)
    return web.json_response({"version": f"0.0.0-skylb.{__version__}"})


async def _tags(request: web.Request) -> web.Response:
    balancer, replicas = _ollama_replicas(request)
    entries: dict[str, dict] = {}
    for answer in await _fetch_all(balancer, replicas, "/api/tags"):
        for m in answer.get("models", []):
            if isinstance(m, dict) and m.get("name"):
                entries.setdefault(m["name"], m)
    for name in balancer.served_models("ollama") + balancer.served_models("openai"):
        entries.setdefault(name, {"name": name, "model": name, "modified_at": "1970-01-01T00:00:00Z",
                                  "size": 0, "digest": "", "details": {}})
    # Model group aliases (skylb/balancer/stages/model_group.py), as /v1/models lists them: a client picks one by name.
    for alias, members in balancer.quotas.groups.items():
        entries.setdefault(alias, {"name": alias, "model": alias, "modified_at": "1970-01-01T00:00:00Z",
                                   "size": 0, "digest": "", "details": {}, "skylb_group": sorted(members)})
    return web.json_response({"models": sorted(entries.values(), key=lambda m: m["name"])})


async def _ps(request: web.Request) -> web.Response:
    balancer, replicas = _ollama_replicas(request)
    loaded = [m for answer in await _fetch_all(balancer, replicas, "/api/ps")
              for m in answer.get("models", []) if isinstance(m, dict)]
    return web.json_response({"models": loaded})


async def _show(request: web.Request) -> web.Response:
    balancer, replicas = _ollama_replicas(request)
    body = await request.read()
    try:
        data = json.loads(body)
        model = data.get("model") or data.get("name")
    except (ValueError, AttributeError, RecursionError):  # not JSON (or not UTF-8), not an object, too deep
        return ollama_error(400, "request body must be a JSON object with a 'model'")
    if not isinstance(model, str) or not model:
        return ollama_error(400, "'model' is required")
    targets = [r.url for r in replicas if r.models and model in r.models]
    headers = {"Content-Type": "application/json"}
    if not targets:  # maybe a peer serves it
        targets = [p.url for p in balancer.router.peers.values()
                   if p.healthy and p.models and model in p.models.get("ollama", {})]
        if balancer.cfg.peer_token:
            headers[TOKEN_HEADER] = balancer.cfg.peer_token
    for url in targets:
        try:
            async with balancer.session.post(url + "/api/show", data=body, headers=headers,
                                             timeout=_TIMEOUT) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return ollama_error(404, f"model '{model}' not found")


#: The Ollama metadata routes (``HEAD`` answers wherever ``GET`` does).
ROUTES = [web.get("/", _root), web.get("/api/version", _version), web.get("/api/tags", _tags),
          web.get("/api/ps", _ps), web.post("/api/show", _show)]
