"""Stage 2, authenticate and classify: the request's tenant (from its API key) and priority class.

Rules: skylb/quota/priorities.py ("Why I Built a Priority Queue for Ollama": embeddings critical by path,
``X-Priority``, the tenant's default class). A forwarded request, whose peer token the parse stage checked, keeps the
class and tenant its first balancer gave it (X-SkyLB-Priority, X-SkyLB-Tenant); from a client those headers are
ignored. Answers 400 for an ``X-Priority`` other than high, normal or low while priority classes are on.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from aiohttp import web

from skylb.balancer.auth import tenant_of
from skylb.balancer.stages.context import RequestContext
from skylb.quota.limits import Quotas
from skylb.quota.priorities import (PEER_PRIORITY_HEADER, PEER_TENANT_HEADER, PRIORITY_HEADER, BadPriority,
                                    classify, peer_class)

__all__ = ["ClassifyStage", "classify_request"]


def classify_request(request: web.Request, *, forwarded: bool, quotas: Quotas, use_header: bool) -> tuple[str, str]:
    """(priority class, tenant) of ``request``; ``forwarded``: it came from a peer whose token was checked;
    ``quotas``: those in force (a tenant's default class); ``use_header``: priority classes are on here.
    Raises BadPriority for an X-Priority other than high, normal or low while ``use_header``."""
    priority = tenant = None
    if forwarded:
        headers = request.headers
        priority, tenant = peer_class(headers.get(PEER_PRIORITY_HEADER), headers.get(PEER_TENANT_HEADER))
    tenant = tenant or tenant_of(request)
    if priority is None:
        priority = classify(request.path, request.headers.get(PRIORITY_HEADER), quotas.tenant(tenant).priority,
                            use_header=use_header)
    return priority, tenant


class ClassifyStage:
    """Sets ``ctx.priority`` and ``ctx.tenant``. ``quotas()``: the quotas in force; ``priorities_enabled``: whether
    clients may choose a class with ``X-Priority``."""

    name = "classify"

    def __init__(self, *, quotas: Callable[[], Quotas], priorities_enabled: bool):
        self.quotas = quotas
        self.priorities_enabled = priorities_enabled

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        try:
            ctx.priority, ctx.tenant = classify_request(ctx.http, forwarded=ctx.forwarded, quotas=self.quotas(),
                                                        use_header=self.priorities_enabled)
        except BadPriority as exc:
            return ctx.reject(400, str(exc), "bad_priority")
        structlog.contextvars.bind_contextvars(tenant=ctx.tenant)  # on the request's later lines (its task only)
        return None
