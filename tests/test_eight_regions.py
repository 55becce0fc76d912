"""The eight-region scenario's pieces (bench/sim/geo.py, gpus.py, follow_the_sun.py, eight_regions.py) and its quick
variant end to end (same code path as the 200-replica run, 24 replicas and a 60 s day)."""

from __future__ import annotations

import math

import pytest

from bench.sim.eight_regions_bench import find_trace, run_one
from bench.emulator.model import EngineParams
from bench.sim.eight_regions import QUICK, SYSTEMS, fleet, scaled_mix
from bench.sim.follow_the_sun import local_hour, rate, start_utc_h
from bench.sim.geo import REGIONS, haversine_km, rtt_matrix
from bench.sim.gpus import GPU_CLASSES, L4, engine_params

TRACE = find_trace()
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"Mooncake trace not at {TRACE} (set SKYLB_TRACE)")


def test_round_trips_follow_the_distance_formula():
    """Round trip = 2 x haversine distance / 200 km/ms x 1.5, one entry per unordered pair of the 8 regions."""
    by = {r.name: r for r in REGIONS}
    rtt = rtt_matrix()
    assert len(REGIONS) == 8 and len(rtt) == 28
    d = haversine_km(by["us-east-1"], by["eu-central-1"])
    assert 6400 < d < 6700  # Ashburn - Frankfurt
    assert rtt[("us-east-1", "eu-central-1")] == pytest.approx(2 * d / 200 * 1.5)


def test_gpu_classes_scale_the_l4_defaults_by_their_resources():
    """The L4 keeps EngineParams' defaults; faster classes get shorter steps and an A100 more KV tokens."""
    assert engine_params(L4) == EngineParams()
    a10, a100 = engine_params(GPU_CLASSES["A10"]), engine_params(GPU_CLASSES["A100"])
    assert a10.decode_base_ms == pytest.approx(53.5 * 300 / 600)
    assert a100.prefill_ms_per_token == pytest.approx(0.48 * 121 / 312)
    assert a10.kv_cache_tokens == 32768 and a100.kv_cache_tokens % 16 == 0 and a100.kv_cache_tokens > 4 * 32768


def test_rate_peaks_at_two_in_the_afternoon_local_time():
    """The diurnal curve is 1 at 14:00 local, its floor 0.1 at 02:00, and each region's hour follows its offset."""
    assert rate(14.0) == pytest.approx(1.0) and rate(2.0) == pytest.approx(0.1)
    tokyo = next(r for r in REGIONS if r.name == "ap-northeast-1")
    assert local_hour(tokyo, 0.0, 100.0, 5.0) == pytest.approx(14.0)
    assert 0 <= start_utc_h() < 24


def test_scaled_mix_keeps_proportions_and_total():
    """Scaling a region's replicas keeps the total asked for and every class present while it can."""
    assert scaled_mix((("L4", 12), ("A10", 8), ("A100", 5)), 25) == {"L4": 12, "A10": 8, "A100": 5}
    small = scaled_mix((("L4", 12), ("A10", 8), ("A100", 5)), 10)
    assert sum(small.values()) == 10 and all(n > 0 for n in small.values())
    assert len(fleet(small)) == 80


@needs_trace
def test_quick_day_skylb_forwards_in_busy_hours_region_local_never():
    """Quick day: every request completes; SkyLB serves some requests outside their region while that region is
    in its busy hours; region-local never serves outside a region; the global balancer serves most remotely."""
    trace = str(TRACE)
    sky = run_one(QUICK, "SkyLB", 0, trace)
    local = run_one(QUICK, "RegionLocal", 0, trace)
    assert sky["completed"] == sky["sent"] == local["sent"] > 500
    assert sky["forwarded_in_own_peak"] > 0 and sky["remote_in_own_peak"] > 0
    assert local["remote_frac"] == 0 and local["forwarded_in_own_peak"] == 0
    assert math.isfinite(sky["ttft_p90"]) and sky["replicas"] == 24
    assert set(SYSTEMS) >= {"SkyLB", "SkyLB-CH", "RegionLocal", "SGL", "LL", "Oracle"}
