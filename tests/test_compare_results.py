"""bench/sim/compare_results.py: equal results agree whatever their wall times; any other field that differs is named."""

from __future__ import annotations

import json

from bench.sim.compare_results import compare, main


def test_run_time_fields_are_skipped_and_figures_compared():
    """Wall times differ freely; a figure, a missing key or a list of another length is a difference."""
    a = {"results": {"fig8": [{"p90_s": 1.5, "wall_s": 3.0}]}, "runs": [{"seed": 0, "elapsed_s": 9}]}
    b = {"results": {"fig8": [{"p90_s": 1.5, "wall_s": 7.0}]}, "runs": [{"seed": 0, "elapsed_s": 1}]}
    assert compare(a, b) == (2, [])
    c = {"results": {"fig8": [{"p90_s": 1.6}], "extra": 1}, "runs": []}
    count, diffs = compare(a, c)
    assert diffs == ["/results/extra: only in the second", "/results/fig8[0]/p90_s: 1.5 vs 1.6", "/runs: 1 items vs 0"]


def test_main_exits_1_on_a_difference(tmp_path, capsys):
    """The command's exit status says whether the two files agree."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": {"x": 1}, "runs": []}))
    second.write_text(json.dumps({"results": {"x": 2}, "runs": []}))
    assert main([str(first), str(first)]) == 0
    assert main([str(first), str(second)]) == 1
    assert "1 differ" in capsys.readouterr().out
