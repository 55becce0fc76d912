"""The balancer's side of Ollama fleets: pre-warm, the fallback model chain, ``num_ctx`` pinning and the status view.
Model management through the balancer (``/api/pull``, ...) is skylb/balancer/model_management.py.

The routing rules themselves (thermal state, elimination and fit, hot preference) are pure, in
skylb/core/fleet_rules.py. Settings: ``balancer.ollama_fleet`` (``FleetSettings``; README "Ollama fleets").

Sources: the Ollama fleet router's "Routing Engine" guide (stage 4 pre-warm: "loads the same model on the runner-up node
by sending an empty generate request ... A lock prevents duplicate pre-warm requests for the same model on the same
node"; the fallback chain; signal 7, a context resize causes a model reload), "Why I Built a Priority Queue for Ollama"
(pass-through endpoints: model pulls bypass the queue), ollama/ollama docs/api.md (pull, delete, copy, create; streamed
status lines; ``keep_alive``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from skylb.core.fleet_rules import FleetSettings, ModelSlot, canonical, thermal

from skylb.balancer.dispatcher import NoHealthyTarget

if TYPE_CHECKING:
    from skylb.balancer.dispatcher import Dispatcher
    from skylb.core import Decision, ReplicaState, Router

__all__ = ["Fleet", "pin_num_ctx", "with_model", "replica_thermal"]

log = structlog.get_logger("skylb.fleet")



def pin_num_ctx(settings: FleetSettings, model: str, body: bytes) -> bytes:
    """``body`` (an Ollama request) with ``options.num_ctx`` pinned to the model's setting, or stripped when the
    setting is "strip"; unchanged when the model has no setting or the body is not a JSON object. Source: the Ollama
    fleet router's "Routing Engine" guide, signal 7 (a request with another context size makes Ollama reload the
    model)."""
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
        settings: ``balancer.ollama_fleet``; router, dispatcher: the balancer's routing core and dispatcher;
        now(): the balancer's clock, s; session(): its upstream aiohttp session (opened at start); region: its
        region; response_timeout_s: the longest a pre-warm (a whole model load) may take, s.
    """

    def __init__(self, settings: FleetSettings, *, router: "Router", dispatcher: "Dispatcher",
                 now: Callable[[], float], session: Callable[[], aiohttp.ClientSession | None], region: str,
                 response_timeout_s: float):
        self.settings = settings
        self.router, self.dispatcher, self.now, self.session = router, dispatcher, now, session
        self.region, self.response_timeout_s = region, response_timeout_s
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
            replica = self.router.replicas.get(decision.target)
            model = decision.request.model
            if replica is not None and replica.fleet is not None and model and \
                    thermal(replica, model, self.now(), self.settings.recent_window_s) != "hot":
                self._cold[decision.request.id] = (replica.id, model, decision.dispatched_at or self.now())
        self.check_prewarm()

    def first_byte(self, decision: "Decision", ttft_s: float) -> None:
        """``decision``'s first byte came after ``ttft_s`` s: for a cold dispatch, a load-time sample (an upper
        bound: it includes the prefill)."""
        cold = self._cold.pop(decision.request.id, None)
        if cold is not None:
            replica = self.router.replicas.get(cold[0])
            if replica is not None and replica.fleet is not None:
                replica.fleet.observe_load(cold[1], ttft_s)

    def finished(self, decision: "Decision") -> None:
        """The response ended: forget a cold dispatch that never produced a byte."""
        self._cold.pop(decision.request.id, None)

    # ---- pre-warm ("Routing Engine" guide, stage 4) ---------------------------------------------------------------

    def check_prewarm(self) -> None:
        """For every model with more than ``prewarm_threshold`` requests queued here (the guide: "exceeds"), load it
        on the runner-up replica (not hot there) with an empty generate, once per (model, replica) at a time."""
        if not self.settings.prewarm:
            return
        router, now = self.router, self.now()
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
            timeout = aiohttp.ClientTimeout(total=self.response_timeout_s)
            async with self.session().post(replica.url + "/api/generate", json=body, timeout=timeout) as resp:
                answer = await resp.json(content_type=None)
                ok = resp.status == 200 and isinstance(answer, dict) and answer.get("done") is True
            log.info("prewarm", region=self.region, model=model, replica=replica.id, ok=ok,
                     load_ms=round((time.monotonic() - started) * 1000, 1))
            if ok and replica.fleet is not None:
                replica.fleet.observe_load(model, time.monotonic() - started)
                replica.fleet.observe_ps({**(replica.fleet.loaded or {}),
                                          canonical(model): replica.fleet.disk.get(canonical(model), ModelSlot())
                                          if replica.fleet.disk else ModelSlot()}, self.now())
                self.dispatcher.wake()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("prewarm_failed", region=self.region, model=model, replica=replica.id,
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
        the next model is tried (at once when the dispatcher finds no usable target for it); a model served nowhere
        is skipped at once; the last one waits as any request
        does (queue timeout). Returns the decision and the body, whose ``model`` names the model now asked for
        (``routed.model`` too). Retries and forwarded requests keep their model. Raises what
        ``Dispatcher.acquire`` raises."""
        dispatcher = self.dispatcher
        chain = [routed.model, *self.fallbacks(routed.model)]
        if retry or routed.forwarded_from is not None or len(chain) == 1:
            return await dispatcher.acquire(routed, retry=retry), body
        served = self.router.served_models(routed.api)
        for i, model in enumerate(chain):
            last = i == len(chain) - 1
            if model not in served and not last:
                continue
            if model != routed.model:
                log.info("fallback", region=self.region, id=routed.id, model=routed.model, to=model)
                routed.model = model
                body = with_model(body, model)
            if last:
                return await dispatcher.acquire(routed), body
            try:
                return await asyncio.wait_for(dispatcher.acquire(routed), self.settings.fallback_hold_s), body
            except asyncio.TimeoutError:
                continue  # acquire's cancellation took it out of the queue (or released a late decision)
            except NoHealthyTarget:
                continue  # the dispatcher took it out of the queue: this model has no usable target now
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
