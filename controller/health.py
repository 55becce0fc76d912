"""The controller's active health check of replicas and balancers, and the failover it drives (SkyLB paper §4.2
"Service controller" and "Failure recovery of load balancers").

Each registered replica is probed through its engine adapter (skylb/engines: the same probe a balancer uses for
load, so "healthy" means the same thing to both); each balancer on ``GET /healthz``. Rise and fall as in HAProxy's
``check``: ``fall`` failures in a row mark a healthy target unhealthy, ``rise`` successes in a row bring it back; a
target is checked every ``interval_s`` (``inter``), and every ``fastinter_s`` while a verdict is changing (after a
first result that disagrees with it), so a dead balancer is found in ``interval_s + (fall - 1) * fastinter_s`` at
worst. A change of verdict is a membership revision; after each round the failover plan (controller/failover.py)
reassigns regions whose balancers are all down or draining, and back, then replica ownership is re-balanced among
the live balancers (controller/ownership.py): a sibling's death moves its replicas to its region's survivors, and
only the last one's moves the region to another region.

Counters live in memory: a restarted controller starts each target from its stored verdict with empty counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog

from controller.failover import plan_assignments
from controller.metrics import ControllerMetrics
from controller.ownership import rebalance
from controller.store import Assignment, Balancer, MembershipStore, Replica
from skylb.config import Failover, HealthCheck
from skylb.engines import adapter_for

__all__ = ["HealthChecker"]

log = structlog.get_logger("skylb.controller")

#: Called with (action, the changed replica, balancer or assignment as a dict) after the store bumped its revision.
OnChange = Callable[[str, dict], Awaitable[None]]
#: Called with each new assignment (after OnChange), e.g. to point the region's DNS name at its new balancer; and
#: with None when a balancer's verdict or replica owners changed (a region's set of live balancers did).
OnAssignment = Callable[[Assignment | None], Awaitable[None]]

#: Shortest sleep between two rounds (s): bounds the loop's rate whatever the settings.
_MIN_SLEEP_S = 0.05


@dataclass
class _Streak:
    """Consecutive results of one target's checks: ``ok`` True for a success streak, ``count`` its length;
    ``next_at`` the loop time (s) of its next check."""

    ok: bool = True
    count: int = 0
    next_at: float = 0.0


class HealthChecker:
    """Checks every replica and balancer of ``store`` forever (``run``), recording verdict changes, calling
    ``on_change``, and reassigning regions whose balancers are all down.

    Args:
        store: the membership store (read each round, so added and removed targets are followed).
        config: interval, fastinter, timeout, rise and fall (skylb/config.py ``HealthCheck``).
        on_change: awaited after each verdict or assignment change (the server publishes the new revision).
        failover: the failover settings (None or ``enabled: false``: balancers are checked, regions never move).
        on_assignment: awaited after each assignment change (DNS updates).
        metrics: where checks and failovers are counted (None: not counted).
    """

    def __init__(self, store: MembershipStore, config: HealthCheck, on_change: OnChange, *,
                 failover: Failover | None = None, on_assignment: OnAssignment | None = None,
                 metrics: ControllerMetrics | None = None):
        self.store = store
        self.metrics = metrics
        self.config = config
        self.on_change = on_change
        self.failover = failover
        self.on_assignment = on_assignment
        self._streaks: dict[str, _Streak] = {}

    async def run(self) -> None:
        """Check each target when due until cancelled; a failing check never stops the loop."""
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            await self.plan_failover()  # a controller restarted mid-failure resumes from the stored verdicts
            await self.plan_owners()
            while True:
                await self.check_due(session, loop.time())
                next_at = min((s.next_at for s in self._streaks.values()), default=loop.time() + self.config.interval_s)
                await asyncio.sleep(max(_MIN_SLEEP_S, next_at - loop.time()))

    async def check_due(self, session: aiohttp.ClientSession, now: float) -> None:
        """One round: probe every target whose check is due concurrently, then apply the results in order."""
        replicas = self.store.list_replicas()
        balancers = self.store.list_balancers()
        targets = [(f"replica {r.id}", r) for r in replicas] + [(f"balancer {b.url}", b) for b in balancers]
        known = {key for key, _ in targets}
        for gone in set(self._streaks) - known:
            del self._streaks[gone]
        due = [(key, t) for key, t in targets if self._streak(key, t).next_at <= now]
        results = await asyncio.gather(*(self._probe(session, t) for _, t in due))
        for (key, target), ok in zip(due, results):
            if self.metrics is not None:
                self.metrics.checked("balancer" if isinstance(target, Balancer) else "replica", target.region, ok)
            await self._record(key, target, ok, asyncio.get_running_loop().time())
        # Every round, not only after a verdict change here: an operator's drain also changes which regions are live.
        await self.plan_failover()
        await self.plan_owners()

    async def plan_owners(self) -> None:
        """Re-balance replica ownership among the live balancers (after failover moved any region)."""
        moved = rebalance(self.store, now=time.time())
        for o in moved:
            log.info("replica_owner_changed", replica=o.replica, balancer=o.balancer, epoch=o.epoch,
                     handover_to=o.handover_to)
        if moved:
            await self.on_change("owners_changed", {"owners": [o.to_dict() for o in moved]})
            await self._hook(None)

    async def plan_failover(self) -> None:
        """Apply the failover plan: assign every region whose serving region should change (epoch + 1 each)."""
        if self.failover is None or not self.failover.enabled:
            return
        current = self.store.assignments()
        plan = plan_assignments(current, self.store.list_balancers(), self.failover)
        for a in current:
            if plan[a.region] == a.balancer_region:
                continue
            new = self.store.assign(a.region, plan[a.region])
            if new is None:
                continue
            if self.metrics is not None:
                self.metrics.reassigned(new.region, new.balancer_region)
            action = "region_failed_back" if new.balancer_region == new.region else "region_failed_over"
            log.info("failover", region=new.region, balancer_region=new.balancer_region, epoch=new.epoch,
                     previous=a.balancer_region)
            await self.on_change(action, new.to_dict())
            await self._hook(new)

    async def _hook(self, assignment: Assignment | None) -> None:
        if self.on_assignment is not None:
            try:
                await self.on_assignment(assignment)
            except Exception:  # DNS down must not stop health checks; the next change retries it
                log.exception("assignment_hook_failed", region=assignment and assignment.region)

    def _streak(self, key: str, target: Replica | Balancer) -> _Streak:
        return self._streaks.setdefault(key, _Streak(ok=target.healthy))

    async def _probe(self, session: aiohttp.ClientSession, target: Replica | Balancer) -> bool:
        timeout_s = self.config.timeout_s
        try:
            if isinstance(target, Balancer):
                async with session.get(f"{target.url}/healthz",
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    return resp.status == 200
            adapter = adapter_for(target.engine)
            result = await asyncio.wait_for(
                adapter.probe(session, target.url, timeout_s=timeout_s, max_concurrency=target.max_concurrency),
                timeout_s * 2)
            return bool(result.healthy)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False

    async def _record(self, key: str, target: Replica | Balancer, ok: bool, now: float) -> bool:
        """Count one result; store and announce a verdict change. Returns True when the verdict changed."""
        streak = self._streak(key, target)
        if streak.ok == ok:
            streak.count += 1
        else:
            streak.ok, streak.count = ok, 1
        needed = self.config.rise if ok else self.config.fall
        changing = ok != target.healthy
        verdict = changing and streak.count >= needed
        # While the verdict is changing, check again sooner (HAProxy's fastinter).
        streak.next_at = now + (self.config.fastinter_s if changing and not verdict else self.config.interval_s)
        if not verdict:
            return False
        if isinstance(target, Balancer):
            changed = self.store.set_balancer_health(target.url, ok)
            kind, name = "balancer", target.url
        else:
            changed = self.store.set_replica_health(target.id, ok)
            kind, name = "replica", target.id
        if changed is None:
            return False
        log.info("health_change", target=kind, name=name, region=target.region, healthy=ok, streak=streak.count)
        await self.on_change(f"{kind}_{'healthy' if ok else 'unhealthy'}", changed.to_dict())
        if kind == "balancer":
            await self._hook(None)  # the region's DNS answer lists its healthy balancers
        return True
