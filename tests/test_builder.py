"""One translation from settings to the routing core: the live balancer and the simulator build equal routers."""

from __future__ import annotations

import pytest

from bench.sim.systems import SYSTEMS, build
from bench.sim.workloads import SimRequest, Workload
from skylb.balancer.balancer import Balancer
from skylb.config import BalancerConfig, load_config
from skylb.core import PolicyError, Router, RouterSettings, build_router


def _shape(router: Router) -> tuple:
    """What makes two routers route alike: the policy name and options, the rules, the region."""
    return router.policy.name, router.policy.options, router.rules, router.region


def _sim_router(system: str, settings: BalancerConfig, region: str = "us") -> Router:
    request = SimRequest("r0", "k0", ["tok"] * 8, 2, arrival_s=0.0, region=region)
    cluster = build(SYSTEMS[system], Workload("one", "one", arrivals=[request]), {"us": 1, "eu": 1, "asia": 1},
                    seed=0, stop_at=1.0, settings=settings)
    return cluster.balancers[region].router


@pytest.mark.parametrize("overrides", [
    {},
    {"tau": 5, "max_dispatch_per_probe": 0, "probe_interval_ms": 50},
    {"policies": {"skylb": {"match_threshold": 0.2, "trie_chunk_chars": 64, "balance_abs_threshold": 8}}},
])
def test_simulated_skylb_and_live_balancer_get_equal_routers(overrides):
    """From the same config, the simulator's SkyLB and the live balancer build routers with equal policy, options
    and availability rules (no setting passed in one place and forgotten in the other)."""
    cfg = load_config(None).balancer_for("us").model_copy(update=overrides)
    cfg = BalancerConfig.model_validate(cfg.model_dump())
    live = Balancer(cfg, region="us", advertise_url="http://127.0.0.1:1").router
    assert _shape(_sim_router("SkyLB", cfg)) == _shape(live)
    assert live.max_queue == cfg.max_queue


def test_build_router_reads_each_setting():
    """Staleness is intervals x probe period; the chosen policy gets its own options only."""
    cfg = BalancerConfig(policy="skylb-ch", probe_interval_ms=200, stale_after_intervals=3, tau=4,
                         max_dispatch_per_probe=2, max_queue=7,
                         policies={"skylb": {"match_threshold": 0.9}, "skylb-ch": {"hash_ring_vnodes": 40}})
    router = build_router("eu", cfg)
    assert router.policy.name == "skylb-ch" and router.policy.options.hash_ring_vnodes == 40
    assert (router.rules.tau, router.rules.max_dispatch_per_probe) == (4, 2)
    assert router.rules.stale_after_s == pytest.approx(0.6)
    assert router.max_queue == 7 and build_router("eu", cfg, max_queue=10 ** 9).max_queue == 10 ** 9


def test_build_router_reads_the_declared_peer_outlier_fleet_and_priority_settings():
    """The four settings the builder once read with getattr defaults are declared and reach the router."""
    cfg = BalancerConfig(probe_interval_ms=100, peer_stale_after_intervals=2,
                         outlier_detection={"consecutive_5xx": 9, "max_ejection_percent": 30},
                         ollama_fleet={"hot_preference": True}, priorities={"enabled": True, "aging_s": 12})
    router = build_router("eu", cfg)
    assert router.rules.peer_stale_after_s == pytest.approx(0.2)
    assert (router.outlier.consecutive_5xx, router.outlier.max_ejection_percent) == (9, 30)
    assert router.fleet.settings.hot_preference is True
    assert type(router.queue).__name__ == "ClassQueue" and router.queue.aging_s == 12
    assert {"peer_stale_after_intervals", "outlier_detection", "ollama_fleet", "priorities"} <= set(
        RouterSettings.__annotations__)


def test_a_misspelt_policy_option_fails_at_config_load():
    """A typo in a policy option is a config error, live and in the simulator, never a silent default."""
    with pytest.raises(ValueError, match="match_treshold"):
        BalancerConfig(policies={"skylb": {"match_treshold": 0.2}})
    with pytest.raises(PolicyError):
        build_router("us", BalancerConfig.model_construct(policy="skylb",
                                                          policies={"skylb": {"match_treshold": 0.2}}))
