"""bench/sim/capacity.py: the closed-loop client sweep on one simulated replica."""

from __future__ import annotations

from bench.emulator.model import EngineParams
from bench.sim.capacity import main, sweep


def test_first_wait_point_is_the_first_client_count_whose_mean_waiting_passes_the_threshold():
    """Two WildChat-like clients never wait on an L4-sized SGLang replica; forty always do (KV holds about 17)."""
    result = sweep([2, 40], params=EngineParams(admission="sglang"), warmup_s=20.0, window_s=60.0)
    low, high = result.points
    assert low.mean_waiting == 0.0 and abs(low.mean_running - 2) < 0.1
    assert high.mean_waiting > 10 and high.mean_running < 40
    assert result.first_wait_clients == 40


def test_cli_prints_the_table(capsys):
    """main(argv) prints one row per client count and the first-wait line."""
    assert main(["--clients", "1", "--warmup-s", "5", "--window-s", "20"]) == 0
    out = capsys.readouterr().out
    assert "clients (outstanding)" in out and "first wait (mean waiting > 0.5): None clients" in out
