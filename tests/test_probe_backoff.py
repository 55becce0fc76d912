"""Adaptive probing (skylb/balancer/probe_backoff.py): when an answer counts as foreseen, how the interval doubles
and comes back, and the staleness grace the availability rules give a backed-off target. The live behaviour (an
idle balancer's targets backed off, foreign load bringing a replica back) is in tests/test_static.py."""

from __future__ import annotations

import pytest

from skylb.balancer.probe_backoff import ProbeBackoff, peer_summary, replica_foreseen
from skylb.core import PeerState, ReplicaState
from skylb.core.state import AvailabilityRules


def test_foreseen_answers_double_the_interval_up_to_the_ceiling_and_any_other_resets_it():
    backoff, key = ProbeBackoff(0.1, max_factor=8), ("replica", "r1")
    assert backoff.due(key, 0.0) and backoff.factor(key) == 1
    graces = [backoff.answered(key, sent_at=t, foreseen=True) for t in (0.0, 0.2, 0.6, 1.4, 2.2)]
    assert graces == pytest.approx([0.1, 0.3, 0.7, 0.7, 0.7])
    assert backoff.factor(key) == 8
    assert not backoff.due(key, 2.2 + 0.6) and backoff.due(key, 2.2 + 0.75)  # half an interval early at most
    assert backoff.answered(key, sent_at=3.0, foreseen=False) == 0.0 and backoff.factor(key) == 1
    backoff.answered(key, sent_at=3.1, foreseen=True)
    backoff.reset(key)
    assert backoff.due(key, 3.1) and backoff.factor(key) == 1
    backoff.answered(key, sent_at=3.2, foreseen=True)
    backoff.answered(("peer", "eu"), sent_at=3.2, foreseen=True)
    backoff.forget("peer", set())
    assert backoff.factor(("peer", "eu")) == 1 and backoff.factor(key) == 2  # only the kind named is forgotten


def test_no_backoff_when_the_ceiling_is_one_interval():
    backoff = ProbeBackoff(0.1, max_factor=1)
    assert backoff.answered(("replica", "r"), sent_at=0.0, foreseen=True) == 0.0
    assert backoff.due(("replica", "r"), 0.1)


def _replica(outstanding: int, pending: int, running: int | None, **fields) -> ReplicaState:
    state = ReplicaState(**{"id": "r", "url": "http://r", "healthy": True, "probed_at": 1.0, "pending": pending,
                            "running": running, "outstanding": outstanding, **fields})
    state.capacity.saturated, state.capacity.limit = True, 4
    return state


@pytest.mark.parametrize("outstanding, pending, running, foreseen", [
    (0, 0, 0, True),    # idle, nothing sent
    (3, 0, 3, True),    # exactly this balancer's requests
    (3, 0, 2, True),    # one ended in the engine, its last bytes still on their way
    (3, 0, 1, False),   # two fewer: something this balancer does not know
    (2, 0, 3, False),   # a request this balancer did not send (another balancer, a direct client)
    (0, 1, None, False),  # an engine without a batch count: waiting it was not sent
])
def test_a_replica_answer_is_foreseen_when_it_shows_only_this_balancers_requests(outstanding, pending, running,
                                                                                 foreseen):
    assert replica_foreseen(_replica(outstanding, pending, running), outstanding, limit_before=4) is foreseen


def test_learning_the_capacity_failures_and_ill_health_keep_the_interval_short():
    assert not replica_foreseen(_replica(1, 0, 1, healthy=False), 1, 4)
    assert not replica_foreseen(_replica(1, 0, 1, consecutive_5xx=1), 1, 4)
    assert not replica_foreseen(_replica(1, 0, 1, ejected_until=9.0), 1, 4)  # ejected until after this answer
    assert replica_foreseen(_replica(1, 0, 1, ejected_until=0.5), 1, 4)  # an ejection that ended before it
    slow_start = _replica(2, 0, 2)
    slow_start.capacity.saturated = False
    assert not replica_foreseen(slow_start, 2, limit_before=2)  # a batch at the limit: each probe raises it
    assert replica_foreseen(slow_start, 2, limit_before=3)
    retest = _replica(4, 0, 4)
    retest.capacity.trial_from, retest.capacity.limit = 4, 5
    assert not replica_foreseen(retest, 4, 5)
    idle_retest = _replica(0, 0, 0)
    idle_retest.capacity.trial_from = 4
    assert replica_foreseen(idle_retest, 0, 4)  # nothing to decide it with until the batch is back at the limit
    held_back = _replica(4, 1, 3)  # waiting beside a batch below the limit: the engine's KV cache, say
    assert not replica_foreseen(held_back, 4, 4)
    allowance = _replica(5, 1, 4)  # the batch at the limit and the one request pending_allowance lets wait
    assert replica_foreseen(allowance, 5, 4)


def test_a_peer_summary_changes_with_what_a_decision_reads():
    peer = PeerState(region="eu", url="http://eu", healthy=True, available_replicas=2, replicas=4)
    before = peer_summary(peer)
    assert peer_summary(peer) == before
    peer.queue_len = 1
    assert peer_summary(peer) != before
    sibling = PeerState(region="us", url="http://us-b", healthy=True, sibling=True)
    before = peer_summary(sibling)
    sibling.prefixes.merge([1, 2], seq=2)  # a sibling placed new prompts: what it holds changed
    assert peer_summary(sibling) != before


def test_a_backed_off_target_stays_fresh_for_its_grace_and_no_longer():
    rules = AvailabilityRules(stale_after_s=0.5, peer_stale_after_s=0.3)
    replica = _replica(0, 0, 0)
    assert rules.replica_unavailable_reason(replica, now=1.9) == "probe stale"
    replica.stale_grace_s = 0.7
    assert rules.replica_unavailable_reason(replica, now=1.9) is None
    assert rules.replica_unavailable_reason(replica, now=2.3) == "probe stale"
    peer = PeerState(region="eu", url="http://eu", healthy=True, available_replicas=1, replicas=1, probed_at=1.0)
    assert rules.peer_unavailable_reason(peer, now=1.5) == "status stale"
    peer.stale_grace_s = 0.7
    assert rules.peer_unavailable_reason(peer, now=1.5) is None


def test_a_replica_a_rule_waits_on_is_probed_at_the_next_round_whatever_its_backoff():
    """Two replicas backed off to 8 intervals; the one marked ``probe_wanted`` (the spread cap waits on its probe)
    is probed at the next round, the other not until its interval has passed."""
    import asyncio

    from skylb.balancer.probers import Probers
    from skylb.core.policies.base import make_policy
    from skylb.core.router import Router

    router = Router(region="us", policy=make_policy("skylb"))
    router.set_replicas([("a", "http://a", "vllm"), ("b", "http://b", "vllm")])
    probed = []

    async def run():
        probers = Probers(router, None, now=lambda: 10.0, on_round=lambda: None, interval_s=0.1, timeout_s=1.0,
                          peer_token=None, max_backoff=8)

        async def record(state):
            probed.append(state.id)

        probers._probe_replica = record  # what is probed, not how: no network here
        for rid in ("a", "b"):
            for t in (9.0, 9.2, 9.6):
                probers.backoff.answered(("replica", rid), sent_at=t, foreseen=True)
        router.replicas["a"].probe_wanted = True
        await probers.probe_replicas()

    asyncio.run(run())
    assert probed == ["a"]
