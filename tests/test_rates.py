"""Measured speed (skylb/core/rates.py) and the ``estimated-wait`` policy (seed 000, OllamaRouter): the EMA update,
the token-estimation factor, the queue weight gamma, the estimate W^, exploration of unmeasured replicas, the shared
prefill rate in the default policy's WaitModel, and the default policy's tie-breaker. Pure: no processes."""

from __future__ import annotations

import pytest

from skylb.core import AvailabilityRules, Request, Router, make_policy
from skylb.core.estimate import WaitModel, pace_classes_apart, pace_slowdowns
from skylb.core.policies import PolicyError
from skylb.core.rates import DEFAULT_TOKEN_FACTOR, ModelRates, RateBook, ReplicaRates, Usage, prompt_chars
from skylb.core.state import ReplicaState


def _ollama(prompt=100, out=50, prompt_s=0.1, decode_s=0.9) -> Usage:
    return Usage(prompt_tokens=prompt, prefilled_tokens=prompt, output_tokens=out, prompt_s=prompt_s,
                 decode_s=decode_s)


def test_prompt_chars_counts_whitespace_runs_once():
    assert prompt_chars("  a  b\n\n\tc ") == 5
    assert prompt_chars("") == 0


def test_first_response_sets_the_emas_then_they_move_by_alpha():
    """t^ = service / (prompt + output); prefill and decode per token from the engine's durations; EMA weight a."""
    book, rates = RateBook(alpha=0.5), ReplicaRates()
    book.dispatched(rates, "q1", "m", "x" * 600)
    assert book.observe(rates, "q1", _ollama(100, 50, 0.1, 0.9), ttft_s=0.2, e2e_s=1.2)
    m = rates.for_model("m")
    assert m.time_per_token_s == pytest.approx(1.0 / 150)
    assert m.prefill_s_per_token == pytest.approx(0.001)
    assert m.decode_s_per_token == pytest.approx(0.018)
    assert book.token_factor == pytest.approx(150 / 600)
    book.released(rates, "q1")
    book.dispatched(rates, "q2", "m", "x" * 300)
    assert book.observe(rates, "q2", _ollama(100, 50, 0.3, 2.7), ttft_s=0.4, e2e_s=3.1)
    m = rates.for_model("m")
    assert m.time_per_token_s == pytest.approx(0.5 * 3.0 / 150 + 0.5 * 1.0 / 150)
    assert m.prefill_s_per_token == pytest.approx(0.5 * 0.003 + 0.5 * 0.001)
    assert book.token_factor == pytest.approx(0.5 * 150 / 300 + 0.5 * 150 / 600)
    assert m.samples == 2 and rates.overall.samples == 2


def test_without_engine_durations_the_measured_times_are_used():
    """OpenAI usage carries no durations: t^ from the end-to-end time; prefill from TTFT (only when nothing else of
    this balancer's was in flight there: a TTFT behind a queue is not prefill); cached tokens are not prefilled."""
    book, rates = RateBook(alpha=1.0), ReplicaRates()
    book.dispatched(rates, "q1", "m", "x" * 400)
    usage = Usage(prompt_tokens=100, prefilled_tokens=80, output_tokens=21)
    assert book.observe(rates, "q1", usage, ttft_s=0.16, e2e_s=2.16)
    m = rates.for_model("m")
    assert m.time_per_token_s == pytest.approx(2.16 / 121)
    assert m.prefill_s_per_token == pytest.approx(0.16 / 80)
    assert m.decode_s_per_token == pytest.approx(2.0 / 20)
    book.dispatched(rates, "q2", "m", "y")
    book.dispatched(rates, "q3", "m", "z")  # queued behind q2: its TTFT is not a prefill measurement
    book.released(rates, "q1")
    assert book.observe(rates, "q3", usage, ttft_s=5.0, e2e_s=7.0)
    assert rates.for_model("m").prefill_s_per_token == pytest.approx(0.16 / 80)


def test_nothing_is_learned_without_token_counts_or_for_an_unknown_request():
    book, rates = RateBook(), ReplicaRates()
    book.dispatched(rates, "q1", "m", "abc")
    assert not book.observe(rates, "q1", Usage(), ttft_s=None, e2e_s=1.0)
    assert not book.observe(rates, "nope", _ollama(), ttft_s=None, e2e_s=1.0)
    assert rates.for_model("m") is None and book.token_factor == DEFAULT_TOKEN_FACTOR


def test_estimate_is_the_seeds_equation_one():
    """W^ = (gamma x q x f + p x f) x t^, q the characters in flight there; None when unmeasured."""
    book, rates = RateBook(alpha=1.0, token_factor=0.5), ReplicaRates()
    assert book.estimate_s(rates, "m", 100) is None
    book.dispatched(rates, "q1", "m", "x" * 100)
    book.observe(rates, "q1", _ollama(25, 25, 0.5, 0.5), ttft_s=None, e2e_s=1.0)  # t^ = 1/50 s
    book.released(rates, "q1")
    rates.gamma = 1.5
    book.dispatched(rates, "q2", "m", "x" * 200)
    assert rates.queued_chars == 200
    assert book.estimate_s(rates, "m", 100) == pytest.approx((1.5 * 200 * 0.5 + 100 * 0.5) / 50)
    assert book.queue_wait_s(rates) == pytest.approx(1.5 * 200 * 0.5 / 50)
    assert book.estimate_s(rates, "other-model", 100) is None
    book.released(rates, "q2")
    assert rates.queued_chars == 0 and not rates.inflight


@pytest.mark.parametrize("measured_s, gamma_after", [
    (2.0, 1.5),   # twice as long as estimated: gamma x (1 + 0.5 x (2 - 1))
    (0.5, 0.75),  # half: gamma x (1 + 0.5 x (0.5 - 1))
    (100.0, 2.0),  # clipped to 2
])
def test_gamma_learns_measured_against_estimated_wait(measured_s, gamma_after):
    book, rates = RateBook(alpha=0.5), ReplicaRates()
    book.dispatched(rates, "q0", "m", "x" * 100)
    book.observe(rates, "q0", _ollama(50, 50, 0.5, 0.5), ttft_s=None, e2e_s=1.0)
    assert rates.gamma == 1.0  # no estimate at its dispatch: gamma <- 1
    book.released(rates, "q0")
    book.dispatched(rates, "q1", "m", "x" * 100)
    estimate = rates.inflight["q1"].estimate_s
    assert estimate > 0
    book.observe(rates, "q1", _ollama(50, 50, 0.5, 0.5), ttft_s=None, e2e_s=measured_s * estimate)
    assert rates.gamma == pytest.approx(gamma_after)


def test_fixed_gamma_and_bad_settings():
    book, rates = RateBook(gamma=0.0), ReplicaRates()
    rates.gamma = 2.0
    assert book.gamma(rates) == 0.0
    for kwargs in ({"alpha": 0}, {"gamma": 2.5}, {"token_factor": 0}):
        with pytest.raises(ValueError):
            RateBook(**kwargs)
    with pytest.raises(PolicyError):
        make_policy("estimated-wait", gamma=3)
    with pytest.raises(PolicyError):
        make_policy("estimated-wait", alfa=0.1)


# -- the router and the policies ----------------------------------------------------------------------------------

def _router(policy="estimated-wait", n=2, **options) -> Router:
    router = Router(region="us", policy=make_policy(policy, **options),
                    rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([(f"r{i}", f"http://r{i}", "ollama") for i in range(n)])
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True)
        router.set_replica_models(rid, ["m"])
    return router


def _serve(router, rid, i, per_token_s, *, text="x" * 100, tokens=(25, 25)) -> None:
    """Route one request to ``rid`` by hand (as the router would) and report a response at ``per_token_s``."""
    d = _place_on(router, rid, f"warm{rid}{i}", text)
    n = sum(tokens)
    router.observe_response(d, _ollama(tokens[0], tokens[1], per_token_s * tokens[0], per_token_s * tokens[1]),
                            ttft_s=None, e2e_s=per_token_s * n)
    router.finished(d)


def _place_on(router, rid, request_id, text):
    others = [r for r in router.replicas if r != rid]
    for o in others:
        router.replicas[o].healthy = False
    router.enqueue(Request(request_id, text, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    for o in others:
        router.replicas[o].healthy = True
    assert d.target == rid
    return d


def test_unmeasured_idle_replica_is_tried_first_then_the_faster_wins():
    """Seed 000's exploration: an unmeasured replica with nothing in flight counts W^ = 0; once both are measured
    the one with less time per token gets the request."""
    router = _router()
    _serve(router, "r0", 0, 0.01)
    router.enqueue(Request("a", "x" * 100, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    assert d.target == "r1"  # never measured, idle: explored
    router.observe_response(d, _ollama(25, 25, 0.75, 0.75), ttft_s=None, e2e_s=1.5)  # 3x slower
    router.finished(d)
    router.enqueue(Request("b", "x" * 100, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    assert d.target == "r0"


def test_unmeasured_busy_replica_is_not_a_candidate_while_another_is_measured():
    router = _router(n=3)
    _serve(router, "r0", 0, 0.01)
    busy = _place_on(router, "r1", "busy", "x" * 100)  # unmeasured, one in flight
    _serve(router, "r2", 0, 0.001)
    router.enqueue(Request("a", "x" * 10, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    assert d.target == "r2"
    router.finished(busy)


def test_three_times_slower_replica_gets_about_a_quarter_of_a_backlog():
    """With every request in flight (blind pushing, nothing finished), W^ grows with each queued request, so a
    replica three times slower gets about 1/(1+3) of the work."""
    router = _router()
    _serve(router, "r0", 0, 0.01)
    _serve(router, "r1", 0, 0.03)
    for i in range(200):
        router.enqueue(Request(f"q{i}", "x" * 100, 0.0, model="m"))
    decisions = router.dispatch(0.0)
    slow = sum(d.target == "r1" for d in decisions)
    assert len(decisions) == 200 and slow == pytest.approx(50, abs=3)


def test_default_policy_shares_the_measured_prefill_rate():
    """The ``skylb`` policy's WaitModel converts backlog at the replica's measured prefill rate, the configured
    constant only while unmeasured (or with measured_prefill false)."""
    router = _router("skylb")
    r0 = router.replicas["r0"]
    r0.add_unprefilled("x", 1000)
    assert router.policy.estimator.wait.wait_s(r0) == pytest.approx(0.5)  # 2000 tokens/s configured
    _serve(router, "r0", 0, 0.004)  # prefill 4 ms per token measured
    assert router.policy.estimator.wait.wait_s(r0) == pytest.approx(4.0)
    assert router.status(0.0).wait_ms is not None
    off = WaitModel(measured=False)
    assert off.wait_s(r0) == pytest.approx(0.5)
    r = ReplicaState(id="u", url="x")
    assert WaitModel().prefill_s(2000, r) == pytest.approx(1.0)


def test_pace_slowdowns_are_the_smaller_ratio_to_the_fastest_and_none_without_a_pace():
    """Each candidate's slowdown is the smaller of its time-per-token and inter-token-latency ratios to the fastest
    of each; a candidate without both paces (or a lone paced one) has none."""
    fast = ModelRates(time_per_token_s=0.05, itl_s=0.07)
    slow = ModelRates(time_per_token_s=0.20, itl_s=0.21)
    unpaced = ModelRates(time_per_token_s=0.30)
    assert pace_slowdowns([fast, slow, unpaced, None]) == pytest.approx([1.0, 3.0, None, None])
    assert pace_slowdowns([fast, unpaced]) == [None, None]


def test_pace_classes_apart_is_true_whenever_a_slowdown_reaches_the_ratio():
    """The quick test the decision runs before ``pace_slowdowns``: never False when some candidate's slowdown is at
    least the ratio (so skipping on False changes no decision), over random paces (both ratios, one only, ties at
    the ratio, too few paced); False for one hardware class."""
    import random
    assert not pace_classes_apart([ModelRates(time_per_token_s=0.05, itl_s=0.07), None], 2.5)
    assert not pace_classes_apart([ModelRates(time_per_token_s=0.05, itl_s=0.07),
                                   ModelRates(time_per_token_s=0.5, itl_s=0.1)], 2.5)  # slower in one pace only
    assert pace_classes_apart([ModelRates(time_per_token_s=0.04, itl_s=0.02),
                               ModelRates(time_per_token_s=0.1, itl_s=0.05)], 2.5)  # exactly 2.5x in both
    rng = random.Random(7)
    for _ in range(500):
        paces = [None if rng.random() < 0.1 else
                 ModelRates(time_per_token_s=rng.choice((None, rng.uniform(0.01, 0.1), 0.04)),
                            itl_s=rng.choice((None, rng.uniform(0.01, 0.1), 0.02)))
                 for _ in range(rng.randint(0, 6))]
        if any(x is not None and x >= 2.5 for x in pace_slowdowns(paces)):
            assert pace_classes_apart(paces, 2.5), paces
    assert not pace_classes_apart([ModelRates(time_per_token_s=rng.uniform(0.04, 0.09), itl_s=rng.uniform(0.02, 0.045))
                                   for _ in range(200)], 2.5)


def test_an_unmeasured_replica_of_a_slower_class_is_priced_at_its_measured_slowdown():
    """A replica never alone under load has no measured prefill rate and is priced at the fastest measured one; with
    ``pace_class_ratio`` one whose time per token and inter-token latency (from every response) are both at least
    that many times the fastest candidate's is priced at the fastest rate times the smaller slowdown. A replica
    less than that much slower, or a model without the ratio, keeps the optimistic price."""
    fast, slow, peer = (ReplicaState(id=i, url="x") for i in ("fast", "slow", "peer"))
    fast.rates.overall.prefill_s_per_token = 0.0005
    for r, tpt, itl in ((fast, 0.05, 0.07), (slow, 0.20, 0.30), (peer, 0.06, 0.08)):
        r.rates.overall.time_per_token_s, r.rates.overall.itl_s = tpt, itl
    classed, plain = WaitModel(pace_class_ratio=2.5), WaitModel()
    assert classed.ttft_among_s([fast, slow, peer], [1000.0] * 3) == pytest.approx([0.5, 2.0, 0.5])  # 4x: min(4, 4.3)
    assert plain.ttft_among_s([fast, slow, peer], [1000.0] * 3) == pytest.approx([0.5, 0.5, 0.5])
    slow.rates.overall.itl_s = 0.15  # 2.1x in inter-token latency: one class with the fast one
    assert classed.ttft_among_s([fast, slow], [1000.0] * 2) == pytest.approx([0.5, 0.5])


def test_default_policy_explores_an_unmeasured_replica_beside_a_measured_one():
    """A replica added (or failed over) beside one measured 20x faster than the configured constant: the new one is
    estimated at the fastest measured rate, so at idle the two tie and it is tried (then measured); at the configured
    constant it lost every idle-time choice and stayed unmeasured (CI: 20 of 20 probes on the measured replica)."""
    for measured_prefill, expected in ((True, "r1"), (False, "r1")):
        router = _router("skylb", measured_prefill=measured_prefill)
        _serve(router, "r0", 0, 0.0005 / 20, text="warm zero")  # 20x the configured 2000 tokens/s
        prior = router.policy.estimator.wait.prior_s_per_token(router.replicas.values())
        assert prior == (pytest.approx(0.0005 / 20) if measured_prefill else None)
        router.enqueue(Request("a", "a fresh prompt " * 40, 0.0, model="m"))
        (d,) = router.dispatch(0.0)
        assert d.target == expected
        wait, replicas = router.policy.estimator.wait, list(router.replicas.values())
        # the decision's one pass (each rate read once) gives the same figures as the two calls
        assert wait.ttft_among_s(replicas, [300.0, 0.0]) == wait.ttft_s(replicas, [300.0, 0.0],
                                                                          wait.prior_s_per_token(replicas))
    unmeasured = router.replicas["r1"]
    assert WaitModel().prefill_s(2000, unmeasured, 0.0001) == pytest.approx(0.2)
    assert WaitModel(measured=False).prefill_s(2000, unmeasured, 0.0001) == pytest.approx(1.0)


def test_default_policy_breaks_ties_by_estimated_wait():
    """Two idle replicas, no prefix match anywhere, a prompt too short for the prefill difference to matter: the
    faster one by measured time per token wins every time (tie_break), turns otherwise."""
    picks = {}
    for tie_break in ("estimated-wait", "least-load"):
        router = _router("skylb", tie_break=tie_break, measured_prefill=False)
        _serve(router, "r0", 0, 0.03, text="warm zero")
        _serve(router, "r1", 0, 0.01, text="warm one")
        got = []
        for i in range(6):
            router.enqueue(Request(f"q{i}", f"fresh prompt {i}", 0.0, model="m"))
            (d,) = router.dispatch(0.0)
            got.append(d.target)
            router.finished(d)
        picks[tie_break] = got
    assert picks["estimated-wait"] == ["r1"] * 6
    assert set(picks["least-load"]) == {"r0", "r1"}


def test_load_time_hook_adds_to_the_estimate():
    """RateBook.load_s (0 until model thermal state sets it) counts in the total: a faster replica that must load
    the model first loses to a slower one that has it loaded."""
    router = _router()
    _serve(router, "r0", 0, 0.03)
    _serve(router, "r1", 0, 0.01)
    router.policy.rates.load_s = lambda replica, model: 10.0 if replica.id == "r1" else 0.0
    router.enqueue(Request("a", "x" * 100, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    assert d.target == "r0"


def test_the_router_counts_the_fleets_load_time_with_hot_preference():
    """With hot preference on, the Router sets RateBook.load_s to the fleet's (skylb/core/fleet_rules.py): 0 where the
    model is hot or the replica is not an Ollama one, the measured or default load time where the model is only on
    disk; so the estimate of a fast replica that must load the model exceeds that of a slower one where it is hot.
    Off (the default), load time counts nothing: thermal state changes no routing."""
    from skylb.core.fleet_rules import FleetRules, FleetSettings, FleetView, canonical

    assert _router().policy.rates.load_s(ReplicaState(id="x", url="http://x", engine="ollama"), "m") == 0.0
    router = Router(region="us", policy=make_policy("estimated-wait"),
                    rules=AvailabilityRules(max_dispatch_per_probe=0),
                    fleet=FleetRules(FleetSettings(hot_preference=True)))
    router.set_replicas([(f"r{i}", f"http://r{i}", "ollama") for i in range(2)])
    for rid in router.replicas:
        router.observe_replica(rid, now=0.0, healthy=True)
        router.set_replica_models(rid, ["m"])
    _serve(router, "r0", 0, 0.03)
    _serve(router, "r1", 0, 0.01)
    hook = router.policy.rates.load_s
    assert hook(router.replicas["r0"], "m") == 0.0  # no fleet view: not an Ollama replica
    for rid, loaded in (("r0", {canonical("m"): None}), ("r1", {})):
        view = router.replicas[rid].fleet = FleetView()
        view.observe_tags({canonical("m"): None})
        view.observe_ps(loaded, 0.0)
    assert hook(router.replicas["r0"], "m") == 0.0
    assert hook(router.replicas["r1"], "m") == router.fleet.settings.default_load_s > 0
    router.enqueue(Request("a", "x" * 100, 0.0, model="m"))
    (d,) = router.dispatch(0.0)
    assert d.target == "r0"


def test_prompt_chars_ascii_fast_path_equals_split_and_join():
    """The ASCII path (translate, then collapse runs) counts exactly as ``" ".join(text.split())`` does, every ASCII
    whitespace character included; non-ASCII text takes split and join."""
    import random
    rng = random.Random(7)
    alphabet = "ab \t\n\x0b\x0c\r\x1c\x1d\x1e\x1f"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert prompt_chars(text) == len(" ".join(text.split())), repr(text)
    assert prompt_chars("é  a\u2003b") == len("é a b")


def test_rates_measure_the_inter_token_latency_of_every_streamed_response():
    """``ModelRates.itl_s`` is learned from a response that shared its replica with others (decode per output token
    only from a lone one), from the engine's decode time when it reports it, and not from a whole answer."""
    book, rates = RateBook(alpha=1.0), ReplicaRates()
    book.dispatched(rates, "a", "", "w" * 100)
    book.dispatched(rates, "b", "", "w" * 100)  # not alone
    assert book.observe(rates, "b", Usage(prompt_tokens=20, output_tokens=11), ttft_s=0.2, e2e_s=1.2)
    m = rates.models[""]
    assert m.decode_s_per_token is None and m.itl_s == pytest.approx(0.1)
    book.observe(rates, "a", Usage(prompt_tokens=20, output_tokens=5, decode_s=1.0), ttft_s=None, e2e_s=2.0)
    assert m.itl_s == pytest.approx(0.2)
    book.dispatched(rates, "c", "", "w" * 100)
    book.observe(rates, "c", Usage(prompt_tokens=20, output_tokens=5), ttft_s=None, e2e_s=3.0)  # whole: nothing
    assert m.itl_s == pytest.approx(0.2)
