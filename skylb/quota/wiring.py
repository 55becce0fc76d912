"""Quotas in a running balancer: the limit backend built from ``balancer.quota``, the gate, their upkeep loop and
their status. The Balancer calls these (a line each), so its module stays about the request flow.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import structlog

from skylb.quota.buckets import LimitBackend, LocalLimits
from skylb.quota.gate import QuotaGate
from skylb.quota.metrics import QuotaMetrics
from skylb.quota.redis_backend import RedisLimits
from skylb.quota.settings import QuotaSettings

if TYPE_CHECKING:
    from skylb.balancer.balancer import Balancer

__all__ = ["build_limits", "build_gate", "quota_loop", "quota_status", "regions_share", "UPKEEP_S", "REDIS_URL_ENV"]

#: Overrides ``balancer.quota.redis_url`` (a URL with a password belongs in the environment, not the config file).
REDIS_URL_ENV = "SKYLB_REDIS_URL"

#: How often the upkeep loop runs, s (lease renewal every third of ``slot_lease_s`` or sooner, Redis retries,
#: the share of the in-process buckets).
UPKEEP_S = 1.0

log = structlog.get_logger("skylb.quota")


def regions_share(balancer: "Balancer") -> float:
    """1 / the number of regions whose balancers this one knows in membership (itself and its live peers)."""
    return 1.0 / (1 + len(balancer.router.peers))


def build_limits(settings: QuotaSettings, balancer: "Balancer") -> LimitBackend:
    """RedisLimits when ``$SKYLB_REDIS_URL`` or ``settings.redis_url`` is set (its fallback share: ``local_share``,
    else the regions' share), else LocalLimits at ``local_share`` (else 1 until the upkeep loop reads membership)."""
    url = os.environ.get(REDIS_URL_ENV) or settings.redis_url
    if url:
        settings = settings.model_copy(update={"redis_url": url})
        share = settings.local_share if settings.local_share is not None else (lambda: regions_share(balancer))
        return RedisLimits(settings, share=share)
    return LocalLimits(settings.local_share or 1.0)


def build_gate(balancer: "Balancer") -> QuotaGate:
    """The balancer's QuotaGate: reads ``balancer.quotas`` and ``balancer.limits`` on every request, counts in the
    balancer's registry; its wait is ``quota.wait_s`` capped by ``queue_timeout_s``."""
    cfg = balancer.cfg
    gate: QuotaGate | None = None

    def fallback() -> bool | None:
        limits = balancer.limits
        return limits.falling_back if isinstance(limits, RedisLimits) else None

    metrics = QuotaMetrics(balancer.metrics.registry, region=balancer.region, levels=lambda: balancer.limits.levels(),
                           waiting=lambda: gate.waiting_now() if gate else {}, fallback=fallback)
    gate = QuotaGate(quotas=lambda: balancer.quotas, limits=lambda: balancer.limits, now=balancer.now,
                     metrics=metrics, region=balancer.region, wait_s=min(cfg.quota.wait_s, cfg.queue_timeout_s),
                     default_max_tokens=cfg.quota.default_max_tokens)
    listeners = getattr(balancer, "quota_listeners", None)  # Balancer.apply_quotas calls these (branch quota-ctl)
    if listeners is not None:
        listeners.append(gate.wake_all)
    return gate


async def quota_loop(balancer: "Balancer") -> None:
    """Upkeep until cancelled: renew Redis slot leases and retry an unreachable Redis (RedisLimits.maintain); keep
    the in-process buckets at the regions' share unless a share was set elsewhere (``local_share``, or the
    controller through ``set_share``). Closes the Redis client when cancelled."""
    limits = balancer.limits
    auto_share = getattr(limits, "share", None)
    settings = balancer.cfg.quota
    renew_every = min(UPKEEP_S, settings.slot_lease_s / 3)
    try:
        while True:
            limits = balancer.limits
            if isinstance(limits, RedisLimits):
                await limits.maintain(balancer.now())
            elif isinstance(limits, LocalLimits) and settings.local_share is None and limits.share == auto_share:
                auto_share = regions_share(balancer)
                limits.set_share(auto_share)
            await asyncio.sleep(renew_every)
    finally:
        if isinstance(balancer.limits, RedisLimits):
            await balancer.quota_gate.flush()
            await asyncio.shield(balancer.limits.close())


def quota_status(balancer: "Balancer") -> dict:
    """The ``quota`` field of the operator status: backend ("redis" or "local"), whether Redis is unreachable
    (``redis_fallback``; None without Redis), since when (s ago), the in-process share, requests waiting by tenant,
    and the bucket levels."""
    limits = balancer.limits
    redis = isinstance(limits, RedisLimits)
    local = limits.fallback if redis else limits
    since = limits.fallback_since if redis else None
    return {"backend": "redis" if redis else "local",
            "redis_fallback": limits.falling_back if redis else None,
            "redis_fallback_for_s": None if since is None else round(balancer.now() - since, 3),
            "share": limits.share_now() if redis else getattr(local, "share", None),
            "waiting": balancer.quota_gate.waiting_now(),
            "levels": {key: {k: round(v, 3) for k, v in values.items()} for key, values in limits.levels().items()}}
