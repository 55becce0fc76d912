"""The simulator feeds the routing core the signals the live balancer feeds it: measured speed from each response at
the dispatching balancer (skylb/balancer/usage.py), and one token count (the balancer's estimate from the prompt
text) equal to the engine's for the workloads' prompts."""

from __future__ import annotations

from bench.emulator.model import text_tokens as engine_tokens
from bench.sim.cluster import Network
from bench.sim.systems import SYSTEMS, build
from bench.sim.workloads import ARENA, TOT_2, SimRequest, Workload, conversations, trees
from bench.replay.workload import WorkloadConfig, prompt_from_blocks, synthetic_workload
from skylb.core import Router
from skylb.core.estimate import prompt_tokens, text_tokens

COUNTS = {"us": 1, "eu": 1, "asia": 1}


def _burst(n: int, *, prompt: int, output: int) -> Workload:
    """``n`` requests sent at once from us, each with its own first word (no shared prefix beyond it)."""
    arrivals = [SimRequest(f"r{i}", f"k{i}", [f"w{i:02d}"] + ["tok"] * (prompt - 1), output, arrival_s=0.0,
                           region="us") for i in range(n)]
    return Workload("burst", "burst", arrivals=arrivals)


def test_simulated_skylb_learns_prefill_rates_at_the_dispatching_balancer():
    """Each response teaches the balancer that placed it on its replica (not the forwarding one) a measured rate."""
    cluster = build(SYSTEMS["SkyLB"], _burst(24, prompt=600, output=30), COUNTS, seed=0, stop_at=60.0).run()
    placed: dict[tuple[str, str], int] = {}
    for f in cluster.records:
        key = (f.dispatcher.region, f.replica.id)
        placed[key] = placed.get(key, 0) + 1
    assert any(f.forwarded for f in cluster.records)
    for region, balancer in cluster.balancers.items():
        for rid, state in balancer.router.replicas.items():
            assert state.rates.overall.samples == placed.get((region, rid), 0)
            if placed.get((region, rid)):
                assert state.rates.prefill_s_per_token is not None and state.rates.prefill_s_per_token > 0


def test_simulated_observe_uses_times_at_the_balancer_and_precedes_finished(monkeypatch):
    """TTFT and E2E given to observe_response are measured from dispatch to the first token and the stream end
    passing the balancer (one one-way hop after the replica), with the usage the engine reported; before finished."""
    calls: list[tuple] = []
    observe, finished = Router.observe_response, Router.finished

    def spy_observe(self, decision, usage, *, ttft_s, e2e_s):
        calls.append(("observe", decision.request.id, usage, ttft_s, e2e_s, decision.dispatched_at))
        return observe(self, decision, usage, ttft_s=ttft_s, e2e_s=e2e_s)

    def spy_finished(self, decision):
        calls.append(("finished", decision.request.id))
        return finished(self, decision)

    monkeypatch.setattr(Router, "observe_response", spy_observe)
    monkeypatch.setattr(Router, "finished", spy_finished)
    network = Network(local_rtt_ms=10.0)  # 5 ms each way
    cluster = build(SYSTEMS["RegionLocal"], _burst(1, prompt=500, output=20), {"us": 1}, seed=0, stop_at=10.0,
                    network=network).run()
    (flight,) = cluster.records
    assert [c[0] for c in calls] == ["observe", "finished"]
    _, rid, usage, ttft_s, e2e_s, dispatched_at = calls[0]
    result = flight.result
    assert (usage.prompt_tokens, usage.output_tokens) == (500, 20)
    assert usage.prefilled_tokens == result.prompt_tokens - result.cached_tokens
    hop = 0.005
    assert abs(ttft_s - (result.first_token_at + hop - dispatched_at)) < 1e-9
    assert abs(e2e_s - (result.finished_at + hop - dispatched_at)) < 1e-9


def test_balancer_token_count_equals_engine_count_for_workload_prompts():
    """characters / 4 (rounded up) of every generated prompt is its engine word count: one token count."""
    prompts = [r.prompt for r in synthetic_workload(WorkloadConfig(trace=None, synthetic_conversations=3,
                                                                   synthetic_turns=3), ["us", "eu", "asia"])]
    prompts += [prompt_from_blocks([7, 8, 9], n, 64) for n in (1, 2, 63, 64, 65, 150)]
    for workload in (conversations(ARENA, {"us": 2}, seed=0), trees(TOT_2, {"us": 1}, seed=0)):
        for client in workload.clients:
            prompts += [r.text for r in client.programs(0)]
    assert len(prompts) > 30
    for text in prompts:
        assert text_tokens(text) == len(engine_tokens(text)), text[:60]


def test_simulated_router_request_is_built_from_the_text_alone(monkeypatch):
    """As the live route stage does: no prompt_tokens given, so the router's count is its estimate of the text,
    which equals the prompt's token count."""
    seen = []
    enqueue = Router.enqueue

    def spy(self, request):
        seen.append(request)
        return enqueue(self, request)

    monkeypatch.setattr(Router, "enqueue", spy)
    workload = conversations(ARENA, {"us": 2}, seed=0)
    cluster = build(SYSTEMS["SkyLB"], workload, {"us": 1}, seed=0, stop_at=5.0).run()
    lengths = {f.req.id: len(f.req.tokens) for f in cluster.records}
    assert seen and all(r.prompt_tokens is None for r in seen)
    assert all(prompt_tokens(r) == lengths[r.id] for r in seen if r.id in lengths)


def _live_row(system: str, rps: float, p90: float, fwd: float) -> dict:
    return {"system": system, "status": "ok",
            "figures": {"throughput_rps": rps, "ttft_p90_ms": p90, "forwarded_frac": fwd}}


def test_parity_cells_use_the_widened_live_spread_and_orderings_only_where_spreads_do_not_overlap():
    """A simulated figure passes inside [0.9 min, 1.1 max] of the live runs and misses outside; two systems are
    ordered only when their live spreads are apart, and every seed must keep that order."""
    from bench.live.regions import parity
    rounds = [[_live_row("a", 5.0, 1000.0, 0.3), _live_row("b", 2.0, 900.0, 0.0)],
              [_live_row("a", 6.0, 1100.0, 0.4), _live_row("b", 2.2, 1050.0, 0.0)]]
    sims = {0: {"a": {"throughput_rps": 6.5, "ttft_p90_ms": 950.0, "forwarded_frac": 0.28},
                "b": {"throughput_rps": 2.0, "ttft_p90_ms": 1300.0, "forwarded_frac": 0.0}},
            1: {"a": {"throughput_rps": 4.6, "ttft_p90_ms": 1000.0, "forwarded_frac": 0.42},
                "b": {"throughput_rps": 1.9, "ttft_p90_ms": 800.0, "forwarded_frac": 0.0}}}
    out = parity(rounds, sims)
    cells = {(c["system"], c["figure"]): c["pass"] for c in out["cells"]}
    assert cells == {("a", "throughput_rps"): True, ("b", "throughput_rps"): True, ("a", "ttft_p90_ms"): True,
                     ("b", "ttft_p90_ms"): False, ("a", "forwarded_frac"): True, ("b", "forwarded_frac"): True}
    # TTFT spreads overlap (900-1050 vs 1000-1100): no ordering; throughput and forwarded share are apart
    assert {(o["figure"], o["below"], o["above"], o["pass"]) for o in out["orderings"]} == {
        ("throughput_rps", "b", "a", True), ("forwarded_frac", "b", "a", True)}
    assert (out["cells_passed"], out["cells_total"], out["orderings_passed"]) == (5, 6, 2)
