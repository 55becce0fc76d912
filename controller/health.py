"""The controller's active health check of replicas (issue 9, item 1; SkyLB paper §4.2 "Service controller").

Every ``interval_s`` each registered replica is probed through its engine adapter (skylb/engines: the same probe a
balancer uses for load, so "healthy" means the same thing to both). Rise and fall as in HAProxy's ``check``:
``fall`` failures in a row mark a healthy replica unhealthy, ``rise`` successes in a row bring it back; a replica
starts healthy (it was just registered by an operator). A change of verdict is a membership revision, so every
balancer sees it through its watch and takes the replica out of (or back into) its candidates.

Counters live in memory: a restarted controller starts each replica from its stored verdict with empty counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog

from controller.store import MembershipStore, Replica
from skylb.config import HealthCheck
from skylb.engines import adapter_for

__all__ = ["HealthChecker"]

log = structlog.get_logger("skylb.controller")

#: Called with (action, the replica as a dict) after a verdict changed and the store bumped its revision.
OnChange = Callable[[str, dict], Awaitable[None]]


@dataclass
class _Streak:
    """Consecutive results of one replica's checks: ``ok`` True for a success streak, ``count`` its length."""

    ok: bool = True
    count: int = 0


class HealthChecker:
    """Checks every replica of ``store`` forever (``run``), recording verdict changes and calling ``on_change``.

    Args:
        store: the membership store (read each round, so added and removed replicas are followed).
        config: interval, timeout, rise and fall (skylb/config.py ``HealthCheck``).
        on_change: awaited after each verdict change (the server publishes the new revision to watchers).
    """

    def __init__(self, store: MembershipStore, config: HealthCheck, on_change: OnChange):
        self.store = store
        self.config = config
        self.on_change = on_change
        self._streaks: dict[str, _Streak] = {}

    async def run(self) -> None:
        """Check every replica each ``interval_s`` until cancelled; a failing check never stops the loop."""
        async with aiohttp.ClientSession() as session:
            while True:
                started = asyncio.get_running_loop().time()
                await self.check_all(session)
                elapsed = asyncio.get_running_loop().time() - started
                await asyncio.sleep(max(0.0, self.config.interval_s - elapsed))

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One round: probe every replica concurrently, then apply the results in replica order."""
        replicas = self.store.list_replicas()
        known = {r.id for r in replicas}
        for gone in set(self._streaks) - known:
            del self._streaks[gone]
        results = await asyncio.gather(*(self._probe(session, r) for r in replicas))
        for replica, ok in zip(replicas, results):
            await self._record(replica, ok)

    async def _probe(self, session: aiohttp.ClientSession, replica: Replica) -> bool:
        try:
            adapter = adapter_for(replica.engine)
            result = await asyncio.wait_for(
                adapter.probe(session, replica.url, timeout_s=self.config.timeout_s,
                              max_concurrency=replica.max_concurrency),
                self.config.timeout_s * 2)
            return bool(result.healthy)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False

    async def _record(self, replica: Replica, ok: bool) -> None:
        streak = self._streaks.setdefault(replica.id, _Streak(ok=replica.healthy))
        if streak.ok == ok:
            streak.count += 1
        else:
            streak.ok, streak.count = ok, 1
        needed = self.config.rise if ok else self.config.fall
        if ok == replica.healthy or streak.count < needed:
            return
        changed = self.store.set_replica_health(replica.id, ok)
        if changed is not None:
            action = "replica_healthy" if ok else "replica_unhealthy"
            log.info("health_change", replica=replica.id, region=replica.region, url=replica.url, healthy=ok,
                     streak=streak.count)
            await self.on_change(action, changed.to_dict())
