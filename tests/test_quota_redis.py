"""RedisLimits against a real redis-server: the Lua scripts follow LocalLimits' arithmetic exactly, slots are
leased, and an unreachable Redis falls back at once to the balancer's share (skylb/quota/redis_backend.py)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from skylb.quota.buckets import LocalLimits
from skylb.quota.limits import Limit
from skylb.quota.redis_backend import RedisLimits
from skylb.quota.settings import QuotaSettings
from tests.redis import start_redis


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server for one test (tests/redis.py)."""
    with start_redis(tmp_path) as server:
        yield server


def _limits(url: str, clock=None, **settings) -> RedisLimits:
    return RedisLimits(QuotaSettings(redis_url=url, key_prefix=f"t{random.random()}:", **settings), clock=clock)


BUCKETS = [
    [("tenant/a/m", Limit(tokens_per_minute=1000, requests_per_minute=20, max_concurrent=3)),
     ("model/m", Limit(tokens_per_minute=3000, max_concurrent=5))],
    [("tenant/a/*", Limit(requests_per_minute=6)), ("model/m", Limit(tokens_per_minute=3000, max_concurrent=5))],
    [("tenant/b/m", Limit(tokens_per_minute=500)), ("model/m", Limit(tokens_per_minute=3000, max_concurrent=5))],
]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lua_scripts_grant_what_local_limits_grant(redis_server, seed):
    """The same random sequence of acquires, releases and refunds, at the same times, gets the same grants (same
    refusing bucket, reason and wait) and leaves the same levels in Redis as in LocalLimits."""
    async def main():
        rng = random.Random(seed)
        t = {"now": 1_000.0}
        remote = _limits(redis_server.url, clock=lambda: t["now"], slot_lease_s=3600)
        local = LocalLimits()
        held: list[tuple[list, object]] = []
        admitted = refused = 0
        try:
            for _ in range(300):
                t["now"] += rng.choice([0.0, 0.01, 0.3, 1.0, 4.0])
                now = t["now"]
                if held and rng.random() < 0.4:
                    buckets, grant = held.pop(rng.randrange(len(held)))
                    refund = rng.choice([0, 0, 50, 5000])
                    local.release_now(buckets, now, refund_tokens=refund)
                    await remote.release(buckets, now, refund_tokens=refund, grant=grant)
                    continue
                buckets = rng.choice(BUCKETS)
                tokens = rng.choice([1, 40, 200, 700, 5000])
                want = local.acquire_now(buckets, tokens, now)
                got = await remote.acquire(buckets, tokens, now)
                assert (got.ok, got.key, got.reason) == (want.ok, want.key, want.reason), (want, got)
                assert (got.wait_s is None) == (want.wait_s is None)
                if want.wait_s is not None:
                    assert math.isclose(got.wait_s, want.wait_s, rel_tol=1e-12, abs_tol=1e-9)
                if got.ok:
                    admitted += 1
                    held.append((buckets, got))
                else:
                    refused += 1
                for key, _ in buckets:
                    mine, theirs = local.levels()[key], remote.levels()[key]
                    assert math.isclose(mine["tokens"], theirs["tokens"], rel_tol=1e-12, abs_tol=1e-9)
                    assert math.isclose(mine["requests"], theirs["requests"], rel_tol=1e-12, abs_tol=1e-9)
                    assert mine["in_flight"] == theirs["in_flight"], key
            assert admitted > 20 and refused > 20  # the sequence exercised both paths
            assert not remote.falling_back and remote.failures == 0
        finally:
            await remote.close()
    asyncio.run(main())


def test_redis_limits_are_shared_between_two_balancers(redis_server):
    """Two RedisLimits on one Redis (two balancers) draw on one bucket: together they admit the limit, no more."""
    async def main():
        one, two = _limits(redis_server.url), _limits(redis_server.url)
        two.prefix = one.prefix
        buckets = [("tenant/a/m", Limit(requests_per_minute=10))]
        try:
            grants = [await (one if i % 2 else two).acquire(buckets, 1, 0.0) for i in range(16)]
            assert sum(g.ok for g in grants) == 10
            refused = grants[-1]
            assert refused.reason == "requests_per_minute" and 0 < refused.wait_s <= 6.0
        finally:
            await one.close()
            await two.close()
    asyncio.run(main())


def test_slot_leases_expire_unless_renewed(redis_server):
    """A slot held by a balancer that stops renewing (it died) expires with its lease; renewal keeps it."""
    async def main():
        t = {"now": 0.0}
        alive, dead = (_limits(redis_server.url, clock=lambda: t["now"], slot_lease_s=10) for _ in range(2))
        dead.prefix = alive.prefix
        buckets = [("model/m", Limit(max_concurrent=2))]
        try:
            assert (await alive.acquire(buckets, 1, 0.0)).ok and (await dead.acquire(buckets, 1, 0.0)).ok
            assert (await alive.acquire(buckets, 1, 0.0)).reason == "max_concurrent"
            for step in range(1, 5):  # 20 s: alive renews every 5 s, dead never does
                t["now"] = step * 5.0
                await alive.maintain(t["now"])
            grant = await alive.acquire(buckets, 1, t["now"])
            assert grant.ok, "the dead balancer's slot should have expired"
            assert (await alive.acquire(buckets, 1, t["now"])).reason == "max_concurrent"  # alive's first is held
        finally:
            await alive.close()
            await dead.close()
    asyncio.run(main())


def test_unreachable_redis_falls_back_to_the_share_and_recovers(redis_server):
    """With Redis stopped, acquire answers at once from a LocalLimits holding this balancer's share (half of a
    limit of 10 requests: 5), counts the failure, and after redis_retry_s Redis is used again."""
    async def main():
        limits = _limits(redis_server.url, redis_retry_s=1.0, redis_timeout_s=0.3, redis_connect_timeout_s=0.3)
        limits.set_share(0.5)
        buckets = [("tenant/a/m", Limit(requests_per_minute=10))]
        try:
            assert (await limits.acquire(buckets, 1, 0.0)).ok and not limits.falling_back
            redis_server.stop()
            loop = asyncio.get_running_loop()
            started = loop.time()
            grants = [await limits.acquire(buckets, 1, 0.1) for _ in range(8)]
            assert loop.time() - started < 2.0  # one failed call, then local answers without Redis
            assert limits.falling_back and limits.failures >= 1
            assert sum(g.ok for g in grants) == 5 and all(g.local for g in grants)
            await limits.release(buckets, 0.2, grant=grants[0])  # a local admission is released locally
            redis_server.start()
            await limits.maintain(0.5)  # before redis_retry_s: still falling back, Redis not tried
            assert limits.falling_back
            await limits.maintain(1.5)
            assert not limits.falling_back
            # Redis kept its bucket (no persistence: it restarted empty, so full again).
            assert (await limits.acquire(buckets, 1, 2.0)).ok and not limits.falling_back
        finally:
            await limits.close()
    asyncio.run(main())


def test_overrun_during_an_outage_stays_within_the_documented_bound(redis_server):
    """Two balancers drain a limit of L=20 requests/min through Redis, then Redis dies: each falls back to its
    half, so within the minute they admit at most L more (the bound: 2 L plus refill per window with one switch),
    and keep admitting (not 0)."""
    async def main():
        kw = dict(redis_retry_s=30.0, redis_timeout_s=0.3, redis_connect_timeout_s=0.3)
        one, two = _limits(redis_server.url, **kw), _limits(redis_server.url, **kw)
        two.prefix = one.prefix
        for limits in (one, two):
            limits.set_share(0.5)
        buckets = [("tenant/a/m", Limit(requests_per_minute=20))]
        try:
            before = [await (one, two)[i % 2].acquire(buckets, 1, 0.0) for i in range(40)]
            assert sum(g.ok for g in before) == 20
            redis_server.stop()
            during = [await (one, two)[i % 2].acquire(buckets, 1, 0.0) for i in range(40)]
            assert one.falling_back and two.falling_back
            assert 1 <= sum(g.ok for g in during) <= 20
            assert sum(g.ok for g in before + during) <= 2 * 20
        finally:
            await one.close()
            await two.close()
    asyncio.run(main())


def test_a_slot_freed_on_another_balancer_admits_a_waiter_here(redis_server):
    """Two gates on one Redis (two balancers): a request waiting here for a concurrency slot held by the other
    balancer is admitted after that balancer releases it (seen at the next re-check, no event crosses balancers),
    and the slot count in Redis returns to 0."""
    from skylb.quota.gate import QuotaGate
    from skylb.quota.limits import Quotas, TenantQuota

    async def main():
        one, two = _limits(redis_server.url), _limits(redis_server.url)
        two.prefix = one.prefix
        quotas = Quotas(tenants={"a": TenantQuota(limits={"*": Limit(max_concurrent=1)})})
        loop = asyncio.get_running_loop()
        gates = [QuotaGate(quotas=lambda: quotas, limits=lambda lim=lim: lim, now=loop.time) for lim in (one, two)]
        try:
            holder = await gates[0].admit("a", "m", 1, deadline=loop.time())
            assert holder is not None and holder.grant.slot
            waiter = asyncio.create_task(gates[1].admit("a", "m", 1, deadline=loop.time() + 10))
            await asyncio.sleep(0.3)
            assert not waiter.done() and gates[1].waiting_now() == {"a": 1}
            gates[0].release(holder)
            await gates[0].flush()
            admitted = await asyncio.wait_for(waiter, 3.0)
            gates[1].release(admitted)
            await gates[1].flush()
            assert await one.client.zcard(f"{one.prefix}s:tenant/a/*") == 0
        finally:
            await one.close()
            await two.close()
    asyncio.run(main())
