"""The simulator feeds the routing core the signals the live balancer feeds it: measured speed from each response at
the dispatching balancer (skylb/balancer/usage.py), and one token count (the balancer's estimate from the prompt
text) equal to the engine's for the workloads' prompts."""

from __future__ import annotations

from bench.emulator.model import text_tokens as engine_tokens
from bench.sim.cluster import Network
from bench.sim.systems import SYSTEMS, build
from bench.sim.workloads import ARENA, TOT_2, SimRequest, Workload, conversations, trees
from bench.workload import WorkloadConfig, prompt_from_blocks, synthetic_workload
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
