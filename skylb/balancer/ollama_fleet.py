"""The balancer's side of Ollama fleets: pre-warm, the fallback model chain, ``num_ctx`` pinning, model management
(``/api/pull``, ``/api/delete``, ``/api/copy``, ``/api/create``) through the balancer, and the status view.

The routing rules themselves (thermal state, elimination and fit, hot preference) are pure, in skylb/core/fleet_rules.py.
Settings: ``balancer.ollama_fleet`` (``FleetSettings``; README "Ollama fleets").

Sources: seed 002 (stage 4 pre-warm: "loads the same model on the runner-up node by sending an empty generate
request ... A lock prevents duplicate pre-warm requests for the same model on the same node"; the fallback chain;
signal 7, a context resize causes a model reload), seed 003 (pass-through endpoints: model pulls bypass the queue),
ollama/ollama docs/api.md (pull, delete, copy, create; streamed status lines; ``keep_alive``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web

from skylb.balancer.api import ollama_error
from skylb.balancer.protocol import MODEL_HEADER
from skylb.core.fleet_rules import FleetSettings, ModelSlot, canonical, thermal

if TYPE_CHECKING:
    from skylb.balancer.balancer import Balancer
    from skylb.core import Decision, ReplicaState

__all__ = ["Fleet", "pin_num_ctx", "with_model", "add_management_routes", "REPLICA_HEADER", "MANAGEMENT_PATHS"]

log = structlog.get_logger("skylb.fleet")

#: Names the replica (its id) a model-management request goes to; absent: every Ollama replica of the region.
REPLICA_HEADER = "X-SkyLB-Replica"
#: Ollama's model-management endpoints relayed by the balancer, with their HTTP method.
MANAGEMENT_PATHS = {"/api/pull": "POST", "/api/delete": "DELETE", "/api/copy": "POST", "/api/create": "POST"}


def pin_num_ctx(settings: FleetSettings, model: str, body: bytes) -> bytes:
    """``body`` (an Ollama request) with ``options.num_ctx`` pinned to the model's setting, or stripped when the
    setting is "strip"; unchanged when the model has no setting or the body is not a JSON object. Source: seed 002
    signal 7 (a request with another context size makes Ollama reload the model)."""
    rule = settings.num_ctx.get(model, settings.num_ctx.get(canonical(model)))
    if rule is None:
        return body
    data = _json_object(body)
    if data is None:
        return body
    options = data.get("options") if isinstance(data.get("options"), dict) else {}
    if rule == "strip":
        options.pop("num_ctx", None)
    else:
        options["num_ctx"] = rule
    data["options"] = options
    return json.dumps(data).encode()


def with_model(body: bytes, model: str) -> bytes:
    """``body`` (a JSON object) asking for ``model`` instead (a fallback, a model group's choice); unchanged when not
    a JSON object."""
    data = _json_object(body)
    if data is None:
        return body
    data["model"] = model
    return json.dumps(data).encode()


def _json_object(body: bytes) -> dict | None:
    """``body`` decoded when it is a JSON object, else None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


class Fleet:
    """One balancer's Ollama fleet actions: pre-warm (with its lock), fallbacks, load-time measurement.

    Args:
        balancer: the balancer (its router, session, clock and settings).
    """

    def __init__(self, balancer: "Balancer"):
        self.balancer = balancer
        self.settings: FleetSettings = balancer.cfg.ollama_fleet
        #: (model, replica id) pairs with a pre-warm in flight: the lock against duplicates.
        self._warming: set[tuple[str, str]] = set()
        #: (model, replica id) -> pre-warms sent (shown in status).
        self.prewarms: dict[tuple[str, str], int] = {}
        #: request id -> (replica id, model, dispatched at) for requests sent where their model was not hot:
        #: their time to first byte measures the load.
        self._cold: dict[str, tuple[str, str, float]] = {}
        self._tasks: set[asyncio.Task] = set()

    # ---- thermal state and load times ----------------------------------------------------------------------------

    def routed(self, decision: "Decision") -> None:
        """A request was placed: note a cold dispatch (its first byte measures the load), then check pre-warm."""
        if decision.route == "local":
            replica = self.balancer.router.replicas.get(decision.target)
            model = decision.request.model
            if replica is not None and replica.fleet is not None and model and \
                    thermal(replica, model, self.balancer.now(), self.settings.recent_window_s) != "hot":
                self._cold[decision.request.id] = (replica.id, model, decision.dispatched_at or self.balancer.now())
        self.check_prewarm()

    def first_byte(self, decision: "Decision", ttft_s: float) -> None:
        """``decision``'s first byte came after ``ttft_s`` s: for a cold dispatch, a load-time sample (an upper
        bound: it includes the prefill)."""
        cold = self._cold.pop(decision.request.id, None)
        if cold is not None:
            replica = self.balancer.router.replicas.get(cold[0])
            if replica is not None and replica.fleet is not None:
                replica.fleet.observe_load(cold[1], ttft_s)

    def finished(self, decision: "Decision") -> None:
        """The response ended: forget a cold dispatch that never produced a byte."""
        self._cold.pop(decision.request.id, None)

    # ---- pre-warm (seed 002 stage 4) -----------------------------------------------------------------------------

    def check_prewarm(self) -> None:
        """For every model with more than ``prewarm_threshold`` requests queued here (seed 002: "exceeds"), load it
        on the runner-up replica (not hot there) with an empty generate, once per (model, replica) at a time."""
        if not self.settings.prewarm:
            return
        router, now = self.balancer.router, self.balancer.now()
        depth: dict[tuple[str, str], int] = {}
        for request in router.queue:
            if request.model:
                key = (request.model, request.api)
                depth[key] = depth.get(key, 0) + 1
        for (model, api), n in depth.items():
            if n <= self.settings.prewarm_threshold:
                continue
            replicas = [r for r in router.replicas.values() if r.serves(model, api)]
            hot = [r for r in replicas if thermal(r, model, now) == "hot"]
            winner = min(hot, key=lambda r: (r.outstanding, r.id)) if hot else None
            runner = router.fleet.runner_up(model, api, winner, replicas, now) if winner else None
            if runner is None or (model, runner.id) in self._warming:
                continue
            self._warming.add((model, runner.id))
            self.prewarms[(model, runner.id)] = self.prewarms.get((model, runner.id), 0) + 1
            task = asyncio.create_task(self._prewarm(model, runner))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _prewarm(self, model: str, replica: "ReplicaState") -> None:
        """POST an empty generate with keep_alive to ``replica``; on success mark the model hot there at once and
        record the load time; the lock is released at the end either way."""
        body = {"model": model, "prompt": "", "stream": False, "keep_alive": self.settings.prewarm_keep_alive}
        started = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=self.balancer.cfg.response_timeout_s)
            async with self.balancer.session.post(replica.url + "/api/generate", json=body, timeout=timeout) as resp:
                answer = await resp.json(content_type=None)
                ok = resp.status == 200 and isinstance(answer, dict) and answer.get("done") is True
            log.info("prewarm", region=self.balancer.region, model=model, replica=replica.id, ok=ok,
                     load_ms=round((time.monotonic() - started) * 1000, 1))
            if ok and replica.fleet is not None:
                replica.fleet.observe_load(model, time.monotonic() - started)
                replica.fleet.observe_ps({**(replica.fleet.loaded or {}),
                                          canonical(model): replica.fleet.disk.get(canonical(model), ModelSlot())
                                          if replica.fleet.disk else ModelSlot()}, self.balancer.now())
                self.balancer.dispatcher.wake()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("prewarm_failed", region=self.balancer.region, model=model, replica=replica.id,
                        error=str(exc) or type(exc).__name__)
        finally:
            self._warming.discard((model, replica.id))

    # ---- the fallback chain --------------------------------------------------------------------------------------

    def fallbacks(self, model: str) -> list[str]:
        """The configured fallback models of ``model``, in order (empty: no chain)."""
        return list(self.settings.fallbacks.get(model, ()))

    async def acquire(self, routed: Any, body: bytes, *, retry: bool) -> tuple["Decision", bytes]:
        """The dispatcher's decision for ``routed``, through the fallback chain when its model has one: a model
        served somewhere (a local replica or a peer) is held in the queue up to ``fallback_hold_s`` seconds, then
        the next model is tried; a model served nowhere is skipped at once; the last one waits as any request
        does (queue timeout). Returns the decision and the body, whose ``model`` names the model now asked for
        (``routed.model`` too). Retries and forwarded requests keep their model. Raises what
        ``Dispatcher.acquire`` raises."""
        dispatcher = self.balancer.dispatcher
        chain = [routed.model, *self.fallbacks(routed.model)]
        if retry or routed.forwarded_from is not None or len(chain) == 1:
            return await dispatcher.acquire(routed, retry=retry), body
        served = self.balancer.router.served_models(routed.api)
        for i, model in enumerate(chain):
            last = i == len(chain) - 1
            if model not in served and not last:
                continue
            if model != routed.model:
                log.info("fallback", region=self.balancer.region, id=routed.id, model=routed.model, to=model)
                routed.model = model
                body = with_model(body, model)
            if last:
                return await dispatcher.acquire(routed), body
            try:
                return await asyncio.wait_for(dispatcher.acquire(routed), self.settings.fallback_hold_s), body
            except asyncio.TimeoutError:
                continue  # acquire's cancellation took it out of the queue (or released a late decision)
        raise AssertionError("unreachable: the last model of the chain returns or raises")

    def any_served(self, model: str, served: set[str]) -> bool:
        """True when ``model`` or one of its fallbacks is in ``served``."""
        return model in served or any(m in served for m in self.fallbacks(model))

    def status(self) -> dict[str, Any]:
        """The fleet's part of the operator status: pre-warms sent per model and replica."""
        return {"prewarms": [{"model": m, "replica": r, "count": n} for (m, r), n in sorted(self.prewarms.items())]}

    async def stop(self) -> None:
        """Cancel pre-warms in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def replica_thermal(replica: "ReplicaState", now: float, window_s: float) -> dict[str, str] | None:
    """Per model on ``replica``, its thermal state (status); None for replicas without fleet state."""
    view = replica.fleet
    if view is None:
        return None
    names = set(view.disk or ()) | set(view.loaded or ()) | set(view.last_loaded)
    return {n: thermal(replica, n, now, window_s) for n in sorted(names)}


# ---- model management through the balancer ---------------------------------------------------------------------

def add_management_routes(app: web.Application, key: web.AppKey) -> None:
    """Register ``/api/pull``, ``/api/delete``, ``/api/copy``, ``/api/create``: to the replica named by the
    ``X-SkyLB-Replica`` header (its id), else to every healthy Ollama replica of the region in turn. Streamed
    progress lines are relayed as they come (each prefixed by nothing: Ollama's own lines; with several replicas,
    each replica's lines in turn, every line gaining ``"replica": id``). After success the replica's model list is
    read again at once, so a pulled model is routable without waiting for the next refresh."""

    async def handle(request: web.Request) -> web.StreamResponse:
        balancer = request.app[key]
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
                return ollama_error(503, f"no healthy Ollama replica in region {balancer.region}")
        stream = True
        try:
            parsed = json.loads(body) if body.strip() else {}
            stream = not (isinstance(parsed, dict) and parsed.get("stream") is False)
        except ValueError:
            pass  # the replica answers the bad body in Ollama's shape
        if len(targets) == 1 and not stream or method == "DELETE" or request.path == "/api/copy":
            return await _plain(balancer, request, method, body, targets)
        return await _streamed(balancer, request, method, body, targets)

    for path, method in MANAGEMENT_PATHS.items():
        app.router.add_route(method, path, handle)


async def _refresh(balancer: "Balancer", replica: "ReplicaState") -> None:
    """Read ``replica``'s model list now (after a pull, delete, copy or create) into routing."""
    from skylb.engines import adapter_for  # the engines package imports the core; keep module import light
    adapter = adapter_for("ollama")
    try:
        slots = await adapter.model_slots(balancer.session, replica.url, "/api/tags", timeout_s=5.0)
        raw = await adapter.models(balancer.session, replica.url, timeout_s=5.0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return  # the next model-list refresh reads it
    balancer.router.set_replica_models(replica.id, raw)
    if replica.fleet is not None:
        replica.fleet.observe_tags(slots)
    balancer.remember_models()
    balancer.dispatcher.wake()


async def _plain(balancer: "Balancer", request: web.Request, method: str, body: bytes,
                 targets: list["ReplicaState"]) -> web.Response:
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


async def _streamed(balancer: "Balancer", request: web.Request, method: str, body: bytes,
                    targets: list["ReplicaState"]) -> web.StreamResponse:
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
