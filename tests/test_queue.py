"""Priority classes and tenants in the router's queue (pure core: skylb/core/queue.py through Router)."""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skylb.config import BalancerConfig
from skylb.core import AvailabilityRules, Request, Router, build_router, make_policy
from skylb.core.queue import ClassQueue
from skylb.core.request import PRIORITIES


def _router(*, slots=1, aging_s=0.0, weights=None, policy="skylb"):
    """A router with priority classes and one replica r0 that takes ``slots`` requests at a time."""
    router = Router(region="us", policy=make_policy(policy), rules=AvailabilityRules(max_dispatch_per_probe=0),
                    priorities=True, aging_s=aging_s)
    router.set_replicas([("r0", "http://r0", "vllm")], max_concurrency={"r0": slots})
    if weights is not None:
        router.set_tenant_weights(lambda tenant: weights.get(tenant, 1.0))
    _probe(router, 0.0)
    return router


def _probe(router, now):
    router.observe_replica("r0", now=now, healthy=True, pending=0, running=0)


def _drain(router, now, n=None):
    """Place requests one at a time (the replica has one slot, freed after each), up to ``n``; their ids in order."""
    out = []
    while router.queue and (n is None or len(out) < n):
        _probe(router, now)
        decisions = router.dispatch(now)
        assert len(decisions) == 1, "one slot: one placement per pass"
        out.append(decisions[0].request.id)
        router.finished(decisions[0])
    return out


def _req(rid, at, priority="normal", tenant="default", **kw):
    return Request(rid, "x", arrived_at=at, priority=priority, tenant=tenant, **kw)


def test_classes_go_in_strict_order_whatever_the_arrival_order():
    """critical, then high, then normal, then low, though they arrived the other way round."""
    router = _router()
    router.set_replicas([("r0", "http://r0", "vllm")], max_concurrency={"r0": 1})
    for i, p in enumerate(reversed(PRIORITIES)):
        router.enqueue(_req(p, 0.01 * i, p))
    assert _drain(router, 0.1) == ["critical", "high", "normal", "low"]


def test_first_come_first_served_inside_a_tenant():
    """One class, one tenant: arrival order; a forwarded request takes its place by age (queued_since)."""
    router = _router()
    for i in range(5):
        router.enqueue(_req(f"n{i}", 1.0 + i))
    router.enqueue(_req("fwd", 6.0, forwarded_from="eu", waited_s=3.5))  # joined at 2.5
    assert [r.id for r in router.queue] == ["n0", "n1", "fwd", "n2", "n3", "n4"]
    assert _drain(router, 6.1) == ["n0", "n1", "fwd", "n2", "n3", "n4"]


def test_aging_lifts_a_waiting_request_one_class_per_aging_s():
    """aging_s 10: a low request that waited 10 s competes as normal, 20 s as high (oldest first among equals);
    strict classes (aging_s 0) never let it past a high one."""
    for aging_s, expected in ((10.0, ["old-low", "high", "normal"]), (0.0, ["high", "normal", "old-low"])):
        router = _router(aging_s=aging_s)
        router.enqueue(_req("old-low", 0.0, "low"))
        router.enqueue(_req("normal", 15.0, "normal"))
        router.enqueue(_req("high", 15.0, "high"))
        _probe(router, 21.0)
        # At 21 s old-low waited 21 s: two steps, so it is "high", older than the high request: it goes first.
        assert _drain(router, 21.0) == expected


def test_one_aging_step_competes_with_the_class_above_by_age():
    """After one step a low request competes as normal: ahead of a younger normal one, behind a high one."""
    router = _router(aging_s=10.0)
    router.enqueue(_req("low", 0.0, "low"))
    router.enqueue(_req("normal", 5.0, "normal"))
    router.enqueue(_req("high", 5.0, "high"))
    assert _drain(router, 12.0) == ["high", "low", "normal"]


def test_tenants_share_a_class_by_weight_under_saturation():
    """Weights 2:1, both tenants always backlogged: 2:1 placements, each tenant in its own arrival order."""
    router = _router(weights={"a": 2.0, "b": 1.0})
    for i in range(60):
        router.enqueue(_req(f"a{i}", i * 0.001, tenant="a"))
        router.enqueue(_req(f"b{i}", i * 0.001 + 0.0005, tenant="b"))
    placed = _drain(router, 1.0, n=60)
    counts = Counter(p[0] for p in placed)
    assert counts == {"a": 40, "b": 20}
    for tenant in "ab":  # FCFS inside a tenant
        mine = [int(p[1:]) for p in placed if p[0] == tenant]
        assert mine == sorted(mine) == list(range(len(mine)))
    # Every window of 3 placements holds 2 of a and 1 of b: shares hold at every moment, not just on average.
    for k in range(0, 60, 3):
        assert Counter(p[0] for p in placed[k:k + 3]) == {"a": 2, "b": 1}


def test_weights_are_read_through_the_setter_and_changes_apply():
    """Equal weights share 1:1; after set_tenant_weights(3:1) the next placements go 3:1; fractional weights work."""
    router = _router()
    for i in range(200):
        router.enqueue(_req(f"a{i}", i, tenant="a"))
        router.enqueue(_req(f"b{i}", i + 0.5, tenant="b"))
    assert Counter(p[0] for p in _drain(router, 1000.0, n=20)) == {"a": 10, "b": 10}
    router.set_tenant_weights({"a": 0.75, "b": 0.25}.get)
    placed = _drain(router, 1000.0, n=40)
    assert Counter(p[0] for p in placed) == {"a": 30, "b": 10}


def test_a_tenant_alone_uses_the_whole_class_and_an_idle_one_banks_nothing():
    """Work conserving: a lone tenant takes every slot; a tenant that was idle does not get a burst for it."""
    router = _router(weights={"a": 1.0, "b": 1.0})
    for i in range(10):
        router.enqueue(_req(f"a{i}", i, tenant="a"))
    assert _drain(router, 20.0, n=6) == [f"a{i}" for i in range(6)]
    for i in range(4):
        router.enqueue(_req(f"b{i}", 20 + i, tenant="b"))
    assert Counter(p[0] for p in _drain(router, 30.0, n=6)) == {"a": 3, "b": 3}


def test_expire_removes_overdue_requests_of_every_class_and_tenant():
    """Expiry counts from queued_since in every class and tenant, leaves the rest in order and keeps counts."""
    router = _router()
    router.enqueue(_req("c-old", 0.0, "critical", "a"))
    router.enqueue(_req("n-old", 1.0, "normal", "b"))
    router.enqueue(_req("l-fwd", 9.0, "low", "a", forwarded_from="eu", waited_s=8.5))  # joined at 0.5
    router.enqueue(_req("n-new", 8.0, "normal", "b"))
    router.enqueue(_req("h-new", 8.5, "high", "c"))
    router.requeue(_req("retry-old", 0.2, "high", "c"))
    assert router.queue_age_s(10.0) == pytest.approx(10.0)
    expired = router.expire(now=10.0, timeout_s=5.0)
    assert sorted(r.id for r in expired) == ["c-old", "l-fwd", "n-old", "retry-old"]
    assert len(router.queue) == 2 and router.queue_age_s(10.0) == pytest.approx(2.0)
    assert router.classes.lengths() == {("high", "c"): 1, ("normal", "b"): 1}
    assert _drain(router, 10.0) == ["h-new", "n-new"]
    assert router.expire(now=100.0, timeout_s=5.0) == [] and router.queue_age_s(100.0) == 0.0


def test_a_retried_request_goes_to_the_front_of_its_class_only():
    """requeue: ahead of every tenant of its class (though younger than some), never ahead of a higher class."""
    router = _router(weights={"a": 1.0, "b": 1.0})
    router.enqueue(_req("a0", 0.0, tenant="a"))
    router.enqueue(_req("b0", 0.1, tenant="b"))
    router.enqueue(_req("crit", 0.3, "critical"))
    router.requeue(_req("retried", 0.2, tenant="b"))
    assert _drain(router, 1.0) == ["crit", "retried", "a0", "b0"]


def test_cancel_removes_a_queued_request_and_its_tenant_leaves_the_rotation():
    router = _router()
    router.enqueue(_req("a0", 0.0, tenant="a"))
    router.enqueue(_req("b0", 0.1, tenant="b"))
    router.requeue(_req("r0", 0.0, tenant="b"))
    assert router.cancel("b0") and router.cancel("r0") and not router.cancel("b0")
    assert router.classes.lengths() == {("normal", "a"): 1}
    assert _drain(router, 1.0) == ["a0"]


def test_look_ahead_stays_inside_the_chosen_tenant():
    """A look-ahead policy chooses among the chosen head's tenant's requests only (its window), never a later
    request of another class or tenant."""
    q = ClassQueue()
    for i in range(3):
        q.add(_req(f"a{i}", i, tenant="a"))
        q.add(_req(f"b{i}", i + 0.5, tenant="b"))
    q.add(_req("low", 0.1, "low", tenant="a"))
    window = q.window(10.0, 8)
    assert [r.id for r in window] == ["a0", "a1", "a2"]
    q.take(10.0, window[2])  # the policy picked a2
    assert [r.id for r in q if r.tenant == "a"] == ["a0", "a1", "low"]


def test_the_queue_is_fcfs_unless_priorities_are_enabled():
    """Off by default: the router's queue is the plain FCFS deque; balancer.priorities.enabled turns classes on."""
    assert isinstance(build_router("us", BalancerConfig()).queue, deque)
    router = build_router("us", BalancerConfig(priorities={"enabled": True, "aging_s": 7}))
    assert isinstance(router.queue, ClassQueue) and router.queue.aging_s == 7
    with pytest.raises(ValueError):
        BalancerConfig(priorities={"enabled": True, "aging": 7})  # extra="forbid"


def test_a_fcfs_router_ignores_class_and_tenant():
    """With priorities off the class and tenant fields change nothing: arrival order."""
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([("r0", "http://r0", "vllm")], max_concurrency={"r0": 1})
    _probe(router, 0.0)
    for i, p in enumerate(reversed(PRIORITIES)):
        router.enqueue(_req(p, 0.01 * i, p, tenant=f"t{i}"))
    assert _drain(router, 0.1) == list(reversed(PRIORITIES))


_ops = st.lists(st.tuples(st.sampled_from(["add", "retry", "place", "cancel", "expire"]),
                          st.sampled_from(PRIORITIES), st.sampled_from(["a", "b", "c"]),
                          st.floats(0, 3), st.integers(0, 50)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, aging_s=st.sampled_from([0.0, 2.0]))
def test_every_request_leaves_exactly_once_and_tenants_stay_fcfs(ops, aging_s):
    """Any mix of adds, retries, placements, cancels and expiries: each request leaves the queue exactly once, the
    length always matches, and a tenant's fresh requests of one class are placed in arrival order."""
    router = _router(slots=1, aging_s=aging_s, weights={"a": 2.0, "b": 1.0, "c": 0.5})
    now, n, left, queued = 0.0, 0, [], {}
    placed_fresh: dict[tuple[str, str], list[int]] = {}
    for op, priority, tenant, dt, pick in ops:
        now += dt
        if op in ("add", "retry"):
            req = _req(f"q{n}", now - (dt if op == "retry" else 0.0), priority, tenant)
            req.fresh = op == "add"
            req.seq = n
            n += 1
            (router.requeue if op == "retry" else router.enqueue)(req)
            queued[req.id] = req
        elif op == "place" and router.queue:
            _probe(router, now)
            [d] = router.dispatch(now)
            router.finished(d)
            left.append(d.request.id)
            queued.pop(d.request.id)
            if d.request.fresh:
                placed_fresh.setdefault((d.request.priority, d.request.tenant), []).append(d.request.seq)
        elif op == "cancel" and queued:
            rid = sorted(queued)[pick % len(queued)]
            assert router.cancel(rid)
            left.append(queued.pop(rid).id)
        elif op == "expire":
            for r in router.expire(now, 2.5):
                left.append(r.id)
                queued.pop(r.id)
        assert len(router.queue) == len(queued) == sum(router.classes.lengths().values())
        assert {r.id for r in router.queue} == set(queued)
    assert len(left) == len(set(left))
    for seqs in placed_fresh.values():
        assert seqs == sorted(seqs)


def test_deficit_round_robin_counts_cost_not_requests():
    """Equal weights, a's requests cost 3 and b's 1 (e.g. estimated tokens): b places 3 requests per one of a's."""
    router = _router()
    for i in range(40):
        router.enqueue(_req(f"a{i}", i, tenant="a", cost=3.0))
        router.enqueue(_req(f"b{i}", i + 0.5, tenant="b", cost=1.0))
    placed = _drain(router, 100.0, n=40)
    assert Counter(p[0] for p in placed) == {"a": 10, "b": 30}
