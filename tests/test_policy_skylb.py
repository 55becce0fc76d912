"""The ``skylb`` policy (``placement: estimate``, the default; ``predicted-ttft`` is tests/test_predicted_ttft.py's): availability on prefill backlog and KV pressure, placement by estimated
time to first token, forwarding when a peer's estimate plus the round trip is lower, and freed slots reused at once.
"""

from __future__ import annotations


import pytest

from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
from skylb.core.estimate import WaitModel, prompt_tokens
from skylb.core.plugins.hold_for_faster import HoldForFaster
from skylb.core.rates import ModelRates
from skylb.core.state import ReplicaState
from tests.policy_table import replicas

A = "alpha " * 200  # 1,200 characters, 300 tokens at 4 characters per token


def _router(policy="skylb", n=2, peers=("eu",), **options):
    router = Router(region="us", policy=make_policy(policy, **options),
                    rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([(f"r{i}", f"http://r{i}", "vllm") for i in range(n)])
    router.set_peers([(p, f"http://{p}") for p in peers])
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=0)
    return router


def _peer_status(region="eu", *, wait_ms=0.0, available=2):
    return PeerStatus(region, available_replicas=available, replicas=available, queue_len=0, wait_ms=wait_ms)


# -- the estimate --------------------------------------------------------------------------------------------------

def test_prompt_tokens_from_the_caller_or_the_text():
    """A known prompt length is used as is; otherwise the text's characters / 4 (at least 1 token)."""
    assert prompt_tokens(Request("a", "x" * 400, 0.0, prompt_tokens=7)) == 7
    assert prompt_tokens(Request("b", "x" * 400, 0.0)) == 100
    assert prompt_tokens(Request("c", "", 0.0)) == 1


@pytest.mark.parametrize("unprefilled, pending, expected_s", [
    ({}, 0, 0.0),
    ({"q1": 1000}, 0, 0.5),
    ({"q1": 1000}, 1, 0.5),  # the engine's pending request is this balancer's own: not counted twice
    ({"q1": 1000}, 3, 1.012),  # two more pending that another balancer sent: 512 tokens each assumed
    ({}, 2, 0.512),
])
def test_wait_model_counts_own_backlog_and_unknown_pending(unprefilled, pending, expected_s):
    """Estimated wait = (own unprefilled tokens + default size x pending beyond them) / prefill rate."""
    r = ReplicaState(id="r", url="x", healthy=True, probed_at=0.0, pending=pending)
    for rid, tokens in unprefilled.items():
        r.add_unprefilled(rid, tokens)
    assert WaitModel(prefill_tokens_per_s=2000, default_prompt_tokens=512).wait_s(r) == pytest.approx(expected_s)


# -- availability -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backlog, kv_usage, expected", [
    ({}, None, None),
    ({"q1": 5000}, None, "prefill backlog"),  # one request alone may exceed the budget only on an idle replica
    ({"q1": 1100, "q2": 1000}, None, "prefill backlog"),
    ({"q1": 1000}, None, None),
    ({}, 0.97, "KV cache full"),
    ({}, 0.90, None),
])
def test_backlog_and_kv_clauses(backlog, kv_usage, expected):
    """0 pending is not enough: a backlog at the budget (2048 tokens) or KV usage at 95% makes a replica full."""
    router = _router()
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=3, kv_usage=kv_usage)
    for rid, tokens in backlog.items():
        router.replicas["r0"].add_unprefilled(rid, tokens)
    assert router.replica_unavailable_reason(router.replicas["r0"], 0.01) == expected


def test_paper_policy_ignores_backlog_and_kv():
    """skylb-paper keeps the paper's rule: 0 pending at the latest probe is enough."""
    router = _router("skylb-paper")
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, kv_usage=0.99)
    router.replicas["r0"].add_unprefilled("q1", 9000)
    assert router.replica_unavailable_reason(router.replicas["r0"], 0.01) is None


# -- placement --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backlog_tokens, expected", [
    (100, "r1"),  # 0.05 s of backlog beats prefilling 300 uncached tokens elsewhere (0.15 s): locality wins
    (1000, "r2"),  # 0.5 s of backlog loses to 0.15 s of prefill on an idle replica
])
def test_prefix_match_is_weighed_against_the_backlog(backlog_tokens, expected):
    """A cached prefix saves its prefill time (matched tokens / rate), compared with the replica's wait."""
    policy = make_policy("skylb")
    policy.set_members(["r1", "r2"], [])
    policy.routed(Request("h", A, 0.0), replica="r1")
    candidates = replicas({"r1": 1, "r2": 1})
    candidates[0].add_unprefilled("other", backlog_tokens)
    assert policy.local.pick(Request("q", A + "more", 0.0), candidates).id == expected


def test_request_forwarded_when_peer_estimate_plus_rtt_is_lower():
    """A local replica shows 0 pending, but its backlog (1.5 s) loses to an idle peer 150 ms away: forwarded."""
    router = _router(n=1, backlog_budget_tokens=8000)  # the backlog stays below the budget: r0 is available
    router.replicas["r0"].add_unprefilled("earlier", 3000)
    router.observe_peer("eu", now=0.0, status=_peer_status(wait_ms=0.0), rtt_s=0.15)
    assert router.replica_unavailable_reason(router.replicas["r0"], 0.01) is None
    router.enqueue(Request("q", "hello " * 100, arrived_at=0.0))
    [d] = router.dispatch(0.01)
    assert (d.route, d.target) == ("peer", "eu")


@pytest.mark.parametrize("status, rtt_s, why", [
    (_peer_status(wait_ms=0.0), 2.0, "the round trip is longer than the local wait"),
    (_peer_status(wait_ms=1400.0), 0.15, "the peer's own wait plus the round trip is not lower by the margin"),
    (_peer_status(wait_ms=None), 0.15, "the peer gave no estimate"),
    (_peer_status(wait_ms=0.0), None, "the round trip is not measured"),
])
def test_request_stays_local_unless_the_peer_is_clearly_faster(status, rtt_s, why):
    """Forwarding a request a local replica could take needs a known, lower peer estimate (margin 50 ms)."""
    router = _router(n=1, backlog_budget_tokens=8000)
    router.replicas["r0"].add_unprefilled("earlier", 3000)
    router.observe_peer("eu", now=0.0, status=status, rtt_s=rtt_s)
    router.enqueue(Request("q", "hello " * 100, arrived_at=0.0))
    [d] = router.dispatch(0.01)
    assert d.route == "local", why


@pytest.mark.parametrize("against, route", [("cheapest", "local"), ("pick", "peer")])
def test_a_peer_must_beat_the_cheapest_local_replica_not_only_the_load_guards_pick(against, route):
    """Past the load guard the pick is the least loaded replica (r0, 1.5 s of backlog); r1 has room and no backlog.
    An idle peer 150 ms away beats the pick but not r1: with ``forward_against`` "cheapest" (the default) the request
    stays here, on the guard's pick; compared with the pick alone it went abroad."""
    router = _router(n=2, backlog_budget_tokens=8000, forward_against=against)
    router.replicas["r0"].add_unprefilled("earlier", 3000)
    router.replicas["r1"].capacity.limit = 64
    router.replicas["r1"].outstanding = 12  # imbalanced by more than 8 and 1.5x: the guard picks r0
    router.observe_peer("eu", now=0.0, status=_peer_status(wait_ms=0.0), rtt_s=0.15)
    router.enqueue(Request("q", "hello " * 100, arrived_at=0.0))
    [d] = router.dispatch(0.01)
    assert d.route == route and (route == "peer" or d.target == "r0")


def test_status_carries_the_best_available_wait():
    """The peer status reports the smallest estimated wait among available replicas, in ms."""
    router = _router(n=2)
    router.replicas["r0"].add_unprefilled("a", 1000)
    router.replicas["r1"].add_unprefilled("b", 400)
    assert router.status(0.01).wait_ms == pytest.approx(200.0)
    for rid in router.replicas:
        router.observe_replica(rid, now=0.02, healthy=True, pending=2)
    assert router.status(0.03).wait_ms is None


def test_first_token_and_finish_clear_the_backlog():
    """A dispatched prompt is backlog until its first token comes back (or it ends without one)."""
    router = _router(n=1, peers=())
    router.enqueue(Request("q1", "x" * 4000, arrived_at=0.0))
    router.enqueue(Request("q2", "y" * 4000, arrived_at=0.0))
    d1, d2 = router.dispatch(0.01)
    assert router.replicas["r0"].backlog_tokens == 2000
    router.first_token(d1)
    assert router.replicas["r0"].backlog_tokens == 1000
    router.finished(d2)
    assert router.replicas["r0"].unprefilled == {}


def test_output_reservations_follow_requests_on_engines_that_reserve():
    """On an SGLang replica each request sent there is remembered with its clipped max_tokens until its engine is
    done with it (last event or end, whichever first: once); a vLLM replica remembers none."""
    router = _router(n=1, peers=())
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=0, kv_capacity_tokens=36_000,
                           kv_usage=0.1, output_reserve_tokens=4096, output_reserve_ratio=0.5)
    router.enqueue(Request("q1", "x" * 400, arrived_at=0.0, max_tokens=100))
    router.enqueue(Request("q2", "y" * 400, arrived_at=0.0))
    d1, d2 = router.dispatch(0.01)
    state = router.replicas["r0"]
    assert state.reserved == {"q1": 100, "q2": 4096} and state.decode_reserve_tokens() == 0.5 * 4196
    router.engine_done(d1, 0.5)
    router.finished(d1, 0.6)
    assert state.reserved == {"q2": 4096}
    router.finished(d2, 0.7)
    assert state.reserved == {} and state.reserved_tokens == 0
    router.observe_replica("r0", now=1.0, healthy=True, pending=0, running=0, kv_capacity_tokens=36_000,
                           kv_usage=0.1)  # vLLM-like: no reserve, so no ratio either
    assert state.output_reserve_ratio is None


# -- freed slots ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, expected", [("skylb", ["q2"]), ("skylb-paper", [])])
def test_finished_request_frees_its_slot_before_the_next_probe(policy, expected):
    """llama.cpp-like replica with 1 slot: when the running request ends, the queued one goes at once (skylb);
    the paper's rule waits for the next probe."""
    router = _router(policy, n=1, peers=())
    router.observe_replica("r0", now=0.0, healthy=True, pending=0, running=0, slots=1)
    router.enqueue(Request("q1", "a", arrived_at=0.0))
    [d1] = router.dispatch(0.01)
    router.enqueue(Request("q2", "b", arrived_at=0.02))
    assert router.dispatch(0.02) == []
    router.observe_replica("r0", now=0.05, healthy=True, pending=0, running=1, probe_sent_at=0.04)
    assert router.dispatch(0.05) == []
    router.finished(d1)
    assert [d.request.id for d in router.dispatch(0.06)] == expected


def test_finish_lets_a_pending_request_in_first():
    """With requests pending in the engine, a finish admits one of them there: the replica stays unavailable
    until the engine's pending count (as estimated) reaches 0 and its batch has room."""
    router = _router(n=1, peers=())
    router.enqueue(Request("q1", "a", arrived_at=0.0))
    [d1] = router.dispatch(0.01)
    router.observe_replica("r0", now=0.05, healthy=True, pending=1, running=4, probe_sent_at=0.04)
    router.enqueue(Request("q2", "b", arrived_at=0.05))
    assert router.dispatch(0.05) == []
    router.finished(d1)
    state = router.replicas["r0"]
    assert (state.pending, state.running) == (0, 4)
    assert router.dispatch(0.06) == []
    assert router.rules.replica_unavailable_reason(state, 0.06) == "batch full"
    router.observe_replica("r0", now=0.1, healthy=True, pending=0, running=3)
    assert [d.request.id for d in router.dispatch(0.1)] == ["q2"]


# -- the queue across regions: first come, first served by age ---------------------------------------------------

def test_forwarded_request_keeps_its_place_by_age():
    """A forwarded request queues by when it joined its first queue (its wait there included), not at the tail;
    expiry counts that wait too."""
    router = _router(peers=())
    router.enqueue(Request("a", "x", arrived_at=10.0))
    router.enqueue(Request("b", "x", arrived_at=11.0))
    router.enqueue(Request("f", "x", arrived_at=12.0, forwarded_from="eu", waited_s=1.5))  # joined at 10.5
    router.enqueue(Request("c", "x", arrived_at=12.0))
    assert [r.id for r in router.queue] == ["a", "f", "b", "c"]
    assert router.queue_age_s(12.0) == pytest.approx(2.0)
    assert [r.id for r in router.expire(now=16.0, timeout_s=5.2)] == ["a", "f"]


def test_a_retried_request_goes_back_to_its_place_by_age():
    """A request whose target failed goes back ahead of younger requests but behind an older forwarded one, so the
    queue stays in age order and expiry, which looks only at the head, stays exact."""
    router = _router(peers=())
    router.enqueue(Request("young", "x", arrived_at=12.0))
    router.enqueue(Request("old", "x", arrived_at=12.0, forwarded_from="eu", waited_s=5.0))  # joined at 7.0
    router.requeue(Request("retried", "x", arrived_at=10.0))
    assert [r.id for r in router.queue] == ["old", "retried", "young"]
    assert [r.id for r in router.expire(now=17.5, timeout_s=7.2)] == ["old", "retried"]


def _busy_router(peer_age_s, *, rate=2.0, sent=0, queue=("old",), waited=0.0):
    """us with both replicas full, a queue, and peer eu with no available replica whose oldest request has waited
    ``peer_age_s`` and which places ``rate`` requests per second."""
    router = _router()
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=3, running=8)
    for i, rid in enumerate(queue):
        router.enqueue(Request(rid, A + rid, arrived_at=float(i)))
    router.observe_peer("eu", now=29.9, rtt_s=0.1, status=PeerStatus(
        "eu", available_replicas=0, replicas=2, queue_len=3, wait_ms=None,
        queue_age_ms=peer_age_s * 1000.0, dispatch_rate=rate))
    router.peers["eu"].sent_since_probe = sent
    return router


@pytest.mark.parametrize("peer_age_s, sent, forwarded, why", [
    (5.0, 0, True, "eu serves requests 25 s younger than ours: ours goes first there"),
    (29.0, 0, False, "eu's oldest request is about as old as ours: no gain beyond the margin (2 s)"),
    (5.0, 50, False, "50 requests already sent since eu's status keep it busy 25 s: its head is then as old"),
    (5.0, 20, True, "20 requests sent keep it busy 10 s: ours is still older by more than the margin"),
])
def test_queued_request_forwarded_to_a_peer_serving_younger_requests(peer_age_s, sent, forwarded, why):
    """With no room anywhere, the oldest request goes to a peer whose queue head is younger by more than the round
    trip and the margin (first come, first served across regions); it stays when the peer is as far behind."""
    router = _busy_router(peer_age_s, sent=sent)
    decisions = router.dispatch(30.0)
    assert [(d.route, d.target) for d in decisions] == ([("peer", "eu")] if forwarded else []), why


def test_paper_policy_never_forwards_into_a_queue():
    """skylb-paper forwards only to a peer with an available replica (Algorithm 1)."""
    router = _router("skylb-paper")
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=3)
    router.enqueue(Request("old", A, arrived_at=0.0))
    router.observe_peer("eu", now=29.9, rtt_s=0.1, status=PeerStatus(
        "eu", available_replicas=0, replicas=2, queue_len=0, queue_age_ms=0.0, dispatch_rate=2.0))
    assert router.dispatch(30.0) == []


def test_a_later_request_with_its_prefix_on_the_free_replica_goes_first():
    """Look-ahead: when a replica frees up, the first queued request (within ``queue_lookahead``) whose prefix that
    replica holds goes there ahead of a head that has no match on it; the head is passed over at most
    ``max_bypass`` times."""
    router = _router(max_bypass=2, push_to_prefix_holder=False)  # the look-ahead alone: no push into r0's batch
    router.rules.max_dispatch_per_probe = 1  # one request per replica per probe: one placement per round here
    router.rules.learn_capacity = False  # the probes below report one running request however many were sent
    for rid in router.replicas:  # r0 served B's conversation before
        router.observe_replica(rid, now=0.0, healthy=True, pending=3)
    router.policy.routed(Request("earlier", B, 0.0), replica="r0")
    for i, text in enumerate([A, B + "more", B + "again", B + "third"]):
        router.enqueue(Request(f"q{i}", text, arrived_at=1.0 + i))
    router.observe_replica("r0", now=5.0, healthy=True, pending=0, running=1)
    d = router.dispatch(5.0)
    assert [x.request.id for x in d] == ["q1"]  # r0 holds B: q1 first; r1 still full
    for n in range(2):
        router.observe_replica("r0", now=6.0 + n, healthy=True, pending=0, running=1)
        got = [x.request.id for x in router.dispatch(6.0 + n)]
        assert got == (["q2"] if n == 0 else ["q0"]), "the head was passed over twice: it goes next"


def test_max_bypass_0_never_passes_the_head_over():
    """``max_bypass`` 0: the look-ahead never places a later request before the head, not even once."""
    router = _router(max_bypass=0, push_to_prefix_holder=False)
    router.rules.max_dispatch_per_probe = 1
    router.rules.learn_capacity = False
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=3)
    router.policy.routed(Request("earlier", B, 0.0), replica="r0")
    for i, text in enumerate([A, B + "more"]):
        router.enqueue(Request(f"q{i}", text, arrived_at=1.0 + i))
    router.observe_replica("r0", now=5.0, healthy=True, pending=0, running=1)
    assert [x.request.id for x in router.dispatch(5.0)] == ["q0"]


@pytest.mark.parametrize("policy, bounded", [("skylb", True), ("skylb-paper", False)])
def test_a_replicas_trie_records_are_bounded_by_its_kv_capacity(policy, bounded):
    """The KV capacity a probe reports (tokens) bounds that replica's records in the replica trie at 4 characters a
    token, its oldest going first; the other replica and the prototype's trie (``skylb-paper``) keep theirs."""
    router = _router(policy)
    trie = next(learner for learner in router.policy.learners if hasattr(learner, "replica_trie")).replica_trie
    router.observe_replica("r0", now=0.1, healthy=True, pending=0, running=0, kv_capacity_tokens=1024)
    prompts = [(f"tenant {n}: " + "shared context " * 70)[:1024] for n in range(8)]  # 4 whole 256-char chunks
    for n, text in enumerate(prompts):
        router.policy.routed(Request(f"a{n}", text, 0.0), replica="r0")
        router.policy.routed(Request(f"b{n}", text, 0.0), replica="r1")
    held = [trie.match(trie.chunks(text), {"r0"}).matched_chars > 0 for text in prompts]
    assert held == ([False] * 4 + [True] * 4 if bounded else [True] * 8)
    assert all(trie.match(trie.chunks(text), {"r1"}).matched_chars for text in prompts)
    if bounded:
        assert trie.target_chars("r0") <= 4096 < trie.target_chars("r1")


def _full_router(**options):
    """Two replicas of a learned batch of 4, each running 5 (the batch and one allowed to wait) with nothing
    waiting, probed at 0; r0 served B's conversation."""
    router = _router(**options)
    for rid in router.replicas:
        router.replicas[rid].capacity.limit = 4
        router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=5)
        router.replicas[rid].capacity.limit = 4  # a probe may raise it: keep the batch at 4
    router.policy.routed(Request("earlier", B, 0.0), replica="r0")
    return router


B = "bravo " * 200


def _r0_busy_r1_idle(router):
    """r0 has 5 of this balancer's requests in flight, r1 none and an empty batch (room)."""
    router.replicas["r0"].outstanding = 5
    router.observe_replica("r1", now=0.0, healthy=True, pending=0, running=0)


def test_a_cache_hit_is_pushed_into_its_holders_full_batch():
    """A request whose prefix a full replica holds goes into that replica's batch (it prefills only its tail
    there) while one without a match waits here: selective pushing for misses, affinity for hits."""
    router = _full_router()
    router.enqueue(Request("hit", B + "more", arrived_at=0.01))
    router.enqueue(Request("miss", A, arrived_at=0.02))
    assert [(d.request.id, d.target) for d in router.dispatch(0.03)] == [("hit", "r0")]
    assert [r.id for r in router.queue] == ["miss"]


@pytest.mark.parametrize("setup, expected, why", [
    (lambda r: setattr(r.replicas["r0"], "pending", 4), [], "as many waiting as its batch holds: it waits here"),
    (lambda r: setattr(r.replicas["r0"], "max_concurrency", 5), [], "a stated bound (max_concurrency) holds"),
    (lambda r: setattr(r.replicas["r0"], "slots", 4), [], "an engine's own slot count (llama.cpp) holds"),
    (_r0_busy_r1_idle, [("hit", "r0")], "r1 idle, but a gap of 5 is within SGLang's 64: the hit goes to its holder"),
    (_r0_busy_r1_idle, [("hit", "r1")],
     "with the gap's threshold at 2, 5 against 0 is imbalanced: the replica with room takes it"),
])
def test_a_cache_hit_is_not_pushed_where_its_holder_cannot_take_it(setup, expected, why):
    """No push into the holder's batch when a batch's worth already waits for it, when its bound is stated rather
    than learned, or when the local replicas' loads are imbalanced (``holder_balance_*_threshold``)."""
    router = _full_router(**({"holder_balance_abs_threshold": 2} if why.startswith("with the gap") else {}))
    setup(router)
    router.enqueue(Request("hit", B + "more", arrived_at=0.01))
    assert [(d.request.id, d.target) for d in router.dispatch(0.03)] == expected, why


@pytest.mark.parametrize("guard, goes_to", [("balance", "other"), ("holder", "holder"), ("serial", "holder")])
def test_cache_hit_guard_keeps_a_hit_on_its_holder_past_the_load_guard(guard, goes_to):
    """Both replicas have room and the holder of the prompt's prefix has 10 more requests in flight (past the load
    guard's 8 and 1.5x, within the push's 64): with ``cache_hit_guard`` "balance" the least loaded takes the hit;
    with "holder" its holder does, and with "serial" (the default) too: the first request is done, so no burst."""
    router = _router(cache_hit_guard=guard)
    for replica in router.replicas.values():
        replica.slots = 64  # a free slot on both at 12 in flight (the engine's own count, as llama.cpp reports)
    router.enqueue(Request("first", B, arrived_at=0.0))
    (first,) = router.dispatch(0.0)
    router.finished(first)
    holder, other = first.target, ({"r0", "r1"} - {first.target}).pop()
    router.replicas[holder].outstanding, router.replicas[other].outstanding = 12, 2
    router.enqueue(Request("hit", B + "more", arrived_at=0.1))
    (hit,) = router.dispatch(0.1)
    assert hit.target == (holder if goes_to == "holder" else other)


def test_serial_cache_hit_guard_spreads_a_hit_while_its_holder_prefills_the_same_prefix():
    """With ``cache_hit_guard`` "serial", a hit that arrives while the holder still prefills an earlier request of the
    same prefix (a tree's branches arriving together) goes to the least loaded past the load guard, as by default."""
    router = _router(cache_hit_guard="serial")
    for replica in router.replicas.values():
        replica.slots = 64
    router.enqueue(Request("first", B, arrived_at=0.0))
    (first,) = router.dispatch(0.0)  # not finished, no first token: still in its holder's prefill backlog
    holder, other = first.target, ({"r0", "r1"} - {first.target}).pop()
    assert "first" in router.replicas[holder].unprefilled
    router.replicas[holder].outstanding, router.replicas[other].outstanding = 12, 2
    router.enqueue(Request("branch", B + "more", arrived_at=0.1))
    (branch,) = router.dispatch(0.1)
    assert branch.target == other


def test_serial_cache_hit_guard_keeps_a_hit_while_its_holder_prefills_another_request_that_found_it_cached():
    """A prefix reused one request after another stays a hit while the previous request, which found the prefix
    cached, still prefills its own question: the next one stays on the holder past the load guard (a tenant's or an
    agent's requests), where a burst behind a prefix still being computed is spread (the test above)."""
    router = _router(cache_hit_guard="serial")
    for replica in router.replicas.values():
        replica.slots = 64
    router.enqueue(Request("first", B, arrived_at=0.0))
    (first,) = router.dispatch(0.0)
    router.finished(first)  # its prompt is cached on its holder now
    holder, other = first.target, ({"r0", "r1"} - {first.target}).pop()
    router.enqueue(Request("second", B + "question one", arrived_at=0.1))
    (second,) = router.dispatch(0.1)
    assert second.target == holder and router.replicas[holder].unprefilled["second"] < 100  # B found cached
    router.replicas[holder].outstanding, router.replicas[other].outstanding = 12, 2
    router.enqueue(Request("third", B + "question two", arrived_at=0.2))
    (third,) = router.dispatch(0.2)
    assert third.target == holder


def test_fcfs_without_lookahead():
    """``queue_lookahead`` 0 keeps strict first come, first served."""
    router = _router(queue_lookahead=0, push_to_prefix_holder=False)  # the queue's order alone
    router.rules.max_dispatch_per_probe = 1
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=3)
    router.policy.routed(Request("earlier", B, 0.0), replica="r0")
    router.enqueue(Request("q0", A, arrived_at=1.0))
    router.enqueue(Request("q1", B + "more", arrived_at=2.0))
    router.observe_replica("r0", now=5.0, healthy=True, pending=0, running=1)
    assert [x.request.id for x in router.dispatch(5.0)] == ["q0"]
    router.observe_replica("r0", now=6.0, healthy=True, pending=0, running=1)
    assert [x.request.id for x in router.dispatch(6.0)] == ["q1"]


# -- mixed hardware: waiting for a faster replica -------------------------------------------------------------------

def test_a_request_waits_for_a_faster_busy_replica_unless_the_queue_is_long():
    """One slot per replica, r0 4x faster than r1 (measured). With r0 busy, r1 takes the head only once r0 could not
    finish its backlog and the whole queue before r1 finished the head: 4 s on r1 against 1 s of backlog plus 1 s
    per queued request (400 characters at 0.25 tokens per character, 10 or 40 ms per token)."""
    router = _router(n=2, peers=())
    fast, slow = router.replicas["r0"], router.replicas["r1"]
    for state, per_token in ((fast, 0.01), (slow, 0.04)):
        state.max_concurrency = 1
        state.rates.models[""] = ModelRates(time_per_token_s=per_token, decode_s_per_token=per_token, samples=3)
    fast.outstanding = 1
    router.policy.rates.dispatched(fast.rates, "running", "", "x" * 400)
    router.enqueue(Request("q0", "y" * 400, arrived_at=0.0))
    assert router.dispatch(0.1) == []  # 4 s on r1 > 1 s backlog + 1 x 1 s on r0
    for i in range(1, 4):
        router.enqueue(Request(f"q{i}", "y" * 400, arrived_at=0.0))
    assert [(d.request.id, d.target) for d in router.dispatch(0.2)] == [("q0", "r1")]  # 4 s < 1 s + 4 x 1 s
    router.policy.then = tuple(r for r in router.policy.then if not isinstance(r, HoldForFaster))  # the option off
    fast.outstanding, slow.outstanding = 1, 0
    router.enqueue(Request("q9", "y" * 400, arrived_at=0.0))
    assert [d.request.id for d in router.dispatch(0.3)] == ["q1"]  # off: room wins


@pytest.mark.parametrize("decode_ms, holds", [
    ((10, 40), True),  # r0 4x faster in decode too: a faster replica
    ((20, 20), False),  # equal decode per output token: the t^ gap is the mix of requests each served, not speed
    (None, False),  # decode not measured on both: no evidence of speed beyond the mix, nothing held
])
def test_a_replica_is_faster_only_when_its_decode_rate_agrees(decode_ms, holds):
    """``hold_for_faster`` takes r0 as faster than r1 only when its decode seconds per output token, measured on
    both, agree with its 4x lower time per token."""
    router = _router(n=2, peers=())
    fast, slow = router.replicas["r0"], router.replicas["r1"]
    for i, (state, per_token) in enumerate(((fast, 0.01), (slow, 0.04))):
        state.max_concurrency = 1
        state.rates.models[""] = ModelRates(time_per_token_s=per_token, samples=3,
                                            decode_s_per_token=None if decode_ms is None else decode_ms[i] / 1e3)
    fast.outstanding = 1
    router.policy.rates.dispatched(fast.rates, "running", "", "x" * 400)
    router.enqueue(Request("q0", "y" * 400, arrived_at=0.0))
    assert (router.dispatch(0.1) == []) is holds
