"""The README's "Results at a glance" is generated from the result files (bench/reporting/glance.py): they must agree."""

from __future__ import annotations

import json

import pytest

from bench.reporting import glance


def test_the_readme_block_is_what_the_result_files_give():
    """Fails when a result file was regenerated without `python -m bench.reporting.glance`, or a figure was edited by hand."""
    assert glance.main(["--check"]) == 0, "README.md disagrees with bench/results/*.json: run python -m bench.reporting.glance"


def test_a_changed_figure_or_a_missing_marker_is_caught(tmp_path):
    """A result file whose figures differ renders another block; a README without markers is an error."""
    results = tmp_path / "results"
    results.mkdir()
    for name, _, _ in glance.SECTIONS:
        src = glance.RESULTS / name
        if src.is_file():
            (results / name).write_text(src.read_text())
    before = glance.render(results)
    data = json.loads((results / "results.json").read_text())
    for row in data["results"]:  # every figure the block quotes moves, the provenance kept
        row["throughput_rps"] *= 2
    (results / "results.json").write_text(json.dumps(data))
    changed = glance.render(results)
    assert changed != before
    data["provenance"] = {"commit": "abc123", "date": "2026-01-02T03:04:05Z", "machine": {"cores": 16}}
    (results / "results.json").write_text(json.dumps(data))
    after = glance.render(results)
    assert after != changed and "commit `abc123`, 2026-01-02, 16 cores" in after
    assert glance.updated(f"x\n{glance.START}\nold\n{glance.END}\ny", "NEW") == "x\nNEW\ny"
    with pytest.raises(ValueError, match="markers"):
        glance.updated("no markers here", "NEW")


def test_the_baselines_result_is_quoted_with_its_targets(tmp_path):
    """baselines.json gives a bullet with each system's req/s, P90 TTFT and CPU ms/request (mean [min, max] over
    the paired runs) and one line per target, met or missed; a changed figure changes it."""
    data = {"seeds": [0, 1], "workload": "synthetic: 512 requests",
            "provenance": {"commit": "abc123", "date": "2026-01-02T03:04:05Z", "machine": {"cores": 2}},
            "summary": [{"system": "skylb", "rps": [10.0, 12.0], "ttft_p90": [800, 1000], "cpu_ms": [5.0, 7.0]},
                        {"system": "haproxy-hash", "rps": [11.0, 11.0], "ttft_p90": [900, 900], "cpu_ms": [1.0, 1.0]}],
            "acceptance": [
                ["mean TTFT p90 the lowest of all systems", "900 ms; lowest other haproxy-hash 900 ms", False],
                ["peak pending requests per replica <= 2", "max 1", True]]}
    (tmp_path / "baselines.json").write_text(json.dumps(data))
    block = glance.render(tmp_path)
    assert ("skylb 11.00 [10.00, 12.00] req/s, P90 TTFT 900 [800, 1000] ms, CPU 6.00 [5.00, 7.00] ms/request"
            in block)
    assert "2 paired runs; commit `abc123`, 2026-01-02, 2 cores" in block
    assert "  - mean TTFT p90 the lowest of all systems: 900 ms; lowest other haproxy-hash 900 ms, **missed**" in block
    assert "  - peak pending requests per replica <= 2: max 1, **met**" in block
    data["summary"][0]["rps"] = [10.0, 14.0]
    (tmp_path / "baselines.json").write_text(json.dumps(data))
    assert glance.render(tmp_path) != block


def test_the_overhead_line_quotes_each_target_and_its_verdict(tmp_path):
    """bench/results/overhead.json's targets (bench/live/overhead.py) give one line each, figure and verdict; a target
    the run did not measure is left out."""
    data = {"provenance": {"commit": "abc123", "date": "2026-01-02T03:04:05Z", "machine": {"cores": 2}},
            "targets": [{"target": "p50 added latency through SkyLB <= 1 ms", "measured": "0.62 ms", "met": True},
                        {"target": "routing decision p99 <= 1 ms with 64 queued", "measured": "1.20 ms",
                         "met": False},
                        {"target": "not run", "measured": "- ms", "met": None}]}
    (tmp_path / "overhead.json").write_text(json.dumps(data))
    block = glance.render(tmp_path)
    assert "commit `abc123`, 2026-01-02, 2 cores" in block
    assert "  - p50 added latency through SkyLB <= 1 ms: 0.62 ms, **met**" in block
    assert "  - routing decision p99 <= 1 ms with 64 queued: 1.20 ms, **missed**" in block
    assert "not run" not in block
