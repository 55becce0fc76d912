"""The whole system as the controller's status page draws it: ``GET /skylb/v1/status`` (the membership at one
revision joined with every registered balancer's own status) and the page itself at ``GET /``
(skylb/status_page: login form, session cookie, protected mode).

The controller asks each balancer for ``/skylb/v1/status?format=json`` with its peer token, all at once, each within
STATUS_TIMEOUT_S; a balancer that does not answer is shown unreachable with the reason, its figures null.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from controller.ctl_views import system_status
from skylb import status_page
from skylb.tokens import GuessThrottle, from_this_machine

__all__ = ["STATUS_TIMEOUT_S", "balancer_statuses", "system_view", "handle_status", "add_routes"]

#: How long the controller waits for one balancer's status (s).
STATUS_TIMEOUT_S = 2.0
#: The client session to the balancers.
_HTTP = web.AppKey("status_http", aiohttp.ClientSession)


async def _one_status(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      timeout_s: float) -> tuple[dict | None, str | None]:
    try:
        async with session.get(f"{url.rstrip('/')}/skylb/v1/status", params={"format": "json"}, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None, f"HTTP {resp.status}" + (": the controller's peer token is missing or differs"
                                                            if resp.status == 403 else "")
            return await resp.json(), None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return None, "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc).splitlines()[0][:200]


async def balancer_statuses(session: aiohttp.ClientSession, urls: list[str], peer_token: str | None,
                            timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, tuple[dict | None, str | None]]:
    """{url: (the balancer's operator status, None) or (None, why it could not be read)}, asked concurrently."""
    headers = {"X-SkyLB-Token": peer_token} if peer_token else {}
    answers = await asyncio.gather(*(_one_status(session, url, headers, timeout_s) for url in urls))
    return dict(zip(urls, answers))


def system_view(membership: dict, statuses: dict[str, tuple[dict | None, str | None]], now: float) -> dict:
    """The page's data: ``ctl_views.system_status`` (regions with their assignment and epoch, balancers, replicas)
    plus ``"source": "controller"``, ``"time"`` (``now``, unix s: when the view was taken), each replica's
    ``kv_usage`` (0-1 or None), each balancer's ``peers`` ([{"region", "forwarded" (requests forwarded there since
    it started), "queue_len", "available"}]) and ``quota`` (its quota status: backend, share, waiting, bucket
    levels; None when unreachable), and ``quotas`` (the controller's quota document or None)."""
    view = system_status(membership, statuses)
    live_replicas = {r["id"]: r for status, _ in statuses.values() if status for r in status.get("replicas", [])}
    for replica in view["replicas"]:
        replica["kv_usage"] = live_replicas.get(replica["id"], {}).get("kv_usage")
    for balancer in view["balancers"]:
        status = statuses.get(balancer["url"], (None, None))[0] or {}
        balancer["peers"] = [{k: p.get(k) for k in ("region", "forwarded", "queue_len", "available")}
                             for p in status.get("peers", [])]
        balancer["quota"] = status.get("quota")
    return {"source": "controller", "time": round(now, 3), **view, "quotas": membership.get("quotas")}


async def handle_status(request: web.Request) -> web.Response:
    """``GET /skylb/v1/status`` -> ``system_view`` of the membership now; for the status page's session, the admin
    token (``Authorization: Bearer``), or, with no admin token configured, this machine only. Else 401 (403 in
    protected mode) in the controller's error shape."""
    access = request.app[status_page.ACCESS]
    if not access.allowed(request):
        code = 403 if access.token is None and not from_this_machine(request.remote) else 401
        message = ("no admin token is configured, so the status answers this machine only" if code == 403
                   else "the status needs the status page's session or the admin token (Authorization: Bearer)")
        return web.json_response({"error": {"message": message, "type": "authentication_error", "code": code}},
                                 status=code)
    source = request.app[_SOURCE]
    membership = source.membership()
    urls = [b["url"] for b in membership["balancers"]]
    statuses = await balancer_statuses(request.app[_HTTP], urls, source.peer_token)
    return web.json_response(system_view(membership, statuses, time.time()))


@dataclass(frozen=True)
class _Source:
    """Where the view comes from: the membership snapshot now (as JSON) and the token the balancers ask for."""

    membership: Callable[[], dict]
    peer_token: str | None = field(default=None, repr=False)


_SOURCE = web.AppKey("status_source", _Source)


async def _client_session(app: web.Application) -> Any:
    async with aiohttp.ClientSession() as session:
        app[_HTTP] = session
        yield


def add_routes(app: web.Application, membership: Callable[[], dict], *, admin_token: str | None,
               peer_token: str | None, throttle: GuessThrottle | None = None) -> None:
    """Serve the status page on ``app``: ``/`` (guarded by ``admin_token``), ``/skylb/v1/status`` over
    ``membership()`` (the store's snapshot as JSON), the login, logout and asset routes; the balancers' statuses are
    asked with ``peer_token``; the login's wrong tokens count on ``throttle`` (the controller's; default: its own)."""
    app[status_page.ACCESS] = status_page.PageAccess(admin_token, "the admin token", "controller",
                                                     throttle=throttle or GuessThrottle())
    app[_SOURCE] = _Source(membership, peer_token)
    app.cleanup_ctx.append(_client_session)
    app.router.add_get("/", status_page.handle_page)
    app.router.add_get("/skylb/v1/status", handle_status)
    app.add_routes(status_page.ROUTES)
