"""Smoke test of bench/live/heterogeneous.py: one short run of the estimated-wait system on real processes renders the
report with the seed's Table 3 beside ours."""

from __future__ import annotations

from bench.live.heterogeneous import SEED_TABLE, HeteroSetup, format_markdown, run_all


def test_one_short_run_renders_both_tables(tmp_path):
    setup = HeteroSetup(requests=6, seeds=1)
    result = run_all(["estimated-wait"], setup, run_dir=tmp_path, progress=False)
    [run] = result["rows"][0]["runs"]
    assert run["figures"]["sent"] == 6 and run["figures"]["completed"] == 6, run["raw"]["errors"]
    assert sum(run["raw"]["served"].values()) == 6
    text = format_markdown(result)
    assert "## Seed 000, Table 3" in text and "## Ours" in text
    assert all(name in text for name, *_ in SEED_TABLE)
