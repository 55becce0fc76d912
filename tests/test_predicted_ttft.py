"""One cost for every placement: the prefill model's online fit, the cost terms, and the default policy's choice by
predicted time to first token among local replicas, pushes into full batches, peers and holding."""

from __future__ import annotations

import random

import pytest

from skylb.balancer.protocol import decode_status, encode_status
from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
from skylb.core.cost import ServiceTimes, peer_ttft_s, slot_wait_s
from skylb.core.prefill_model import PrefillBook, PrefillFit, PrefillLine
from skylb.core.rates import Usage
from skylb.core.state import PeerState, ReplicaState

PRIOR = PrefillLine(0.05, 0.0005)


# -- the prefill model ---------------------------------------------------------------------------------------------

def test_fit_recovers_fixed_and_per_token_parts_from_queued_responses():
    """Responses behind backlogs of every size still give the engine's line (fixed 0.09 s + 0.48 ms/token)."""
    rng = random.Random(1)
    fit = PrefillFit()
    for _ in range(400):
        tokens = rng.uniform(100, 6000)  # backlog ahead + own: queued responses count too
        fit.add(tokens, 0.09 + 0.00048 * tokens + rng.gauss(0, 0.02))
    line = fit.line(PRIOR)
    assert line.fixed_s == pytest.approx(0.09, abs=0.02)
    assert line.s_per_token == pytest.approx(0.00048, rel=0.05)


def test_fit_is_the_prior_before_any_sample_and_follows_a_change():
    """No sample: the prior. The forgetting bounds memory: after the engine doubles its speed the fit follows."""
    fit = PrefillFit()
    assert fit.line(PRIOR) == PRIOR
    for t in range(300):
        fit.add(500 + 10 * t, 0.001 * (500 + 10 * t))
    for t in range(300):
        fit.add(500 + 10 * t, 0.0005 * (500 + 10 * t))
    assert fit.line(PRIOR).seconds(1000) == pytest.approx(0.5, rel=0.1)


def test_fit_keeps_coefficients_non_negative_and_ignores_bad_samples():
    """Decreasing or flat data never yields a negative slope or intercept; NaN and negative samples are ignored."""
    fit = PrefillFit()
    for tokens in (100, 200, 300):
        fit.add(tokens, 1.0 - tokens / 1000)
    fit.add(float("nan"), 1.0)
    fit.add(-5, 1.0)
    line = fit.line(PRIOR)
    assert line.fixed_s >= 0 and line.s_per_token >= 0
    assert fit.samples == 3


def test_a_new_replica_starts_from_its_class_fit():
    """A replica with no response of its own is priced at its class's fitted line, not the configured prior."""
    book = PrefillBook(PRIOR)
    for tokens in range(100, 3000, 50):
        book.observe("r0", "vllm-8b", tokens, 0.1 + 0.001 * tokens)
    fresh = book.line("r1", "vllm-8b")
    assert fresh.seconds(2000) == pytest.approx(book.line("r0", "vllm-8b").seconds(2000), rel=0.1)
    assert book.line("r2", "other").seconds(2000) == PRIOR.seconds(2000)


# -- the cost terms ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("running, pending, slots, expected", [
    (3, 0, 4, 0.0),  # room
    (4, 0, 4, 2.0 / 4),  # full: the next slot frees in service / limit
    (4, 2, 4, 3 * 2.0 / 4),  # two already waiting ahead
])
def test_slot_wait_counts_the_requests_ahead_of_a_push(running, pending, slots, expected):
    """A push into a full batch waits (waiting ahead + 1) x service time / batch size."""
    r = ReplicaState(id="r", url="x", healthy=True, probed_at=0.0, running=running, pending=pending, slots=slots)
    assert slot_wait_s(r, 2.0) == pytest.approx(expected)


def test_peer_is_priced_in_its_own_tokens_and_line():
    """A peer with room: round trip + its line over its backlog and the uncached prompt; without room its queue at
    its dispatch rate (none of it for a request older than the peer's oldest), then its backlog."""
    p = PeerState(region="eu", url="x", rtt_s=0.1, available_replicas=2, backlog_tokens=1000,
                  prefill_line=PrefillLine(0.1, 0.001))
    assert peer_ttft_s(p, uncached_tokens=500, age_s=0, default_prompt_tokens=512,
                       fallback=PRIOR) == pytest.approx(0.1 + 0.1 + 1.5)
    p.available_replicas, p.queue_len, p.dispatch_rate, p.queue_age_s = 0, 9, 10.0, 1.0
    assert peer_ttft_s(p, uncached_tokens=500, age_s=0, default_prompt_tokens=512,
                       fallback=PRIOR) == pytest.approx(0.1 + 1.0 + 1.6)
    assert peer_ttft_s(p, uncached_tokens=500, age_s=5, default_prompt_tokens=512,
                       fallback=PRIOR) == pytest.approx(0.1 + 0.1 + 1.6)
    p.dispatch_rate = None  # no room and no rate: its queue cannot be priced
    assert peer_ttft_s(p, uncached_tokens=500, age_s=0, default_prompt_tokens=512, fallback=PRIOR) is None


def test_service_times_default_then_mean_of_measured():
    """Before any response the default; an unmeasured replica then gets the measured replicas' mean."""
    s = ServiceTimes(default_s=3.0)
    assert s.seconds("a") == 3.0
    s.observe("a", 10.0)
    assert s.seconds("b") == 10.0


def test_status_advertises_tokens_and_line_across_the_wire():
    """A balancer's status carries its best backlog in tokens and its fitted line; the peer reads them back."""
    router = _router(n=1, peers=())
    status = decode_status(encode_status(router.status(0.0)))
    assert status.backlog_tokens == 0.0
    assert status.prefill_fixed_ms == pytest.approx(50.0)
    assert status.prefill_ms_per_token == pytest.approx(0.5)
    peer = PeerState(region="eu", url="x")
    peer.observe_status(now=0.0, status=status, rtt_s=0.05)
    assert peer.prefill_line == PrefillLine(0.05, 0.0005)


# -- the choice ------------------------------------------------------------------------------------------------------

P = "alpha " * 400  # 2,400 characters, 600 tokens


def _router(n=2, peers=("eu",), **options):
    router = Router(region="us", policy=make_policy("skylb", placement="predicted-ttft", **options),
                    rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([(f"r{i}", f"http://r{i}", "sglang") for i in range(n)])
    router.set_peers([(p, f"http://{p}") for p in peers])
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=0, running=0, slots=2, kv_usage=0.5)
    return router


def _place(router, rid, text, now=0.0):
    router.enqueue(Request(rid, text, now))
    return router.dispatch(now)


def test_a_cache_hit_is_pushed_to_its_full_replica_with_kv_room():
    """The replica holding the prefix is full by request count but has KV room: the hit goes there, not to the
    idle replica that would prefill the whole prompt."""
    router = _router(peers=())
    [first] = _place(router, "a", P + "turn one")
    router.first_token(first)  # its prompt is prefilled: no backlog ahead of the next turn there
    router.observe_replica(first.target, now=0.0, healthy=True, pending=0, running=2, slots=2, kv_usage=0.5)
    [second] = _place(router, "b", P + "turn two")
    assert second.target == first.target


def test_without_a_hit_a_full_replica_is_not_pushed_to():
    """No prefix held anywhere: the idle replica takes it; with every replica full it is held here."""
    router = _router(peers=())
    [first] = _place(router, "a", "beta " * 400)
    router.observe_replica(first.target, now=0.0, healthy=True, pending=0, running=2, slots=2, kv_usage=0.5)
    [second] = _place(router, "b", "gamma " * 400)
    assert second.target != first.target
    router.observe_replica(second.target, now=0.0, healthy=True, pending=0, running=2, slots=2, kv_usage=0.5)
    assert _place(router, "c", "delta " * 400) == []


def test_a_peer_with_room_beats_holding_behind_full_replicas():
    """Every local replica full and a peer with room whose price (round trip + prefill) beats the slot wait."""
    router = _router(peers=("eu",))
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True, pending=2, running=2, slots=2, kv_usage=0.5)
    router.policy.rates.ttft.service.observe("r0", 30.0)
    router.policy.rates.ttft.service.observe("r1", 30.0)
    router.observe_peer("eu", now=0.0, rtt_s=0.1, status=PeerStatus(
        "eu", available_replicas=2, replicas=2, queue_len=0, models=None, backlog_tokens=0,
        prefill_fixed_ms=50, prefill_ms_per_token=0.5))
    [d] = _place(router, "a", "omega " * 400)
    assert d.route == "peer"


def test_the_fit_learns_from_responses_behind_others():
    """A response that shared its replica still teaches the prefill line (the backlog ahead counted in its x)."""
    router = _router(peers=())
    policy = router.policy
    for i in range(40):
        for rid in router.replicas:
            router.observe_replica(rid, now=float(i), healthy=True, pending=0, running=0, slots=2, kv_usage=0.5)
        [d] = _place(router, f"q{i}", f"word{i} " * 300, now=float(i))
        policy.rates.dispatched(router.replicas[d.target].rates, f"other{i}", "m", "x")  # not alone
        router.observe_response(d, Usage(prompt_tokens=450, prefilled_tokens=450, output_tokens=10),
                                ttft_s=0.2 + 0.001 * 450, e2e_s=2.0)
        router.finished(d)
    line = policy.rates.ttft.line(router.replicas["r0"])
    assert line.seconds(450) == pytest.approx(0.2 + 0.45, rel=0.15)


def test_the_load_guard_sends_a_hit_to_the_least_loaded_replica_when_loads_are_imbalanced():
    """Past ``ttft_balance_abs_threshold`` outstanding requests of imbalance, the replica holding the prefix loses
    to the least loaded one (the cost sees TTFT, not the slower decode of a larger batch); 0 turns the guard off."""
    for threshold, expect_hit in ((2, False), (0, True)):
        router = _router(peers=(), ttft_balance_abs_threshold=threshold)
        [first] = _place(router, "a", P + "turn one")
        router.first_token(first)
        router.replicas[first.target].outstanding = 5  # busy with other sessions' decodes
        router.observe_replica(first.target, now=0.0, healthy=True, pending=0, running=1, slots=8, kv_usage=0.5)
        [second] = _place(router, "b", P + "turn two")
        assert (second.target == first.target) is expect_hit
