"""The membership controller: a JSON REST API over the membership store (SQLite, or etcd shared by several
controllers), with long-poll watches.

Run it with ``skylb controller [--config FILE] [--host H] [--port P] [--db PATH | --store etcd --etcd-endpoints
URLS]``. Endpoints:

- ``GET /healthz`` -> {"status": "ok", "revision": N, "store": "sqlite" | "etcd", "leader": bool, "watchers": N}
- ``GET /metrics`` -> Prometheus text: membership size and revision, health checks, failovers, leadership
  (controller/metrics.py)
- ``GET /`` the status page, ``GET /skylb/v1/status`` its data: the membership joined with every balancer's status
  (controller/status_view.py; the admin token or the page's session, as skylb/status_page says)
- ``GET /v1/membership[?revision=N&wait=S][&balancer=URL]`` -> full snapshot; with both, a long poll that answers as
  soon as the revision is > N, or after S seconds (at most 60) with the unchanged state; with ``balancer``, that
  balancer's view: only the replicas it owns and its siblings (controller/ownership.py ``view_for``)
- ``GET /v1/replicas[?region=R]``, ``POST /v1/replicas``, ``DELETE /v1/replicas/{id}``
- ``POST /v1/replicas/{id}/drain``, ``POST /v1/replicas/{id}/undrain``
- ``GET /v1/balancers``, ``POST /v1/balancers`` (register or heartbeat, with the epochs held), ``DELETE
  /v1/balancers?url=U``; ``GET /v1/owners``: which balancer owns each replica, and the epoch
- ``POST /v1/regions/{region}/drain``, ``POST /v1/regions/{region}/undrain`` (the region's balancers)
- ``GET /v1/assignments``: which region's balancer serves each region's replicas, and the epoch
- ``GET /v1/quotas``, ``POST /v1/quotas`` (set one entry: a tenant, a model's limit, a group), ``DELETE
  /v1/quotas?tenant=T[&model=M] | ?model=M | ?group=G | ?all=true`` (controller/quotas.py); the quotas travel
  with the membership snapshot, so every change wakes the balancers' watches

Reads are open; changes need the admin token, balancer heartbeats the peer token (controller/auth.py). A region may
run several balancers (siblings), told apart by their id; each replica is owned by one of them at a time
(controller/ownership.py). A balancer registering with an id that a live balancer of its region holds at another
URL is refused (409 ``balancer_id_taken``) unless the request carries the admin token and ``"replace": true``,
which removes the live one.

Errors are always {"error": {"message", "type", "code"}}. Clients get the balancer's deadlines on reading a request
and a cap on open connections (``controller.client_connections``, skylb/listener.py). Each membership change logs
one structlog JSON line.
Unless ``controller.health.enabled`` is false, every replica and balancer is health-checked (controller/health.py); a
change of verdict is a membership revision (the ``healthy`` field), and a region whose balancers are all down or
draining is failed over to the closest live region (controller/failover.py; ``assignments`` in the membership).
With ``controller.dns``, each region's DNS answer follows its assignment (controller/dns_sync.py).
On etcd, several controllers serve the API and only the elected leader runs the health checks and failover
(controller/leader.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3
import sys
import time
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from skylb import aio, gc_pauses
from controller.auth import (CREDENTIALS, THROTTLE, ControllerCredentials, auth_middleware, is_admin,
                             resolve_credentials)
from controller.health import HealthChecker
from controller.leader import EtcdElection, SoleLeader, leadership_for
from controller.metrics import CONTENT_TYPE, ControllerMetrics
from controller.ownership import (LIVE_HEARTBEAT_S, confirm_released, live_balancers, rebalance, stale_owned,
                                  view_for)
from controller.reload import Reload, resolve
from controller.quotas import remove_entry, set_entry
from controller.shares import ShareBook
from controller import status_view
from controller.store import (InvalidInput, StoreError, default_balancer_id, normalize_url, quotas_json,
                              validate_balancer_id, validate_region)
from controller.stores import Store, follow_revisions, open_store
from skylb.config import ConfigError, ControllerConfig
from skylb import environment, logs
from skylb.listener import GuardedAppRunner, unreadable_body
from skylb.tokens import GuessThrottle
from skylb.logs import configure_logging
from skylb.quota.gate import retry_after_s
from skylb.reload import Reloader

__all__ = ["MAX_WAIT_S", "RevisionWatch", "create_app", "serve", "add_arguments", "main"]

#: Longest long poll a client may ask for (s); longer asks are cut to this.
MAX_WAIT_S = 60.0
#: How long shutdown waits for in-flight requests after waking every watcher (s).
_SHUTDOWN_GRACE_S = 2.0
#: Retry-After base of a 503 (etcd unreachable or electing a leader), s: a few etcd election timeouts (1000 ms by
#: default, etcd docs, "Tuning"); jittered in [base, 1.5 x base] as the balancer's (RFC 9110 §10.2.3).
STORE_RETRY_AFTER_S = 4

log = structlog.get_logger("skylb.controller")


class RevisionWatch:
    """Wakes long-poll watchers when the revision moves; ``close()`` releases them all at shutdown."""

    def __init__(self, revision: int):
        self._revision = revision
        self._closed = False
        self._cond = asyncio.Condition()
        #: Long polls waiting now (each balancer keeps one open while its membership is current).
        self.watchers = 0

    async def publish(self, revision: int) -> None:
        """Record a new revision and wake every watcher waiting below it."""
        async with self._cond:
            self._revision = revision
            self._cond.notify_all()

    async def close(self) -> None:
        """Wake every watcher now (they answer with the current state) and make later waits return at once."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    async def wait_beyond(self, revision: int, timeout_s: float) -> None:
        """Return when the revision is > ``revision``, after ``timeout_s`` seconds, or at shutdown."""
        async with self._cond:
            self.watchers += 1
            try:
                async with asyncio.timeout(timeout_s):
                    await self._cond.wait_for(lambda: self._closed or self._revision > revision)
            except TimeoutError:
                pass
            finally:
                self.watchers -= 1


STORE = web.AppKey("store", Store)
WATCH = web.AppKey("watch", RevisionWatch)
LEADERSHIP = web.AppKey("leadership", SoleLeader | EtcdElection)
SHARES = web.AppKey("shares", ShareBook)
METRICS = web.AppKey("metrics", ControllerMetrics)
#: Awaited when replicas change owner (a sibling joined, drained or left), so each region's DNS answer follows at
#: once: the DNS sync's ``changed`` when DNS is configured, else nothing.
DNS_WAKE = web.AppKey("dns_wake", list)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(code: int, message: str, type_: str) -> web.Response:
    headers = {"Retry-After": str(retry_after_s(STORE_RETRY_AFTER_S))} if code in (429, 503) else None
    return web.json_response({"error": {"message": message, "type": type_, "code": code}}, status=code,
                             headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into the JSON error shape: store errors keep their code, HTTP errors theirs, bugs 500."""
    try:
        return await handler(request)
    except StoreError as exc:
        return _error(exc.code, str(exc), exc.type)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        return _error(exc.status, message, "not_found" if exc.status == 404 else "http_error")
    except Exception as exc:  # a bug: log it with its traceback, answer in the API's shape
        log.exception("request_failed", method=request.method, path=request.path)
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object; InvalidInput (400) for a body that does not decompress or is not JSON
    (Python's decoder raises ValueError for integers over 4300 digits and RecursionError for deep nesting)."""
    try:
        body = await request.json()
    except web.RequestPayloadError as exc:  # gzip or deflate that does not decompress, a chunked body cut short
        raise InvalidInput("body", f"could not be read: {unreadable_body(exc)}") from None
    except RecursionError:
        raise InvalidInput("body", "is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        raise InvalidInput("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("body", "must be a JSON object")
    return body


_KIND = {int: "an integer", float: "a number"}


def _query_number(request: web.Request, name: str, cast: type, minimum: float) -> Any:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = cast(raw)
    except ValueError:
        raise InvalidInput(name, f"{raw!r} is not {_KIND[cast]}") from None
    if not value >= minimum:  # also rejects NaN
        raise InvalidInput(name, f"must be >= {minimum}")
    return value


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz -> {"status": "ok", "revision": N, "store": kind, "leader": whether this controller leads,
    "watchers": long polls on /v1/membership waiting now}."""
    store = request.app[STORE]
    return web.json_response({"status": "ok", "revision": store.revision, "store": store.kind,
                              "leader": request.app[LEADERSHIP].is_leader, "watchers": request.app[WATCH].watchers})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics -> the controller's Prometheus metrics (open, as every read: no secret in them)."""
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def get_membership(request: web.Request) -> web.Response:
    """GET /v1/membership[?revision=N&wait=S] -> the full snapshot, after a long poll when both are given."""
    store = request.app[STORE]
    revision = _query_number(request, "revision", int, 0)
    wait_s = _query_number(request, "wait", float, 0.0)
    balancer = request.query.get("balancer")
    balancer = None if balancer is None else normalize_url(balancer, field="balancer")
    # A revision above ours means the store was replaced under the client: answer at once so it re-lists.
    if revision is not None and wait_s and revision <= store.revision:
        await request.app[WATCH].wait_beyond(revision, min(wait_s, MAX_WAIT_S))
    snapshot = store.snapshot()
    return web.json_response(snapshot.to_dict() if balancer is None else view_for(snapshot, balancer))


async def list_replicas(request: web.Request) -> web.Response:
    """GET /v1/replicas[?region=R] -> {"replicas": [...]}."""
    replicas = request.app[STORE].list_replicas(request.query.get("region"))
    return web.json_response({"replicas": [r.to_dict() for r in replicas]})


async def add_replica(request: web.Request) -> web.Response:
    """POST /v1/replicas {"region", "url", "engine"="vllm", "id"?, "max_concurrency"?, "kv_events"?,
    "kv_events_replay"?, "kv_block_size"?} -> 201 with the replica."""
    body = await _json_object(request)
    kv_fields = ("kv_events", "kv_events_replay", "kv_block_size")
    unknown = set(body) - {"region", "url", "engine", "id", "max_concurrency", *kv_fields}
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "unknown field (expected region, url, engine, id, max_concurrency, "
                                               "kv_events, kv_events_replay, kv_block_size)")
    store = request.app[STORE]
    replica = store.add_replica(body.get("region"), body.get("url"), body.get("engine", "vllm"), body.get("id"),
                                max_concurrency=body.get("max_concurrency"),
                                **{k: body[k] for k in kv_fields if k in body})
    await _changed(request.app, "replica_added", **replica.to_dict())
    await _rebalance(request.app)
    return web.json_response(replica.to_dict(), status=201)


async def remove_replica(request: web.Request) -> web.Response:
    """DELETE /v1/replicas/{id} -> 200 with the removed replica; 404 when unknown."""
    replica = request.app[STORE].remove_replica(request.match_info["id"])
    await _changed(request.app, "replica_removed", **replica.to_dict())
    return web.json_response(replica.to_dict())


async def list_balancers(request: web.Request) -> web.Response:
    """GET /v1/balancers -> {"balancers": [...]}."""
    return web.json_response({"balancers": [b.to_dict() for b in request.app[STORE].list_balancers()]})


def _registration(body: dict[str, Any]) -> tuple[str, str, str, dict[str, int], dict[str, int], bool]:
    """(region, url, id, epochs, owned, replace) of a registration body; InvalidInput naming the first bad field."""
    unknown = set(body) - {"region", "url", "id", "epochs", "owned", "replace", "demand"}
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "unknown field (expected region, url, id, epochs, owned, replace, "
                                               "demand)")
    demand = body.get("demand")
    if demand is not None and not (isinstance(demand, dict) and isinstance(demand.get("buckets", {}), dict)
                                   and all(isinstance(b, dict) for b in demand.get("buckets", {}).values())):
        raise InvalidInput("demand", "must be an object {\"window_s\", \"buckets\": {key: {...}}}")
    replace = body.get("replace", False)
    if not isinstance(replace, bool):
        raise InvalidInput("replace", "must be true or false")
    held = {}
    for name, what in (("epochs", "region name"), ("owned", "replica id")):
        value = body.get(name) or {}
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()):
            raise InvalidInput(name, f"must be an object of {what} to integer epoch")
        held[name] = value
    region, url = validate_region(body.get("region")), normalize_url(body.get("url"))
    balancer_id = validate_balancer_id(body.get("id")) or default_balancer_id(url)
    return region, url, balancer_id, held["epochs"], held["owned"], replace


async def register_balancer(request: web.Request) -> web.Response:
    """POST /v1/balancers {"region", "url", "id"?, "epochs"?: {region: epoch}, "owned"?: {replica: epoch},
    "replace"?: bool, "demand"?} -> 200 with the balancer (register, or heartbeat when known).

    A region may run several balancers (siblings); ``id`` (default: the URL's host:port) tells them apart. Each
    registration, join or heartbeat, re-balances the ownership of replicas among the live ones
    (controller/ownership.py).

    ``demand`` (skylb/quota/demand.py: per quota bucket, what it was asked for over the last minute) comes from a
    balancer enforcing its share of every limit (no Redis); the answer then carries ``"quota_shares":
    {"default", "buckets": {key: share}}``, its shares computed from every live balancer's demand, siblings
    included (controller/shares.py).

    When another URL of the same region holds ``id`` and is live (healthy, not draining, heard from within
    LIVE_HEARTBEAT_S), the registration is refused 409 ``balancer_id_taken``, unless it says ``"replace": true`` and
    carries the admin token (else 401): then the live one is removed (its later heartbeats get 409) and this one
    takes the id. A balancer holding the id that is not live is replaced (the same balancer, restarted elsewhere).

    ``epochs`` are the region assignments the balancer holds, ``owned`` the replicas it owns (a replica it was
    handing over and no longer claims completes that handover). When one of them has since been given to another
    balancer at a higher epoch, the heartbeat is recorded but answered 409 ``stale_epoch``: the balancer must drop
    those replicas and re-read membership.
    """
    body = await _json_object(request)
    region, url, balancer_id, epochs, owned, replace = _registration(body)
    store = request.app[STORE]
    now = time.time()
    holders = [b for b in live_balancers(store.list_balancers(), now, LIVE_HEARTBEAT_S)
               if b.region == region and b.id == balancer_id and b.url != url]
    if holders and not replace:
        return _error(409, f"balancer id {balancer_id} of region {region} is held by a live balancer at "
                           f"{holders[0].url}; give this one another id (--balancer-id), remove that one (DELETE "
                           "/v1/balancers?url=...) or register with \"replace\": true and the admin token",
                      "balancer_id_taken")
    if holders and not is_admin(request):
        return _error(401, "replacing a live balancer needs the admin token", "authentication_error")
    for old in holders:
        store.remove_balancer(old.url)
        await _changed(request.app, "balancer_replaced", **old.to_dict(), by=url)
    balancer, changed = store.register_balancer(region, url, balancer_id=balancer_id, now=now)
    if changed:
        await _changed(request.app, "balancer_registered", **balancer.to_dict())
    if "owned" in body:  # a balancer that says what it holds confirms the replicas it let go
        await _owners_changed(request.app, confirm_released(store, balancer.url, owned))
    await _rebalance(request.app)
    stale = _stale(store, balancer.url, balancer.region, epochs, owned)
    if stale is not None:
        return stale
    if body.get("demand") is None:
        return web.json_response(balancer.to_dict())
    shares = request.app[SHARES]
    shares.report(balancer.url, body["demand"], now)
    live_urls = [b.url for b in live_balancers(store.list_balancers(), now, LIVE_HEARTBEAT_S)]
    return web.json_response({**balancer.to_dict(), "quota_shares": shares.shares_for(balancer.url, live_urls, now)})


def _stale(store: Store, url: str, region: str, epochs: dict[str, int], owned: dict[str, int]) -> web.Response | None:
    """The 409 ``stale_epoch`` answer when a region or a replica the balancer holds has moved on, else None."""
    regions = [a for a in store.assignments()
               if a.region in epochs and epochs[a.region] < a.epoch and a.balancer_region != region]
    replicas = stale_owned(owned, url, store.owners())
    if not regions and not replicas:
        return None
    log.warning("stale_epoch_rejected", balancer=url, region=region,
                held={**{a.region: epochs[a.region] for a in regions},
                      **{o.replica: owned[o.replica] for o in replicas}},
                current={**{a.region: [a.balancer_region, a.epoch] for a in regions},
                         **{o.replica: [o.balancer, o.epoch] for o in replicas}})
    detail = ", ".join([f"{a.region} (held epoch {epochs[a.region]}, now epoch {a.epoch} at {a.balancer_region}'s "
                        "balancer)" for a in regions] + [f"replica {o.replica} (held epoch {owned[o.replica]}, now "
                                                         f"epoch {o.epoch} at {o.balancer})" for o in replicas])
    return _error(409, f"stale epoch: this balancer no longer serves {detail}", "stale_epoch")


async def _rebalance(app: web.Application) -> None:
    """Re-plan replica ownership after a change of balancers or replicas; announce the ownerships that changed."""
    await _owners_changed(app, rebalance(app[STORE], now=time.time()))


async def _owners_changed(app: web.Application, moved: list) -> None:
    """Log each changed ownership, publish the revision and wake the DNS sync."""
    for o in moved:
        log.info("replica_owner_changed", replica=o.replica, balancer=o.balancer, epoch=o.epoch,
                 handover_to=o.handover_to)
    if moved:
        await _changed(app, "owners_changed", owners=[o.to_dict() for o in moved])
        for wake in app[DNS_WAKE]:
            await wake()


async def list_owners(request: web.Request) -> web.Response:
    """GET /v1/owners -> {"owners": [{"replica", "balancer", "epoch"}]}: which balancer pushes to each replica."""
    return web.json_response({"owners": [o.to_dict() for o in request.app[STORE].owners()]})


async def remove_balancer(request: web.Request) -> web.Response:
    """DELETE /v1/balancers?url=U -> 200 with the removed balancer; 404 when unknown (a running balancer registers
    again at its next heartbeat: stop it first)."""
    if not request.query.get("url"):
        raise InvalidInput("url", "required as a query parameter, e.g. ?url=http://10.0.0.2:8080")
    balancer = request.app[STORE].remove_balancer(request.query["url"])
    await _changed(request.app, "balancer_removed", **balancer.to_dict())
    await _rebalance(request.app)
    return web.json_response(balancer.to_dict())


async def drain_replica(request: web.Request) -> web.Response:
    """POST /v1/replicas/{id}/drain (or /undrain) -> 200 with the replica: no new requests reach a draining replica;
    its in-flight ones finish (``skylb-ctl replica drain`` watches its balancer until they have)."""
    draining = request.path.endswith("/drain")
    replica, changed = request.app[STORE].set_replica_draining(request.match_info["id"], draining)
    if changed:
        await _changed(request.app, "replica_draining" if draining else "replica_undrained", **replica.to_dict())
    return web.json_response(replica.to_dict())


async def drain_balancer(request: web.Request) -> web.Response:
    """POST /v1/regions/{region}/drain (or /undrain) -> {"balancers": [...]}: the region's balancers stop being
    live, so its replicas fail over to the closest live region's balancer (and DNS with them), and its queue is
    forwarded or finished; undrain brings them back."""
    draining = request.path.endswith("/drain")
    store = request.app[STORE]
    changed = store.set_balancer_draining(request.match_info["region"], draining)
    for b in changed:
        await _changed(request.app, "balancer_draining" if draining else "balancer_undrained", **b.to_dict())
    await _rebalance(request.app)
    return web.json_response({"balancers": [b.to_dict() for b in store.list_balancers()
                                            if b.region == request.match_info["region"]]})


async def list_assignments(request: web.Request) -> web.Response:
    """GET /v1/assignments -> {"assignments": [{"region", "balancer_region", "epoch"}]}."""
    return web.json_response({"assignments": [a.to_dict() for a in request.app[STORE].assignments()]})


def _quotas_answer(store: Store) -> dict:
    quotas, revision = store.quotas()
    return {"quotas": quotas_json(quotas), "revision": revision}


async def get_quotas(request: web.Request) -> web.Response:
    """GET /v1/quotas -> {"quotas": the document or null (balancers use their config's), "revision": the
    membership revision of its last change (0: never)}."""
    return web.json_response(_quotas_answer(request.app[STORE]))


async def set_quota(request: web.Request) -> web.Response:
    """POST /v1/quotas {one entry: controller/quotas.py} -> 200 {"quotas", "revision", "changed"}; 400 naming the
    bad field."""
    entry = await _json_object(request)
    store = request.app[STORE]
    _, changed = store.change_quotas(lambda current: set_entry(current, entry))
    if changed:
        await _changed(request.app, "quota_set", entry=entry)
    return web.json_response({**_quotas_answer(store), "changed": changed})


async def delete_quota(request: web.Request) -> web.Response:
    """DELETE /v1/quotas?tenant=T[&model=M] | ?model=M | ?group=G | ?all=true -> 200 {"quotas", "revision",
    "changed"}; 404 when the entry does not exist. ``all=true`` clears the document: balancers go back to their
    config's quotas."""
    query = dict(request.query)
    unknown = set(query) - {"tenant", "model", "group", "all"}
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "unknown parameter (expected tenant, model, group or all)")
    store = request.app[STORE]
    if "all" in query:
        if query.pop("all") not in ("true", "1") or query:
            raise InvalidInput("all", "must be true, and alone")
        _, changed = store.change_quotas(lambda current: None)
    else:
        _, changed = store.change_quotas(lambda current: remove_entry(current, **query))
    if changed:
        await _changed(request.app, "quota_deleted", **dict(request.query))
    return web.json_response({**_quotas_answer(store), "changed": changed})


async def _changed(app: web.Application, action: str, **fields: Any) -> None:
    revision = app[STORE].revision
    log.info("membership_change", action=action, revision=revision, **fields)
    await app[WATCH].publish(revision)


def create_app(store: Store, *, leadership: SoleLeader | EtcdElection | None = None,
               credentials: ControllerCredentials | None = None) -> web.Application:
    """The controller's aiohttp application over ``store`` (the caller owns and closes the store); ``leadership``
    (default: the sole leader) says whether this controller leads; ``credentials`` (default: none, an open API)
    are checked on every change (controller/auth.py)."""
    app = web.Application(middlewares=[_errors, auth_middleware])
    app[CREDENTIALS] = credentials or ControllerCredentials()
    app[THROTTLE] = GuessThrottle()
    app[DNS_WAKE] = []
    app[STORE] = store
    app[LEADERSHIP] = leadership or SoleLeader()
    app[WATCH] = RevisionWatch(store.revision)
    app[SHARES] = ShareBook()
    app[METRICS] = ControllerMetrics(store.snapshot, is_leader=lambda: app[LEADERSHIP].is_leader)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/membership", get_membership)
    app.router.add_get("/v1/replicas", list_replicas)
    app.router.add_post("/v1/replicas", add_replica)
    app.router.add_delete("/v1/replicas/{id}", remove_replica)
    app.router.add_post("/v1/replicas/{id}/drain", drain_replica)
    app.router.add_post("/v1/replicas/{id}/undrain", drain_replica)
    app.router.add_get("/v1/balancers", list_balancers)
    app.router.add_post("/v1/balancers", register_balancer)
    app.router.add_delete("/v1/balancers", remove_balancer)
    app.router.add_post("/v1/regions/{region}/drain", drain_balancer)
    app.router.add_post("/v1/regions/{region}/undrain", drain_balancer)
    app.router.add_get("/v1/assignments", list_assignments)
    app.router.add_get("/v1/owners", list_owners)
    app.router.add_get("/v1/quotas", get_quotas)
    app.router.add_post("/v1/quotas", set_quota)
    app.router.add_delete("/v1/quotas", delete_quota)
    status_view.add_routes(app, lambda: store.snapshot().to_dict(), admin_token=app[CREDENTIALS].admin_token,
                           peer_token=app[CREDENTIALS].peer_token, throttle=app[THROTTLE])  # the status page
    return app


async def _together(*coros: Awaitable[None]) -> None:
    """Run ``coros`` concurrently until all end; one failing, or this being cancelled, cancels the others."""
    async with asyncio.TaskGroup() as group:
        for coro in coros:
            group.create_task(coro)


async def serve(config: ControllerConfig, *, stop: asyncio.Event | None = None,
                credentials: ControllerCredentials | None = None, reloader: Reloader | None = None) -> None:
    """Serve until ``stop`` is set, then wake every watcher, finish in-flight requests and close the store.

    Without ``stop``, SIGTERM and SIGINT stop it (the `skylb controller` process); pass an event to embed the
    controller in another asyncio program, which keeps its own signal handling. ``credentials`` default to the
    config's and the environment's (auth.resolve_credentials; ValueError for an unreadable token file).
    ``reloader``: started once the controller serves (SIGHUP and watched files; controller/reload.py).
    """
    if credentials is None:
        credentials = resolve_credentials(config.admin_token, config.admin_token_file, config.peer_token)
    store = open_store(config)
    leadership = leadership_for(config)
    app = create_app(store, leadership=leadership, credentials=credentials)
    # GuardedAppRunner: deadlines on reading requests, idle keep-alive and a connection cap, as the balancer's
    # (skylb/listener.py): a client sending its head a byte a second would otherwise hold a connection for ever.
    runner = GuardedAppRunner(app, limits=config.client_connections, setting="controller.client_connections",
                              access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S)
    await runner.setup()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if stop is None else ()
    stop = stop or asyncio.Event()
    tasks: list[asyncio.Task] = []  # the health check (and failover), the DNS sync
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        log.info("controller_started", host=config.host, port=port, store=store.kind, db=config.db,
                 revision=store.revision, health_interval_s=config.health.interval_s if config.health.enabled else None)
        _warn_open(credentials)  # once it serves: a controller that cannot start says only why (one line)
        if reloader is not None:
            reloader.start()
        dns_sync = None
        if config.dns:  # imported here: dnspython is a tenth of a second of every controller's start without DNS
            from controller.dns import DnsUpdater
            from controller.dns_sync import DnsSync
            dns_sync = DnsSync(store, DnsUpdater(config.dns))
        if dns_sync is not None:
            app[DNS_WAKE].append(dns_sync.changed)

        def lead() -> Awaitable[None]:  # the leader's task, started at each election and cancelled at its end
            checker = HealthChecker(store, config.health, lambda action, fields: _changed(app, action, **fields),
                                    failover=config.failover, on_assignment=dns_sync and dns_sync.changed,
                                    metrics=app[METRICS])
            if dns_sync is None:
                return checker.run()
            return _together(checker.run(), dns_sync.run())  # only the leader writes DNS, as it fails over

        tasks.append(asyncio.create_task(leadership.run(lead if config.health.enabled else None)))
        if config.store == "etcd":  # other controllers' writes wake this one's long polls too
            tasks.append(asyncio.create_task(follow_revisions(store, app[WATCH].publish)))
        await stop.wait()
        log.info("controller_stopping")
        await app[WATCH].close()  # long polls answer now instead of holding shutdown for up to a minute
    finally:
        if reloader is not None and reloader.started:
            await reloader.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
        store.close()
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("controller_stopped")


def _warn_open(credentials: ControllerCredentials) -> None:
    """Say loudly which checks are off because their secret is not configured (README, "Security")."""
    if credentials.admin_token is None:
        log.warning("controller_api_open", detail="no admin token ($SKYLB_ADMIN_TOKEN, controller.admin_token): "
                    "membership changes are accepted from this machine only; set one to manage it from elsewhere")
    if credentials.peer_token is None:
        log.warning("balancer_registration_open", detail="no peer token ($SKYLB_PEER_TOKEN, controller.peer_token): "
                    "balancers may register from this machine only; set the balancers' peer token here too")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `skylb controller`: flags override the ``controller`` section of the config file."""
    parser.add_argument("--config", metavar="FILE", help="deployment YAML; its `controller` section is used "
                        "(default: built-in defaults, 127.0.0.1:8470)")
    parser.add_argument("--host", help="address to listen on (overrides the config)")
    parser.add_argument("--port", type=int, help="TCP port to listen on, 0 for any free port (overrides the config)")
    parser.add_argument("--db", metavar="PATH", help="SQLite membership file; its directory is created if missing "
                        "(overrides the config)")
    parser.add_argument("--store", choices=("sqlite", "etcd"), help="membership store: the SQLite file (one "
                        "controller) or etcd (several, one elected leader) (overrides the config)")
    parser.add_argument("--etcd-endpoints", metavar="URLS", help="etcd client URLs, comma-separated, e.g. "
                        "http://10.0.0.1:2379,http://10.0.0.2:2379 (overrides the config)")
    logs.add_arguments(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog is a list, one variable a line
    parser.epilog = (environment.epilog(environment.CONTROLLER_VARIABLES)
                     + "\nwithout an admin token or a peer token the API is open, with a warning")


def main(args: argparse.Namespace) -> int:
    """Run the controller until SIGTERM/SIGINT (SIGHUP reloads); returns 0, or 2 for a bad config or flag."""
    try:
        config, credentials = resolve(args)
        configure_logging(level=args.log_level)
    except (ConfigError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"skylb controller: {exc}", file=sys.stderr)
        return 2
    reload = Reload(args, config, credentials)
    gc_pauses.watch()
    gc_pauses.freeze_startup_heap()  # what is imported by now lives as long as the process (skylb/gc_pauses.py)
    try:
        aio.run(serve(config, credentials=credentials, reloader=Reloader(reload, reload.files)))
    except (OSError, sqlite3.Error, StoreError) as exc:  # address in use, db not writable, etcd unreachable, ...
        print(f"skylb controller: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # `python -m controller.server`, same flags as `skylb controller`
    _parser = argparse.ArgumentParser(prog="python -m controller.server", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
