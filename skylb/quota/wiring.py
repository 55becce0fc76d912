"""Quotas in a running balancer: the limit backend built from ``balancer.quota``, the gate, their upkeep loop and
their status. The Balancer calls these (a line each) with the parts they need, so its module stays about the
request flow.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import structlog

from skylb.quota.buckets import LimitBackend, LocalLimits
from skylb.quota.gate import QuotaGate
from skylb.quota.metrics import QuotaMetrics
from skylb.quota.settings import QuotaSettings
from skylb.quota.limits import Quotas

__all__ = ["build_limits", "build_gate", "quota_loop", "quota_status", "UPKEEP_S"]

#: How often the upkeep loop runs, s (lease renewal every third of ``slot_lease_s`` or sooner, Redis retries,
#: the share of the in-process buckets).
UPKEEP_S = 1.0

log = structlog.get_logger("skylb.quota")


def build_limits(settings: QuotaSettings, *, regions_share: Callable[[], float]) -> LimitBackend:
    """RedisLimits when ``settings.redis_url`` is set (the settings layer puts ``$SKYLB_REDIS_URL`` there; its
    fallback share: ``local_share``, else ``regions_share()``: 1 / the regions whose balancers this one knows), else
    LocalLimits at ``local_share`` (else 1 until the upkeep loop reads membership)."""
    if settings.redis_url:
        from skylb.quota.redis_backend import RedisLimits  # here: redis-py's import is 0.2 s of a balancer's start
        return RedisLimits(settings, share=settings.local_share if settings.local_share is not None else regions_share)
    return LocalLimits(settings.local_share or 1.0)


def _is_redis(limits: LimitBackend) -> bool:
    """True for a RedisLimits, checked without importing redis-py (a balancer without Redis never loads it)."""
    module = sys.modules.get("skylb.quota.redis_backend")
    return module is not None and isinstance(limits, module.RedisLimits)


def build_gate(settings: QuotaSettings, *, quotas: Callable[[], Quotas], limits: LimitBackend,
               now: Callable[[], float], registry, region: str, queue_timeout_s: float,
               tenant_label: Callable[[str], str] = lambda tenant: tenant) -> QuotaGate:
    """The balancer's QuotaGate: reads ``quotas()`` (those in force) and ``limits`` on every request, counts in
    ``registry`` (a prometheus CollectorRegistry, tenants labelled by ``tenant_label``); its wait is
    ``settings.wait_s`` capped by ``queue_timeout_s``."""
    gate: QuotaGate | None = None

    def fallback() -> bool | None:
        return limits.falling_back if _is_redis(limits) else None

    metrics = QuotaMetrics(registry, region=region, levels=limits.levels,
                           waiting=lambda: gate.waiting_now() if gate else {}, fallback=fallback,
                           tenant_label=tenant_label)
    gate = QuotaGate(quotas=quotas, limits=lambda: limits, now=now, metrics=metrics, region=region,
                     wait_s=min(settings.wait_s, queue_timeout_s), default_max_tokens=settings.default_max_tokens)
    return gate


async def quota_loop(settings: QuotaSettings, *, limits: LimitBackend, gate: QuotaGate, now: Callable[[], float],
                     regions_share: Callable[[], float]) -> None:
    """Upkeep until cancelled: renew Redis slot leases and retry an unreachable Redis (RedisLimits.maintain); keep
    the in-process buckets at ``regions_share()`` unless a share was set elsewhere (``local_share``, or the
    controller through ``set_share``). Closes the Redis client when cancelled."""
    auto_share = getattr(limits, "share", None)
    renew_every = min(UPKEEP_S, settings.slot_lease_s / 3)
    try:
        while True:
            if _is_redis(limits):
                await limits.maintain(now())
            elif isinstance(limits, LocalLimits) and settings.local_share is None and limits.share == auto_share:
                auto_share = regions_share()
                limits.set_share(auto_share)
            await asyncio.sleep(renew_every)
    finally:
        if _is_redis(limits):
            await gate.flush()
            await asyncio.shield(limits.close())


def quota_status(limits: LimitBackend, gate: QuotaGate, now: float) -> dict:
    """The ``quota`` field of the operator status: backend ("redis" or "local"), whether Redis is unreachable
    (``redis_fallback``; None without Redis), since when (s ago, ``now`` on the balancer's clock), the in-process
    share, requests waiting by tenant, and the bucket levels."""
    redis = _is_redis(limits)
    local = limits.fallback if redis else limits
    since = limits.fallback_since if redis else None
    return {"backend": "redis" if redis else "local",
            "redis_fallback": limits.falling_back if redis else None,
            "redis_fallback_for_s": None if since is None else round(now - since, 3),
            "share": limits.share_now() if redis else getattr(local, "share", None),
            "waiting": gate.waiting_now(),
            "levels": {key: {k: round(v, 3) for k, v in values.items()} for key, values in limits.levels().items()}}
