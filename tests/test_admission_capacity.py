"""The learned admission capacity (skylb/core/capacity.py) and its use in selective pushing (skylb/core/state.py)."""

import pytest

from skylb.core import AvailabilityRules, Request, Router, make_policy
from skylb.core.capacity import AdmissionCapacity
from skylb.core.rates import ModelRates


def test_slow_start_then_the_waiting_sample_sets_the_limit():
    """Growth by a quarter per full probe until requests wait; then the running batch seen beside them is the limit."""
    c = AdmissionCapacity()
    assert c.limit == 2
    limits = []
    for _ in range(6):
        c.observe(0.0, pending=0, running=c.limit)  # each probe: the batch at the limit, nothing waiting
        limits.append(c.limit)
    assert limits == [3, 4, 5, 6, 7, 8]
    c.observe(1.0, pending=3, running=7)
    c.observe(1.1, pending=3, running=8)
    assert (c.limit, c.saturated) == (8, False)  # requests sent a moment ago wait for the engine's next step
    c.observe(1.5, pending=2, running=6)
    assert (c.limit, c.saturated) == (8, True)  # waiting that outlasts a step: the batch is full at 8


def test_a_half_empty_batch_beside_a_waiting_prompt_halves_the_limit_at_most():
    """A long prompt held back by one step's token budget beside 2 running must not collapse a limit of 32 to 2."""
    c = AdmissionCapacity(limit=32, saturated=True)
    c.observe(0.0, pending=1, running=2)
    c.observe(0.5, pending=1, running=2)
    assert c.limit == 16
    c.observe(0.6, pending=1, running=2)
    assert c.limit == 8


def test_a_retest_is_undone_when_the_engine_keeps_its_batch_and_kept_when_it_runs_more():
    c = AdmissionCapacity(limit=4, saturated=True, held_since=0.0, hold_s=5.0)
    c.observe(1.0, pending=0, running=4)
    assert c.limit == 4  # within the hold
    c.observe(5.0, pending=0, running=4)
    assert (c.limit, c.trial_from) == (5, 4)  # retest: one more
    c.observe(5.1, pending=1, running=4)
    assert (c.limit, c.trial_from) == (4, None)  # it kept 4 and one waits: back to 4 at once
    c.observe(10.1, pending=0, running=4)
    assert c.limit == 5
    c.observe(10.2, pending=0, running=5)
    assert (c.limit, c.trial_from) == (5, None)  # it ran 5: the raise holds
    c = AdmissionCapacity(limit=32, saturated=True)
    c.observe(0.0, pending=0, running=32)
    assert c.limit == 36


def test_the_proven_limit_leaves_out_what_slow_start_or_a_retest_added_until_the_engine_runs_it():
    """Slow start grows 4 -> 5 on a full batch of 4: 4 slots are proven until a probe shows 5 running; waiting
    seen ends the growth's claim. A retest from 4 to 5 proves nothing either until the engine runs 5."""
    c = AdmissionCapacity(limit=4)
    c.observe(0.0, pending=0, running=4)
    assert (c.limit, c.proven_limit) == (5, 4)
    c.observe(0.1, pending=0, running=4)
    assert (c.limit, c.proven_limit) == (5, 4)  # a batch of 4 below the limit: no growth, nothing proven
    c.observe(0.2, pending=0, running=5)
    assert (c.limit, c.proven_limit) == (6, 5)  # it ran 5: proven, and the batch at the limit grew it again
    c.observe(0.3, pending=1, running=6)
    assert c.grown_from is None and c.proven_limit == c.limit  # waiting: judged by the settle rule instead
    c = AdmissionCapacity(limit=4, saturated=True, held_since=0.0, hold_s=1.0)
    c.observe(1.0, pending=0, running=4)
    assert (c.limit, c.proven_limit) == (5, 4)
    c.observe(1.1, pending=0, running=5)
    assert (c.limit, c.proven_limit) == (5, 5)


def test_no_allowance_while_a_request_waits_beside_the_batch_slow_start_grew_from():
    """Slow start grows 3 -> 4; a probe then shows 3 running and 1 waiting: the waiting one may be behind a full
    batch of 3, so nothing more waits in the engine (no pending allowance) until a probe shows 4 running or nothing
    waiting, or the waiting settles the limit."""
    c = AdmissionCapacity(limit=3)
    c.observe(0.0, pending=0, running=3)
    assert (c.limit, c.proven_limit, c.allowance_ok) == (4, 3, False)  # unproven growth: no allowance
    c.observe(0.1, pending=1, running=3)
    assert (c.limit, c.proven_limit, c.allowance_ok) == (4, 4, False)  # counted, but nothing on top
    c.observe(0.2, pending=0, running=3)
    assert c.allowance_ok  # nothing waits: the fourth request ran or ended
    c.observe(0.3, pending=0, running=4)
    c.observe(0.4, pending=1, running=4)
    assert not c.allowance_ok
    c.observe(0.5, pending=1, running=5)
    assert c.allowance_ok  # a larger batch than before the growth
    c = AdmissionCapacity(limit=3)
    c.observe(0.0, pending=0, running=3)
    c.observe(0.1, pending=1, running=3)
    c.observe(0.7, pending=1, running=3)
    assert (c.limit, c.saturated, c.allowance_ok) == (3, True, True)  # waiting settled: the batch is 3


def test_the_allowance_waits_for_the_batch_to_prove_itself_in_selective_pushing():
    """A limit of 4 grown from 3 and a probe showing 3 running and 1 waiting: the replica is full, where
    the allowance would have let a fifth wait behind a possibly full batch."""
    router = _router()
    state, rules = router.replicas["r0"], router.rules
    state.capacity = AdmissionCapacity(limit=3)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=3)
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=3)
    assert state.capacity.limit == 4 and rules.replica_unavailable_reason(state, 0.1) == "batch full"
    router.observe_replica("r0", now=0.2, healthy=True, pending=0, running=4)
    assert state.capacity.limit == 5  # a full batch of 4, nothing waiting: slow start grows on
    router.observe_replica("r0", now=0.3, healthy=True, pending=0, running=3)
    assert rules.replica_unavailable_reason(state, 0.3) is None


def test_a_partly_filled_batch_does_not_grow_the_limit():
    c = AdmissionCapacity(limit=8)
    c.observe(0.0, pending=0, running=5)
    assert c.limit == 8


def _router(**rules):
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules(**rules))
    router.set_replicas([("r0", "http://r0", "vllm")])
    router.set_peers([])
    return router


def _burst(router, n, now):
    for i in range(n):
        router.enqueue(Request(f"q{now}-{i}", f"prompt {now} {i}", arrived_at=now))
    return router.dispatch(now)


def test_between_probes_a_replica_gets_up_to_its_limit_less_its_running_batch():
    router = _router(pending_allowance=0)
    r = router.replicas["r0"]
    r.capacity = AdmissionCapacity(limit=6, saturated=True, held_since=0.0)  # no growth at this probe
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=2)
    assert len(_burst(router, 10, 0.0)) == 4
    assert router.rules.replica_unavailable_reason(r, 0.0) == "batch full"


def test_a_large_batch_is_not_throttled_by_probes():
    """Slow start: a replica running everything it gets reaches a batch of 256 within about 25 probes."""
    router = _router()
    r = router.replicas["r0"]
    sent, now = 0, 0.0
    router.enqueue(Request("warm", "x", arrived_at=0.0))
    for step in range(26):
        router.observe_replica("r0", now=now, healthy=True, pending=0, running=min(sent, 256))
        sent += len(_burst(router, 300, now))
        now += 0.1
    assert r.capacity.limit >= 256 and sent >= 256


def test_the_ceiling_and_the_paper_rule():
    """``max_dispatch_per_probe`` still caps sends between probes; ``learn_capacity`` False sends on 0 pending."""
    router = _router(max_dispatch_per_probe=1)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=0)
    assert len(_burst(router, 5, 0.0)) == 1
    router = _router(learn_capacity=False)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=0)
    assert len(_burst(router, 5, 0.0)) == 5


def test_requests_waiting_in_a_learned_batch_count_in_it():
    """A request waiting for the engine's next step does not make a replica with room unavailable; with the
    engine's own slots (llama.cpp) or no learned batch, any waiting request does (the paper's rule)."""
    router = _router(pending_allowance=0)
    r = router.replicas["r0"]
    r.capacity = AdmissionCapacity(limit=4, saturated=True, held_since=0.0)
    router.observe_replica("r0", now=0.0, healthy=True, pending=1, running=2)
    assert router.rules.replica_unavailable_reason(r, 0.0) is None
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=3)
    assert router.rules.replica_unavailable_reason(r, 0.1) == "batch full"
    router.observe_replica("r0", now=0.2, healthy=True, pending=1, running=1, slots=4)
    assert router.rules.replica_unavailable_reason(r, 0.2) == "pending requests"
    router = _router(learn_capacity=False)
    router.observe_replica("r0", now=0.0, healthy=True, pending=1, running=0)
    assert router.rules.replica_unavailable_reason(router.replicas["r0"], 0.0) == "pending requests"


def test_the_pending_allowance_lets_one_more_wait_in_the_engine_but_not_beyond_reported_slots():
    """By default one request more than the learned batch is sent, to wait in the engine's queue for the next freed
    slot; an engine that reports its slots (llama.cpp) gets none beyond them, nor a limit slow start raised and no
    probe proved."""
    router = _router()
    r = router.replicas["r0"]
    r.capacity = AdmissionCapacity(limit=4, saturated=True, held_since=0.0)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=4)
    assert len(_burst(router, 3, 0.0)) == 1
    assert router.rules.replica_unavailable_reason(r, 0.0) == "batch full"
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=4)
    assert router.rules.replica_unavailable_reason(r, 0.1) == "batch full"
    router = _router()
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=3, slots=4)
    assert len(_burst(router, 3, 0.0)) == 1
    router = _router()  # slow start raised 4 to 5, unproven: the 5th is the guess, no allowance beyond it
    r = router.replicas["r0"]
    r.capacity = AdmissionCapacity(limit=5, grown_from=4, held_since=0.0)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=4)
    r.capacity = AdmissionCapacity(limit=5, grown_from=4, held_since=0.0)
    assert len(_burst(router, 3, 0.0)) == 1


def test_the_papers_policies_let_no_request_wait_in_an_engine_unless_the_setting_says_so():
    """``pending_allowance`` unset takes the policy's own: 1 for ``skylb``, 0 for ``skylb-paper`` and ``skylb-ch``
    (the paper's rule: no request waits in an engine), 1 for the blind ring, where it changes nothing; a value in
    the settings holds for every policy. On a full learned batch of 4, the paper's policies send nothing more."""
    from skylb.config import BalancerConfig
    from skylb.core import build_router

    expected = {"skylb": 1, "skylb-paper": 0, "skylb-ch": 0, "consistent-hash": 1}
    for policy, allowance in expected.items():
        assert build_router("us", BalancerConfig(policy=policy)).rules.pending_allowance == allowance, policy
        set_ = BalancerConfig(policy=policy, pending_allowance=2)
        assert build_router("us", set_).rules.pending_allowance == 2, policy
    for policy, sent in (("skylb", 1), ("skylb-paper", 0), ("skylb-ch", 0)):
        router = build_router("us", BalancerConfig(policy=policy))
        router.set_replicas([("r0", "http://r0", "vllm")])
        router.set_peers([])
        router.replicas["r0"].capacity = AdmissionCapacity(limit=4, saturated=True, held_since=0.0)
        router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=4)
        assert len(_burst(router, 3, 0.0)) == sent, policy


def test_a_stated_batch_is_where_the_limit_starts_and_the_most_it_grows_to():
    """``max_concurrency`` stated for an engine that reports its batch (vLLM ``--max-num-seqs``): no slow start
    from 2, no growth past it; waiting beside a smaller batch (a KV cache full before the slots) still lowers it,
    and it grows back to the bound, not beyond."""
    c = AdmissionCapacity()
    c.state_ceiling(4)
    assert (c.limit, c.proven_limit, c.allowance_ok) == (4, 4, True)
    c.observe(0.0, pending=0, running=4)
    assert c.limit == 4 and c.grown_from is None and c.trial_from is None
    c.observe(1.0, pending=2, running=2)
    c.observe(1.6, pending=2, running=2)
    assert (c.limit, c.saturated) == (2, True)
    for t in (3.0, 4.5, 6.0, 7.5):
        c.observe(t, pending=0, running=c.limit)
    assert c.limit == 4
    c.state_ceiling(None)
    assert c.limit == 4 and c.ceiling is None  # taken off: learned from here on
    c.observe(9.0, pending=0, running=4)
    assert c.limit == 5
    c.state_ceiling(3)
    assert c.limit == 3 and c.trial_from is None


def test_a_stated_batch_fills_every_replica_at_the_first_burst():
    """Four replicas of a batch of 4, 16 requests at once: with the batch stated every replica gets 4 before any
    probe has shown a full batch (as HAProxy's ``maxconn 4`` sends them); unstated, slow start sends 3 each (2 and
    the pending allowance) and the rest wait in the balancer's queue for the next probe."""
    for stated, expected in ((4, 16), (None, 12)):
        router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules())
        ids = [f"r{i}" for i in range(4)]
        router.set_replicas([(rid, f"http://{rid}", "vllm") for rid in ids],
                            max_concurrency={rid: stated for rid in ids})
        router.set_peers([])
        for rid in ids:
            router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=0)
        sent = _burst(router, 16, 0.0)
        assert len(sent) == expected
        if stated:
            assert all(router.replicas[rid].outstanding == 4 for rid in ids)
            assert len(_burst(router, 1, 0.0)) == 0  # a fifth per replica would only wait in the engine


def test_a_batch_bound_is_at_least_one_request():
    with pytest.raises(ValueError, match="at least 1"):
        AdmissionCapacity().state_ceiling(0)


def test_a_probe_answer_that_left_before_a_request_ended_does_not_hide_its_free_slot():
    """The last event of a request arrives while a probe is on its way; the probe's answer, read after it, still
    counts the request running: the slot it freed stays free. A probe sent after the end is taken as it is."""
    router = _router(pending_allowance=0)
    r, rules = router.replicas["r0"], router.rules
    r.capacity = AdmissionCapacity(limit=4, saturated=True, held_since=0.0)
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=0)
    sent = _burst(router, 4, 0.0)
    router.observe_replica("r0", now=0.1, healthy=True, pending=0, running=4, probe_sent_at=0.09)
    assert not rules.has_free_slot(r)
    router.engine_done(sent[0], now=0.201)
    assert rules.has_free_slot(r)
    router.observe_replica("r0", now=0.203, healthy=True, pending=0, running=4, probe_sent_at=0.2)
    assert rules.has_free_slot(r) and r.running == 3
    router.finished(sent[0], now=0.25)
    router.observe_replica("r0", now=0.303, healthy=True, pending=0, running=3, probe_sent_at=0.3)
    assert r.running == 3 and r.freed == []


def _grown_to_five(**options) -> tuple[Router, str]:
    """Two replicas of batch 4 (r0, r1), each grown to a limit of 5 by slow start (a probe at 0.0 showing 4 running);
    r0 holds a long prefix (returned): the policy alone would send a request sharing it there (without the push of
    cache hits into full batches, which would send it to r0 on purpose). ``options``: more of the policy's options."""
    router = Router(region="us", policy=make_policy("skylb", push_to_prefix_holder=False, **options),
                    rules=AvailabilityRules(pending_allowance=0))
    router.set_replicas([("r0", "http://r0", "vllm"), ("r1", "http://r1", "vllm")])
    router.set_peers([])
    shared = "a long shared system prompt " * 200
    router.observe_replica("r0", now=-1.0, healthy=True, pending=0, running=0)
    router.enqueue(Request("warm", shared + "warm", arrived_at=-1.0))
    [warm] = router.dispatch(-1.0)
    assert warm.target == "r0"
    router.finished(warm, now=-0.5)
    for rid in ("r0", "r1"):
        router.replicas[rid].capacity = AdmissionCapacity(limit=4)
        router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=4)
    return router, shared


def test_a_free_slot_below_a_batch_seen_waiting_goes_before_one_above_it():
    """On r0 a probe showed a request waiting beside 4 running (so its fifth place may not exist) and one of the
    batch ended, on r1 nothing waited: r0 with 4 in flight and r1 with 3 both count a free slot by their limits;
    the request goes to r1, though r0 holds its prefix."""
    router, shared = _grown_to_five()
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=4)
    router.observe_replica("r1", now=0.1, healthy=True, pending=0, running=3)
    r0, r1 = router.replicas["r0"], router.replicas["r1"]
    r0.slot_freed(dispatched_at=-5.0, now=0.15)  # one of r0's batch ends: the waiting request takes its place
    assert (r0.running, r0.pending) == (4, 0)
    assert (r0.capacity.limit, r0.capacity.waited_at, r1.capacity.limit) == (5, 4, 5)
    assert router.rules.has_free_slot(r0) and router.rules.has_free_slot(r1)
    assert not router.rules.below_waited_batch(r0) and router.rules.below_waited_batch(r1)
    router.enqueue(Request("q", shared + "question", arrived_at=0.1))
    [decision] = router.dispatch(0.1)
    assert decision.target == "r1"


def _grown_then_turned_over(**options) -> tuple[Router, str]:
    """``_grown_to_five``, then on r0 one of the batch ended and the request sent to its place waited for the
    engine's next step (a probe shows 3 running and 1 waiting, then 4 running and nothing waiting, and none of this
    balancer's requests ended in between); r1 runs 3."""
    router, shared = _grown_to_five(**options)
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=3)
    router.observe_replica("r0", now=0.2, healthy=True, pending=0, running=4)
    router.observe_replica("r1", now=0.2, healthy=True, pending=0, running=3)
    return router, shared


def test_a_request_waiting_for_its_place_in_the_old_batch_leaves_the_place_above_it_untried():
    """The wait on r0 ends slow start's claim but proves nothing of a fifth place (``untried_at``): with 4 in flight
    on r0 and 3 on r1 the request goes to r1's sure slot, though r0 holds its prefix. (Read as proven, r0's fifth
    place took such a request live, which waited 4 s for its batch to turn over: bench/results/concurrency.md.) A
    probe showing r0 running 5 tries the place; a request waiting past the old batch is judged as before
    (``waited_at``). Without ``untried_last`` the place counts as sure, as before (the request goes to r0)."""
    router, shared = _grown_then_turned_over(untried_last=False)
    router.enqueue(Request("q", shared + "question", arrived_at=0.2))
    [decision] = router.dispatch(0.2)
    assert decision.target == "r0"
    router, shared = _grown_then_turned_over()
    r0, r1 = router.replicas["r0"], router.replicas["r1"]
    capacity = r0.capacity
    assert (capacity.limit, capacity.waited_at, capacity.full_at, capacity.untried_at) == (5, None, None, 4)
    assert router.rules.has_free_slot(r0) and not router.rules.below_waited_batch(r0, untried=True)
    assert router.rules.below_waited_batch(r0) and router.rules.below_waited_batch(r1, untried=True)
    router.enqueue(Request("q", shared + "question", arrived_at=0.2))
    [decision] = router.dispatch(0.2)
    assert decision.target == "r1"
    router.observe_replica("r0", now=0.3, healthy=True, pending=0, running=5)
    assert capacity.untried_at is None
    capacity = AdmissionCapacity(limit=4)
    capacity.observe(0.0, pending=0, running=4)
    capacity.observe(0.1, pending=2, running=3)  # one waits past the old batch of 4
    assert (capacity.grown_from, capacity.waited_at) == (None, 4)


def test_an_untried_place_is_tried_when_its_batch_turns_over_fast_or_the_sure_slot_is_on_a_slower_class():
    """The untried place above r0's batch of 4 goes first (with r0's prefix) when a wrong guess would cost little: a
    request's measured time in the engine (``ModelRates.service_s``) over the batch under ``settle_s``; or when r1,
    the replica with the sure slot, is measured ``PACE_CLASS_RATIO`` times slower in time per token and in
    inter-token latency (a CPU host beside a GPU host)."""
    for r0_rates, r1_rates, expected in (
            (ModelRates(service_s=1.2, samples=3), None, "r0"),  # 1.2 s / 4 = 0.3 s a turnover
            (ModelRates(service_s=4.6, samples=3), None, "r1"),  # 1.15 s: the live run's batches
            (ModelRates(time_per_token_s=0.001, itl_s=0.02, samples=3),
             ModelRates(time_per_token_s=0.004, itl_s=0.08, samples=3), "r0"),
            (ModelRates(time_per_token_s=0.001, itl_s=0.02, samples=3),
             ModelRates(time_per_token_s=0.0015, itl_s=0.03, samples=3), "r1")):
        router, shared = _grown_then_turned_over()
        request = Request("q", shared + "question", arrived_at=0.2)
        for rid, rates in (("r0", r0_rates), ("r1", r1_rates)):
            if rates is not None:
                replica = router.replicas[rid]
                replica.rates.models[request.model] = rates
                replica.rates.overall = rates
                replica.availability_memo = None  # rates change in place; the next probe would clear it
        router.enqueue(request)
        [decision] = router.dispatch(0.2)
        assert decision.target == expected, (r0_rates, r1_rates)


def test_a_batch_seen_waiting_stays_ranked_last_after_nothing_waits_until_the_engine_runs_more():
    """After the request that waited beside r0's batch of 4 got in (a probe shows nothing waiting, still 4 running,
    and one of the batch ended in between: it took that place, not a fifth slot), r0's fifth place stays unproven
    for the ranking: with 4 in flight on r0 and 3 on r1, the request goes to r1. A probe showing r0 running 5
    proves the place."""
    router = Router(region="us", policy=make_policy("skylb", push_to_prefix_holder=False),
                    rules=AvailabilityRules(pending_allowance=0))
    router.set_replicas([("r0", "http://r0", "vllm"), ("r1", "http://r1", "vllm")])
    router.set_peers([])
    for rid in ("r0", "r1"):
        router.replicas[rid].capacity = AdmissionCapacity(limit=4)
        router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=4)
    router.observe_replica("r0", now=0.1, healthy=True, pending=1, running=4)
    r0, r1 = router.replicas["r0"], router.replicas["r1"]
    r0.slot_freed(dispatched_at=-5.0, now=0.15)  # a request of r0's batch ends: the waiting one takes its place
    router.observe_replica("r0", now=0.2, healthy=True, pending=0, running=4)
    router.observe_replica("r1", now=0.2, healthy=True, pending=0, running=3)
    assert (r0.capacity.limit, r0.capacity.waited_at, r0.capacity.full_at) == (5, None, 4)
    assert router.rules.has_free_slot(r0) and not router.rules.below_waited_batch(r0)
    assert router.rules.below_waited_batch(r1)
    router.enqueue(Request("q", "a prompt", arrived_at=0.2))
    [decision] = router.dispatch(0.2)
    assert decision.target == "r1"
    router.finished(decision, now=0.25)
    router.observe_replica("r0", now=0.3, healthy=True, pending=0, running=5)
    assert r0.capacity.full_at is None and router.rules.below_waited_batch(r0)


def test_full_at_marks_a_wait_ended_by_a_turnover_and_ends_when_the_limit_falls_back_to_that_batch():
    """The marker is set only when one of this balancer's requests ended there between the probe that showed the
    wait and the one that shows none (``ended``, the replica's count of them): with none ended, the waiting request
    got in through a slot of its own (a wait for the engine's next step). Requests seen waiting for ``settle_s``
    take the limit back to the batch, and the marker has nothing left to mark."""
    for ended_after, marked in ((3, None), (4, 4)):
        capacity = AdmissionCapacity(limit=4)
        capacity.observe(0.0, pending=0, running=4, ended=3)  # slow start: 4 -> 5, grown from 4
        capacity.observe(0.1, pending=1, running=4, ended=3)  # a request waits beside the old batch
        capacity.observe(0.2, pending=0, running=4, ended=ended_after)  # it got in
        assert (capacity.limit, capacity.waited_at, capacity.full_at) == (5, None, marked)
    for t in (0.3, 0.6, 0.9):
        capacity.observe(t, pending=1, running=4, ended=4)
    assert capacity.limit == 4 and capacity.full_at is None
