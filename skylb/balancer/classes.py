"""The pipeline's side of priority classes: a request's (priority class, tenant), from the client or a peer.

Rules: skylb/quota/priorities.py (seed 003: embeddings critical by path, ``X-Priority``, the tenant's default
class). A forwarded request that passed the peer token check keeps the class and tenant its first balancer gave it
(X-SkyLB-Priority, X-SkyLB-Tenant); from a client those headers are ignored.
"""

from __future__ import annotations

from aiohttp import web

from skylb.balancer.auth import tenant_of
from skylb.quota.priorities import PEER_PRIORITY_HEADER, PEER_TENANT_HEADER, PRIORITY_HEADER, classify, peer_class

__all__ = ["classify_request"]


def classify_request(balancer, request: web.Request, *, forwarded: bool) -> tuple[str, str]:
    """(priority class, tenant) of ``request``; ``forwarded``: it came from a peer whose token was checked.

    ``balancer``: the Balancer (its ``cfg.priorities`` and ``quotas``). Raises BadPriority (the client gets 400)
    for an X-Priority other than high, normal or low while priority classes are on."""
    priority = tenant = None
    if forwarded:
        headers = request.headers
        priority, tenant = peer_class(headers.get(PEER_PRIORITY_HEADER), headers.get(PEER_TENANT_HEADER))
    tenant = tenant or tenant_of(request)
    if priority is None:
        priority = classify(request.path, request.headers.get(PRIORITY_HEADER),
                            balancer.quotas.tenant(tenant).priority, use_header=balancer.cfg.priorities.enabled)
    return priority, tenant
