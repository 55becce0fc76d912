"""Ollama's model management through the balancer: ``/api/pull``, ``/api/delete``, ``/api/copy``, ``/api/create``
relayed to one named replica or to every Ollama replica of the region.

Sources: ollama/ollama docs/api.md (pull, delete, copy, create; streamed status lines); "Why I Built a Priority
Queue for Ollama" (pass-through endpoints: model pulls bypass the queue). Handlers take the Balancer from the
application (``BALANCER``), as the status handlers do.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from skylb.balancer.api import ollama_error
from skylb.balancer.balancer import Balancer
from skylb.balancer.probers import checked_models
from skylb.balancer.retry_after import retry_after_s
from skylb.balancer.status import BALANCER
from skylb.core import ReplicaState

__all__ = ["ROUTES", "REPLICA_HEADER", "MANAGEMENT_PATHS"]

#: Names the replica (its id) a model-management request goes to; absent: every Ollama replica of the region.
REPLICA_HEADER = "X-SkyLB-Replica"
#: Ollama's model-management endpoints relayed by the balancer, with their HTTP method.
MANAGEMENT_PATHS = {"/api/pull": "POST", "/api/delete": "DELETE", "/api/copy": "POST", "/api/create": "POST"}


async def handle_management(request: web.Request) -> web.StreamResponse:
    """Answer ``/api/pull``, ``/api/delete``, ``/api/copy``, ``/api/create``: to the replica named by the
    ``X-SkyLB-Replica`` header (its id), else to every healthy Ollama replica of the region in turn. Streamed
    progress lines are relayed as they come (Ollama's own lines; with several replicas, each replica's lines in turn,
    every line gaining ``"replica": id``). After success the replica's model list is read again at once, so a pulled
    model is routable without waiting for the next refresh."""
    balancer = request.app[BALANCER]
    method = MANAGEMENT_PATHS[request.path]
    body = await request.read()
    named = request.headers.get(REPLICA_HEADER)
    ollama = [r for r in balancer.router.replicas.values() if "ollama" in r.apis and not r.draining]
    if named is not None:
        targets = [r for r in ollama if r.id == named]
        if not targets:
            return ollama_error(404, f"no Ollama replica {named!r} in region {balancer.region}")
    else:
        targets = [r for r in ollama if r.healthy]
        if not targets:
            return ollama_error(503, f"no healthy Ollama replica in region {balancer.region}",
                                headers={"Retry-After": str(retry_after_s(balancer.cfg.retry_after_s))})
    stream = True
    try:
        parsed = json.loads(body) if body.strip() else {}
        stream = not (isinstance(parsed, dict) and parsed.get("stream") is False)
    except (ValueError, RecursionError):  # RecursionError: Python's decoder on deep nesting
        pass  # the replica answers the bad body in Ollama's shape
    if len(targets) == 1 and not stream or method == "DELETE" or request.path == "/api/copy":
        return await _plain(balancer, request, method, body, targets)
    return await _streamed(balancer, request, method, body, targets)


#: The model-management routes.
ROUTES = [web.route(method, path, handle_management) for path, method in MANAGEMENT_PATHS.items()]


async def _refresh(balancer: Balancer, replica: ReplicaState) -> None:
    """Read ``replica``'s model list now (after a pull, delete, copy or create) into routing."""
    from skylb.engines import adapter_for  # the engines package imports the core; keep module import light
    adapter = adapter_for("ollama")
    try:
        slots = await adapter.model_slots(balancer.session, replica.url, "/api/tags", timeout_s=5.0)
        raw = await adapter.models(balancer.session, replica.url, timeout_s=5.0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return  # the next model-list refresh reads it
    balancer.router.set_replica_models(replica.id, checked_models(replica.id, raw))
    if replica.fleet is not None:
        replica.fleet.observe_tags(slots)
    balancer.remember_models()
    balancer.dispatcher.wake()


async def _plain(balancer: Balancer, request: web.Request, method: str, body: bytes,
                 targets: list[ReplicaState]) -> web.Response:
    """One answer per replica; the client gets the first failure, else the last answer."""
    last: web.Response | None = None
    for replica in targets:
        try:
            async with balancer.session.request(method, replica.url + request.path, data=body,
                                                headers={"Content-Type": "application/json"},
                                                timeout=aiohttp.ClientTimeout(total=600)) as resp:
                data = await resp.read()
                answer = web.Response(body=data, status=resp.status,
                                      content_type=resp.content_type if data else None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return ollama_error(502, f"replica {replica.id} unreachable: {exc or type(exc).__name__}")
        answer.headers["X-SkyLB-Served-By"] = f"{balancer.region}/{replica.id}"
        if answer.status >= 400:
            return answer
        await _refresh(balancer, replica)
        last = answer
    assert last is not None
    return last


async def _streamed(balancer: Balancer, request: web.Request, method: str, body: bytes,
                    targets: list[ReplicaState]) -> web.StreamResponse:
    """Relay each replica's NDJSON progress lines as they come; with several replicas every line names its
    ``replica``. A replica that fails or answers an error adds an ``{"error": ...}`` line (Ollama's mid-stream
    error shape) and the next replica still runs."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    many = len(targets) > 1
    for replica in targets:
        try:
            async with balancer.session.request(method, replica.url + request.path, data=body,
                                                headers={"Content-Type": "application/json"},
                                                timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as resp:
                if not response.prepared:
                    if resp.status >= 400 and not many:
                        data = await resp.read()
                        return web.Response(body=data, status=resp.status, content_type="application/json")
                    await response.prepare(request)
                ok = resp.status < 400
                async for line in resp.content:
                    line = line.strip()
                    if not line:
                        continue
                    if many:
                        try:
                            obj = json.loads(line)
                            obj = {**obj, "replica": replica.id} if isinstance(obj, dict) else obj
                            line = json.dumps(obj).encode()
                        except ValueError:
                            pass
                    if b'"error"' in line:
                        ok = False
                    await response.write(line + b"\n")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if not response.prepared:
                await response.prepare(request)
            error = {"error": f"replica {replica.id} unreachable: {exc or type(exc).__name__}"}
            await response.write(json.dumps({**error, "replica": replica.id} if many else error).encode() + b"\n")
            continue
        if ok:
            await _refresh(balancer, replica)
    await response.write_eof()
    return response
