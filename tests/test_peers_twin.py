"""bench/sim/peers_twin.py: the live comparisons replayed in the simulator (a small trace, a few clients)."""

from bench.live.baselines import BaselinesSetup
from bench.live.peers import PeersSetup
from bench.sim.peers_twin import simulate, simulate_one_region
from tests.test_peers import _write_trace


def test_three_regions_skylb_forwards_and_the_router_in_us_serves_every_client(tmp_path):
    setup = PeersSetup(trace=str(_write_trace(tmp_path / "t.jsonl")), clients=6, duration_s=20.0, pool_requests=9,
                       max_turns=3)
    figs = simulate(setup, 0, ["skylb", "sglang-cache_aware"])
    for fig in figs.values():
        assert fig["rps"] > 0 and fig["p90"] >= fig["p50"] > 0
        assert set(fig["p90_by_region"]) <= {"us", "eu", "asia"}
    assert figs["sglang-cache_aware"]["fwd"] == 0  # one router: nothing crosses a balancer hop
    assert all(limit >= 2 for limit in figs["skylb"]["limits"]) and len(figs["skylb"]["limits"]) == 12


def test_one_region_runs_every_request_and_keeps_the_engines_queue_short():
    setup = BaselinesSetup(conversations=8, turns=4)
    figs = simulate_one_region(setup, 0, ["skylb", "sglang-cache_aware"], config={"pending_allowance": 1})
    assert figs["skylb"]["pending_peak"] <= 2  # the learned batch of 4, plus the one request allowed to wait
    assert figs["skylb"]["rps"] > 0 and figs["sglang-cache_aware"]["rps"] > 0
