"""The probing-cost measurement (bench/live/probe_cost.py) on real processes: its figures are consistent with each other
and it is a `skylb bench` subcommand."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(60)
def test_probe_cost_measures_an_idle_balancer_probing_its_replicas(tmp_path):
    """Two replicas probed every 100 ms (20 probes a second, no backoff) for 3 s: the balancer and the emulator used
    CPU, and the per-replica and per-probe figures are the whole divided by 2 replicas and by 20 probes a second.
    The window holds 60 probes: /proc counts CPU in 10 ms ticks, and 15 probes (the former 1.5 s at 200 ms) cost
    the emulator less than one tick, so it once read 0."""
    from bench.bench_cli import LIVE_BENCHMARKS
    from bench.live.probe_cost import measure_once
    assert "probe_cost" in LIVE_BENCHMARKS
    got = measure_once(2, 100, 3.0, tmp_path)  # no backoff: every replica every interval
    assert got["balancer_ms_per_s"] > 0 and got["emulator_ms_per_s"] > 0
    assert got["per_replica_ms_per_s"] == pytest.approx(got["balancer_ms_per_s"] / 2)
    assert got["probes_per_s"] == pytest.approx(20)
    assert got["per_probe_ms"] == pytest.approx(got["balancer_ms_per_s"] / 20)
