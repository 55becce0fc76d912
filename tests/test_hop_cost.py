"""The one-hop cost measurement (bench/live/hop_cost.py) on real processes: every request answered, its streamed events
counted, the per-request and per-event figures consistent with each other; a `skylb bench` subcommand."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(90)
def test_hop_cost_measures_a_balancer_relaying_streams(tmp_path):
    """12 streamed requests of 5 output tokens from 3 clients through one static balancer: each answer has one SSE
    event per token (the emulator sends one per output token; the balancer relays them whole), and the CPU per event
    is the CPU per request spread over those events."""
    from bench.bench_cli import LIVE_BENCHMARKS
    from bench.live.hop_cost import measure_once
    assert "hop_cost" in LIVE_BENCHMARKS
    got = measure_once(stream=True, time_scale=0.02, requests=12, clients=3, output_tokens=5, prompt_words=20,
                       work=tmp_path)
    assert got["requests"] == 12
    assert got["events_per_request"] >= 5
    assert got["cpu_ms_per_request"] > 0 and got["cpu_ms_per_s"] > 0
    assert got["cpu_us_per_event"] == pytest.approx(1000 * got["cpu_ms_per_request"] / got["events_per_request"])
