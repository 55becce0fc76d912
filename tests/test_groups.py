"""Model groups (skylb/quota/groups.py): WDRR arithmetic, the age bonus, jittered waits, and the gate through the
in-process LimitBackend."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skylb.quota.buckets import LocalLimits
from skylb.quota.groups import (AGE_BONUS_TOKENS_PER_S, Admitted, ModelGate, Refused, Waiter, Wdrr,
                                blocked_by_elder, jittered_wait_ms)
from skylb.quota.limits import Limit, Quotas, TenantQuota


def test_wdrr_interleaves_by_weight():
    w = Wdrr()
    members = {"a": 3.0, "b": 1.0}
    picks = []
    for _ in range(8):
        m = w.pick(members, 100, members)
        w.charge(m, 100)
        picks.append(m)
    assert picks == ["a", "a", "a", "b", "a", "a", "a", "b"]


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 5), min_size=2, max_size=5),
       sizes=st.lists(st.integers(1, 4000), min_size=100, max_size=100))
def test_wdrr_token_share_follows_weights(weights, sizes):
    """Over many requests of mixed sizes, each model's share of tokens is close to its share of weight."""
    members = {f"m{i}": float(wt) for i, wt in enumerate(weights)}
    w = Wdrr()
    served = Counter()
    for size in sizes * 5:
        m = w.pick(members, size, members)
        w.charge(m, size)
        served[m] += size
    total, wsum = sum(served.values()), sum(weights)
    for m, wt in members.items():
        # Within one round's worth of the largest request per model (DRR's bound), relative to the total.
        assert abs(served[m] / total - wt / wsum) < 0.12


def test_wdrr_skips_inadmissible_and_refused_models():
    w = Wdrr()
    members = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert w.pick(members, 10, set()) is None
    assert w.pick(members, 10, {"b"}) == "b"
    w.deficits["c"] = 500.0
    w.refused("c")
    assert w.deficits["c"] == 0.0
    # A huge request is served at once (rounds skipped in closed form), never starved by the arithmetic.
    m = w.pick(members, 10**9, {"a", "c"})
    assert m in {"a", "c"} and w.deficits[m] >= 10**9


def test_age_bonus_makes_old_large_waiters_go_first():
    big = Waiter(tokens=5000, since=0.0)
    small = Waiter(tokens=10, since=4.0)
    # At t=4 s the big one has 4000 tokens of credit: not ripe, so the small one may pass.
    assert not blocked_by_elder([big, small], small, now=4.0)
    # At t=5 s it is ripe: younger waiters and callers holding no place wait for it.
    assert blocked_by_elder([big, small], small, now=5.0 + 1e-9)
    assert blocked_by_elder([big, small], None, now=5.0 + 1e-9)
    assert not blocked_by_elder([big, small], big, now=5.0 + 1e-9)
    assert 5000 / AGE_BONUS_TOKENS_PER_S == 5.0


def test_jittered_wait_is_within_ten_percent_and_aligned():
    rng = random.Random(1)
    for base_s in (0.0, 0.01, 0.25, 1.234, 30.0):
        for _ in range(50):
            ms = jittered_wait_ms(base_s, rng.random())
            assert ms % 100 == 0 or ms == 50
            assert ms >= 50
            assert ms >= base_s * 900 - 1e-6 and ms <= base_s * 1100 + 100
    assert jittered_wait_ms(1.0, 0.0) == 900 and jittered_wait_ms(1.0, 0.9999) == 1100


def _gate(quotas: Quotas, served=None, limits=None):
    limits = limits or LocalLimits()
    return ModelGate(quotas=lambda: quotas, limits=lambda: limits, served=lambda api: served,
                     now=lambda: asyncio.get_running_loop().time()), limits


def test_gate_respects_caps_and_spreads():
    quotas = Quotas(groups={"fast": {"a": 3, "b": 1}},
                    models={"a": Limit(max_concurrent=2), "b": Limit(max_concurrent=1)})

    async def run():
        gate, limits = _gate(quotas)
        held = []
        for _ in range(3):
            held.append(await gate.try_admit("fast", 10, "default"))
        assert sorted(a.model for a in held) == ["a", "a", "b"]
        refused = await gate.try_admit("fast", 10, "default")
        assert isinstance(refused, Refused) and refused.reason == "max_concurrent"
        await gate.release(held[0])
        await gate.release(held[0])  # idempotent
        again = await gate.try_admit("fast", 10, "default")
        assert isinstance(again, Admitted) and again.model == "a"
        assert limits.levels()["model/a"]["in_flight"] == 2.0
    asyncio.run(run())


def test_gate_tokens_per_minute_and_refund():
    quotas = Quotas(groups={"g": {"a": 1}}, models={"a": Limit(tokens_per_minute=600)},
                    tenants={"t": TenantQuota(limits={"*": Limit(max_concurrent=5)})})

    async def run():
        gate, limits = _gate(quotas)
        first = await gate.try_admit("g", 500, "t")
        assert isinstance(first, Admitted)
        assert [k for k, _ in first.buckets] == ["tenant/t/*", "model/a"]
        refused = await gate.try_admit("g", 500, "t")
        # 400 tokens missing at 10 tokens/s: about 40 s.
        assert isinstance(refused, Refused) and refused.reason == "tokens_per_minute"
        assert 39 < refused.wait_s <= 40.1
        await gate.release(first, refund_tokens=450)
        assert isinstance(await gate.try_admit("g", 500, "t"), Admitted)
    asyncio.run(run())


def test_gate_waits_for_a_release_then_times_out():
    quotas = Quotas(groups={"g": {"a": 1, "b": 1}},
                    models={"a": Limit(max_concurrent=1), "b": Limit(max_concurrent=1)})

    async def run():
        gate, _ = _gate(quotas)
        one = await gate.admit("g", 10, "default", wait_s=1.0)
        two = await gate.admit("g", 10, "default", wait_s=1.0)
        assert {one.model, two.model} == {"a", "b"}
        waiting = asyncio.create_task(gate.admit("g", 10, "default", wait_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await gate.release(two)
        third = await asyncio.wait_for(waiting, 2.0)
        assert isinstance(third, Admitted) and third.model == two.model
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timed_out = await gate.admit("g", 10, "default", wait_s=0.3)
        assert isinstance(timed_out, Refused) and 0.3 <= loop.time() - t0 < 2.0
    asyncio.run(run())


def test_gate_only_served_models():
    quotas = Quotas(groups={"g": {"a": 1, "b": 1}})

    async def run():
        gate, _ = _gate(quotas, served={"b"})
        for _ in range(3):
            assert (await gate.try_admit("g", 10, "default")).model == "b"
        gate_none, _ = _gate(quotas, served=set())
        refused = await gate_none.try_admit("g", 10, "default")
        assert isinstance(refused, Refused) and not refused.served
    asyncio.run(run())


@pytest.mark.parametrize("plain", ["a"])
def test_gate_plain_model_is_a_group_of_one(plain):
    gate, _ = _gate(Quotas(models={"a": Limit(max_concurrent=1)}))

    async def run():
        first = await gate.try_admit(plain, 10, "default")
        assert first.model == "a" and not gate.is_group("a")
        assert isinstance(await gate.try_admit(plain, 10, "default"), Refused)
    asyncio.run(run())


def test_lease_table_lifecycle():
    from skylb.quota.leases import LeaseTable
    table = LeaseTable(max_leases=2)
    admitted = Admitted("a", [], 10)
    lease = table.add(admitted, name="g", tenant="t", ttl_s=1.0, now=0.0)
    assert table.get(lease.id, 0.5) is lease and table.get("nope", 0.5) is None
    assert table.heartbeat(lease.id, 0.9) is lease and lease.expires_at == 1.9
    assert table.pop_expired(1.5) == [] and table.get(lease.id, 1.95) is None
    other = table.add(admitted, name="g", tenant="t", ttl_s=1.0, now=1.0)
    assert table.full() is True
    assert table.pop(other.id, 1.2) is other and table.pop(other.id, 1.2) is None
    assert table.pop_expired(2.0) == [lease] and len(table) == 0


def test_advice_follows_the_seed_formula():
    from skylb.quota.leases import AdviceWindow
    window = AdviceWindow(window_s=60.0)
    idle = window.advice(0.0, in_flight=0, capacity=20)
    assert (idle.backpressure_score, idle.suggested_parallelism) == (0.0, 20)
    for i in range(10):
        window.record(float(i), None)
    for i in range(10):
        window.record(10.0 + i, 1000 if i < 9 else 5000)
    hot = window.advice(20.0, in_flight=10, capacity=20)
    # p95 of ten waits (nine of 1000 ms, one of 5000 ms) is 5000 ms -> 1; admit rate 0.5 -> score 0.75.
    assert hot.p95_wait_ms == 5000 and hot.admit_rate == 0.5 and hot.backpressure_score == 0.75
    assert hot.suggested_parallelism == 10 + round(10 * 0.25)
    # A minute later the window is empty again; the floor of 4 holds; no caps: double while no pressure.
    later = window.advice(80.0, in_flight=1, capacity=2)
    assert later.backpressure_score == 0.0 and later.suggested_parallelism == 4
    assert window.advice(80.0, in_flight=10, capacity=None).suggested_parallelism == 20
