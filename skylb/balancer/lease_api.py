"""The lease API for batch clients ("LLM-Load-Balancer", the quota-aware router's README, iterations 1 and 2).

A batch client (an Airflow DAG draining a backlog, say) asks before each task which model to call and when:

* ``POST /skylb/v1/schedule`` ``{"model": group or model, "estimated_tokens": int, "lease_ttl_ms"?: int}`` ->
  ``{"wait_for_ms": n}`` (sleep, then ask again; jittered ±10 % and aligned to the 100 ms refill tick) or
  ``{"model": chosen, "lease_id": id, "lease_ttl_ms": n}`` (call ``chosen`` now, through SkyLB with
  ``X-SkyLB-Lease: <id>`` so the call is not charged again). The tenant is the caller's API key's
  (auth.tenant_of): its limits are charged with the model's (``Quotas.limits_for``).
* ``POST /skylb/v1/heartbeat`` ``{"lease_id"}`` -> ``{"ok": true, "lease_ttl_ms": n}``: the lease lives ``ttl``
  more.
* ``POST /skylb/v1/complete`` ``{"lease_id", "used_tokens"?: int}`` -> ``{"ok": true, "model": m}``: the slot is
  freed and the tokens charged but not used (estimate minus ``used_tokens``) are refunded.
* A lease neither completed nor heartbeated within its ttl is reclaimed by a background task: slot freed, all its
  tokens refunded (iteration 2 B).
* ``GET /skylb/v1/advice`` -> ``{"backpressure_score", "suggested_parallelism", ...}`` from the last 60 s of
  schedule outcomes (iteration 2 A; skylb/quota/leases.py).

Errors are in OpenAI's shape: 400 for bad input, 404 for an unknown model or lease, 503 (Retry-After) when no model
of the group is served now or the lease table is full. Leases live in this balancer: a client keeps using the
balancer that gave it a lease (limits themselves are shared as ``balancer.limits`` shares them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass

import structlog
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from skylb.balancer.api import openai_error
from skylb.balancer.auth import tenant_of
from skylb.balancer.retry_after import retry_after_s
from skylb.quota.buckets import LimitBackend
from skylb.quota.groups import Admitted, ModelGate
from skylb.quota.leases import LeaseBook
from skylb.quota.limits import Quotas

__all__ = ["LeaseApi", "LEASE_API", "ROUTES", "start_reclaimer", "CLIENT_PATHS", "DEFAULT_LEASE_TTL_MS",
           "RECLAIM_EVERY_S"]

SCHEDULE_PATH, HEARTBEAT_PATH = "/skylb/v1/schedule", "/skylb/v1/heartbeat"
COMPLETE_PATH, ADVICE_PATH = "/skylb/v1/complete", "/skylb/v1/advice"
#: The admission API's paths: client endpoints (a client API key when keys are configured; auth.py).
CLIENT_PATHS = frozenset({SCHEDULE_PATH, HEARTBEAT_PATH, COMPLETE_PATH, ADVICE_PATH})
#: A lease's time to live without a heartbeat when the schedule call names none (ms), and the bounds of one named.
DEFAULT_LEASE_TTL_MS = 60_000
MIN_LEASE_TTL_MS, MAX_LEASE_TTL_MS = 1_000, 3_600_000
#: The largest ``estimated_tokens`` accepted (tokens).
MAX_ESTIMATED_TOKENS = 100_000_000
#: How often expired leases are looked for (s).
RECLAIM_EVERY_S = 0.2

log = structlog.get_logger("skylb.admission")


@dataclass
class LeaseApi:
    """What the lease API reads and changes, from the balancer's parts.

    Attributes: gate: the model groups' gate (charges a lease when granted, frees it at the end); leases: the leases;
    served_models(): the models served in OpenAI's dialect, here and by peers; models_known(): model lists read;
    recently_served(model): served within ``model_memory_s``; quotas(): the quotas in force; limits: the limit
    backend; now(): the balancer's clock, s; region: its region; retry_after_s: Retry-After of a 503, s.
    """

    gate: ModelGate
    leases: LeaseBook
    served_models: Callable[[], Collection[str]]
    models_known: Callable[[], bool]
    recently_served: Callable[[str], bool]
    quotas: Callable[[], Quotas]
    limits: LimitBackend
    now: Callable[[], float]
    region: str
    retry_after_s: int


#: App key: the balancer's LeaseApi.
LEASE_API = web.AppKey("skylb_lease_api", LeaseApi)


class _Collector:
    """Admission metrics, read at scrape time: leases held and reclaimed, admissions by group and model, and the
    advice (backpressure score, suggested parallelism)."""

    def __init__(self, api: LeaseApi):
        self.api = api

    def collect(self):
        region, state = self.api.region, self.api.leases
        leases = GaugeMetricFamily("skylb_admission_leases", "Admission leases held (POST /skylb/v1/schedule).",
                                   labels=["region"])
        leases.add_metric([region], len(state.leases))
        yield leases
        reclaimed = CounterMetricFamily("skylb_admission_leases_reclaimed", "Admission leases that expired "
                                        "without complete or heartbeat and were reclaimed.", labels=["region"])
        reclaimed.add_metric([region], state.reclaimed)
        yield reclaimed
        admitted = CounterMetricFamily("skylb_group_admissions", "Admissions by the group (or model) asked for, "
                                       "the model chosen, and via (schedule: the admission API; request: a "
                                       "generation naming a group).", labels=["region", "group", "model", "via"])
        for (name, model, via), n in sorted(state.admitted.items()):
            admitted.add_metric([region, name, model, via], n)
        yield admitted
        in_flight, capacity = _in_flight_and_capacity(self.api)
        advice = state.window.advice(self.api.now(), in_flight=in_flight, capacity=capacity)
        score = GaugeMetricFamily("skylb_admission_backpressure_score", "GET /skylb/v1/advice's backpressure "
                                  "score (0: no pressure, 1: long waits, few admissions).", labels=["region"])
        score.add_metric([region], advice.backpressure_score)
        yield score
        suggested = GaugeMetricFamily("skylb_admission_suggested_parallelism", "GET /skylb/v1/advice's suggested "
                                      "number of batch workers.", labels=["region"])
        suggested.add_metric([region], advice.suggested_parallelism)
        yield suggested


class _BadInput(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


async def _json_object(request: web.Request) -> dict:
    try:
        data = json.loads(await request.read())
    except RecursionError:  # Python's decoder on deep nesting
        raise _BadInput("request body is nested too deeply", None) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadInput(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(data, dict):
        raise _BadInput("request body must be a JSON object", None)
    return data


def _int_field(data: dict, name: str, *, low: int, high: int, default: int | None = None) -> int:
    value = data.get(name, default)
    if value is None:
        raise _BadInput(f"'{name}' is required", name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _BadInput(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def _str_field(data: dict, name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise _BadInput(f"'{name}' is required and must be a non-empty string", name)
    return value


def _bad(exc: _BadInput) -> web.Response:
    return openai_error(400, str(exc), param=exc.param)


def _in_flight_and_capacity(api: LeaseApi) -> tuple[int, int | None]:
    """Admissions in flight on the models with a concurrency cap, and the sum of those caps (None: no cap)."""
    caps = {m: lim.max_concurrent for m, lim in api.quotas().models.items() if lim.max_concurrent}
    if not caps:
        return 0, None
    levels = api.limits.levels()
    in_flight = sum(int(levels.get(f"model/{m}", {}).get("in_flight", 0)) for m in caps)
    return in_flight, sum(caps.values())


async def handle_schedule(request: web.Request) -> web.Response:
    """``POST /skylb/v1/schedule`` (module docstring)."""
    api = request.app[LEASE_API]
    state = api.leases
    try:
        data = await _json_object(request)
        name = _str_field(data, "model")
        tokens = _int_field(data, "estimated_tokens", low=1, high=MAX_ESTIMATED_TOKENS)
        ttl_ms = _int_field(data, "lease_ttl_ms", low=MIN_LEASE_TTL_MS, high=MAX_LEASE_TTL_MS,
                            default=DEFAULT_LEASE_TTL_MS)
    except _BadInput as exc:
        return _bad(exc)
    gate = api.gate
    if not gate.is_group(name) and api.models_known() and name not in api.served_models():
        if not api.recently_served(name):
            return openai_error(404, f"The model `{name}` does not exist (neither a model served here nor a "
                                     "model group).", param="model")
    if state.leases.full():
        return openai_error(503, "too many admission leases held; complete some first", type_="overloaded_error",
                            headers={"Retry-After": str(retry_after_s(api.retry_after_s))})
    tenant = tenant_of(request)
    outcome = await gate.try_admit(name, tokens, tenant)
    now = api.now()
    if isinstance(outcome, Admitted):
        lease = state.leases.add(outcome, name=name, tenant=tenant, ttl_s=ttl_ms / 1000.0, now=now)
        state.window.record(now, None)
        state.count(name, outcome.model, "schedule")
        return web.json_response({"model": outcome.model, "lease_id": lease.id, "lease_ttl_ms": ttl_ms})
    if not outcome.served:
        return openai_error(503, f"no model of '{name}' is served by a replica or peer reachable now; retry later",
                            type_="service_unavailable", headers={"Retry-After": str(retry_after_s(api.retry_after_s))})
    wait_ms = gate.wait_ms(outcome, state.rng)
    state.window.record(now, wait_ms)
    return web.json_response({"wait_for_ms": wait_ms})


async def _lease_request(request: web.Request) -> tuple[dict, str] | web.Response:
    try:
        data = await _json_object(request)
        return data, _str_field(data, "lease_id")
    except _BadInput as exc:
        return _bad(exc)


def _unknown_lease(lease_id: str) -> web.Response:
    return openai_error(404, f"lease {lease_id[:80]!r} is unknown, completed or expired (reclaimed)",
                        param="lease_id")


async def handle_heartbeat(request: web.Request) -> web.Response:
    """``POST /skylb/v1/heartbeat`` (module docstring)."""
    api = request.app[LEASE_API]
    state = api.leases
    parsed = await _lease_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    _, lease_id = parsed
    lease = state.leases.get(lease_id, api.now())
    if lease is None or lease.tenant != tenant_of(request):
        return _unknown_lease(lease_id)
    state.leases.heartbeat(lease_id, api.now())
    return web.json_response({"ok": True, "lease_ttl_ms": round(lease.ttl_s * 1000)})


async def handle_complete(request: web.Request) -> web.Response:
    """``POST /skylb/v1/complete`` (module docstring)."""
    api = request.app[LEASE_API]
    state = api.leases
    parsed = await _lease_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    data, lease_id = parsed
    try:
        used = (_int_field(data, "used_tokens", low=0, high=MAX_ESTIMATED_TOKENS)
                if "used_tokens" in data else None)
    except _BadInput as exc:
        return _bad(exc)
    now = api.now()
    lease = state.leases.get(lease_id, now)
    if lease is None or lease.tenant != tenant_of(request):
        return _unknown_lease(lease_id)
    state.leases.pop(lease_id, now)
    refund = 0 if used is None else max(0, lease.admitted.tokens - used)
    await api.gate.release(lease.admitted, refund_tokens=refund)
    return web.json_response({"ok": True, "model": lease.admitted.model, "refunded_tokens": refund})


async def handle_advice(request: web.Request) -> web.Response:
    """``GET /skylb/v1/advice`` (module docstring)."""
    api = request.app[LEASE_API]
    state = api.leases
    in_flight, capacity = _in_flight_and_capacity(api)
    advice = state.window.advice(api.now(), in_flight=in_flight, capacity=capacity)
    return web.json_response({**asdict(advice), "leases": len(state.leases)})


async def _reclaim_loop(api: LeaseApi) -> None:
    state = api.leases
    while True:
        await asyncio.sleep(RECLAIM_EVERY_S)
        for lease in state.leases.pop_expired(api.now()):
            state.reclaimed += 1
            await api.gate.release(lease.admitted, refund_tokens=lease.admitted.tokens)
            log.warning("lease_reclaimed", region=api.region, lease_id=lease.id, model=lease.admitted.model,
                        tenant=lease.tenant, refunded_tokens=lease.admitted.tokens)


#: The lease API's routes.
ROUTES = [web.post(SCHEDULE_PATH, handle_schedule), web.post(HEARTBEAT_PATH, handle_heartbeat),
          web.post(COMPLETE_PATH, handle_complete), web.get(ADVICE_PATH, handle_advice)]


def start_reclaimer(app: web.Application, api: LeaseApi, registry) -> None:
    """Serve ``api`` in ``app`` (``app[LEASE_API]``), count its metrics in ``registry`` (a prometheus
    CollectorRegistry) and reclaim expired leases while ``app`` runs (started and stopped with it)."""
    app[LEASE_API] = api
    registry.register(_Collector(api))

    async def reclaimer(app: web.Application):
        task = asyncio.create_task(_reclaim_loop(api))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(reclaimer)
