"""Outlier detection in the routing core (skylb/core/outlier.py): Envoy's consecutive counts, ejection time x
ejections, max_ejection_percent, the panic threshold, and retries that avoid the target that failed them."""

from __future__ import annotations

import pytest

from skylb.core import Request, Router, make_policy
from skylb.core.outlier import OutlierDetector
from skylb.core.state import AvailabilityRules


def _router(replicas: int = 2, **outlier) -> Router:
    router = Router(region="us", policy=make_policy("skylb"),
                    rules=AvailabilityRules(max_dispatch_per_probe=0, stale_after_s=1e9),
                    outlier=OutlierDetector(**outlier))
    router.set_replicas([(f"r{i}", f"http://r{i}", "vllm") for i in range(replicas)])
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True)
    return router


def _decision(router: Router, target: str, now: float = 0.0):
    router.enqueue(Request(f"q{now}", "x", arrived_at=now))
    [d] = router.dispatch(now)
    router.finished(d)
    return type(d)(d.request, "local", target, f"http://{target}", 0.0, now)


@pytest.mark.parametrize("gateway_after, five_after, gateway, ejected_at", [
    (5, 5, True, 5),      # Envoy's defaults: the fifth gateway failure in a row ejects
    (1, 5, True, 1),
    (5, 3, False, 3),     # plain 5xx answers count only toward consecutive_5xx
    (0, 0, True, None),   # 0: never
])
def test_consecutive_failures_eject(gateway_after, five_after, gateway, ejected_at):
    """A target is ejected at the configured count of consecutive failures; an answer in between resets the run."""
    router = _router(replicas=10, consecutive_gateway_failure=gateway_after, consecutive_5xx=five_after)
    d = _decision(router, "r0")
    if ejected_at != 1:  # a failure, then an answer: the run starts again
        router.target_failed(d, now=1.0, gateway=gateway)
        router.target_answered(d)
    ejected = [router.target_failed(d, now=1.0, gateway=gateway) for _ in range(6)]
    assert (ejected.index(True) + 1 if True in ejected else None) == ejected_at
    reason = router.replica_unavailable_reason(router.replicas["r0"], 1.5)
    assert reason == ("ejected (outlier detection)" if ejected_at else None)


def test_ejection_lasts_base_time_times_ejections_then_the_target_returns():
    """The n-th ejection lasts n x base_ejection_time (at most max_ejection_time); a probe does not end it early."""
    router = _router(replicas=10, consecutive_gateway_failure=1, base_ejection_time_s=30, max_ejection_time_s=50,
                     interval_s=1000)
    d = _decision(router, "r0")
    r0 = router.replicas["r0"]
    assert router.target_failed(d, now=0.0)
    router.observe_replica("r0", now=10.0, healthy=True)
    assert not router.replica_available(r0, 29.9)
    assert router.replica_available(r0, 30.0)
    assert router.target_failed(d, now=31.0)  # the second ejection: 60 s, capped at 50
    assert not router.replica_available(r0, 80.9) and router.replica_available(r0, 81.0)


def test_the_ejection_count_decays_per_interval_spent_un_ejected():
    """Each interval_s spent un-ejected takes one off the multiplier (Envoy), so an old ejection is forgiven."""
    router = _router(replicas=10, consecutive_gateway_failure=1, base_ejection_time_s=30, interval_s=10)
    d = _decision(router, "r0")
    router.target_failed(d, now=0.0)   # until 30, count 1
    router.target_failed(d, now=31.0)  # count 2: until 91
    router.target_failed(d, now=200.0)  # 109 s un-ejected: the count decays to 0, then this one makes it 1
    assert router.replicas["r0"].ejected_until == 230.0


@pytest.mark.parametrize("replicas, percent, allowed", [(2, 10, 1), (10, 10, 1), (25, 10, 2), (20, 50, 10)])
def test_max_ejection_percent_rounds_down_but_allows_one(replicas, percent, allowed):
    """At most max_ejection_percent of the replicas are ejected at once, rounded down, but at least one."""
    router = _router(replicas=replicas, consecutive_gateway_failure=1, max_ejection_percent=percent,
                     healthy_panic_threshold=0)
    ejected = [router.target_failed(_decision(router, rid), now=1.0) for rid in list(router.replicas)]
    assert sum(ejected) == allowed


def test_panic_ignores_ejection_when_fewer_than_half_are_healthy():
    """With fewer than healthy_panic_threshold % healthy and un-ejected replicas, ejected ones take requests again."""
    router = _router(replicas=4, consecutive_gateway_failure=1, max_ejection_percent=100)
    router.target_failed(_decision(router, "r0"), now=1.0)
    router.target_failed(_decision(router, "r1"), now=1.0)
    assert not router.replica_available(router.replicas["r0"], 2.0)  # 2 of 4 usable: 50 %, not below it
    router.observe_replica("r2", now=2.0, healthy=False, error="down")
    assert router.replica_available(router.replicas["r0"], 2.5)  # 1 of 4: panic, ejection ignored


def test_a_retry_avoids_the_target_that_failed_it_while_another_is_usable():
    """A request whose attempt failed on r0 goes to r1, even when r1 is busy (it waits), never back to r0; with no
    other usable target it may go back to r0."""
    router = _router(replicas=2)
    router.observe_replica("r1", now=1.0, healthy=True, pending=2)  # r1 busy: r0 alone is available
    request = Request("q", "x", arrived_at=1.0, avoid=frozenset({("local", "r0")}))
    router.requeue(request)
    assert router.dispatch(1.0) == []
    router.observe_replica("r1", now=2.0, healthy=True, pending=0)
    [d] = router.dispatch(2.0)
    assert d.target == "r1"
    router.finished(d)
    router.observe_replica("r1", now=3.0, healthy=False, error="down")
    router.requeue(Request("q2", "x", arrived_at=3.0, avoid=frozenset({("local", "r0")})))
    [d] = router.dispatch(3.0)
    assert d.target == "r0"
