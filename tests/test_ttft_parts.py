"""The TTFT decomposition diagnostic (bench/sim/ttft_parts.py) on a short simulated tree cell."""

from __future__ import annotations

import pytest

from bench.sim.ttft_parts import main, parse_system, run


def test_ttft_parts_splits_each_request_of_a_tree_cell_into_its_parts(capsys):
    result = run("tot@0.5x", "SkyLB", stop_at=50.0)
    groups = result["groups"]
    assert set(groups) == {"first", "same", "other"}  # trees: roots, branches on their parent's replica, elsewhere
    assert sum(g["n"] for g in groups.values()) == result["requests"] > 0
    for g in groups.values():
        parts = g["to_engine"] + g["engine_queue"] + g["prefill"]
        assert 0.0 < parts <= g["ttft"] + 1e-9  # the first token's way back to the client is the rest
        assert 0.0 <= g["hit"] <= 1.0 and g["over_min"] >= 0.0 and g["tpot_ms"] > 0.0
    assert groups["first"]["uncached"] > 0  # a root shares only the template
    regions = result["regions"]
    assert set(regions) == {"us", "eu", "asia"}  # every client region of the tree cell sends
    served = [m for r in regions.values() for w, m in r.items() if w in ("home", "abroad")]
    assert sum(m["n"] for m in served) == result["requests"]  # each request counted once, at home or abroad
    assert all(m["abroad"] == (w == "abroad") for r in regions.values() for w, m in r.items() if w != "p90")
    spread = result["spread"]
    assert set(spread["engines"]) == {"us", "eu", "asia"}
    assert all(e["running"] > 0 and e["waiting"] >= 0 and 0 < e["kv"] <= 1 for e in spread["engines"].values())
    g = spread["groups"]
    assert g["requests"] == result["requests"] and g["groups"] > 1  # every measured request in one prompt group
    assert 1.0 <= g["effective"] <= g["replicas"] + 1e-9  # the effective count never exceeds the distinct count
    assert g["off_same_region"] + g["off_other_region"] < g["requests"]
    assert main(["tot@0.5x", "--stop-at", "22", "--by-region", "--spread", 'SkyLB+holdings="own"']) == 0
    out = capsys.readouterr().out
    assert "tot@0.5x SkyLB+holdings=\"own\"" in out and "from us:" in out and "served home" in out
    assert "engines in us:" in out and "prompt groups:" in out and "effective (request-weighted)" in out


def test_ttft_parts_refuses_an_unknown_system_or_option():
    with pytest.raises(ValueError):
        parse_system("NoSuchSystem")
    with pytest.raises(ValueError):
        parse_system("SkyLB+holdings")
    assert main(["tot@0.5x", "NoSuchSystem"]) == 2


def test_kv_routing_report_tables_each_tenant_spread_per_load_and_system():
    """bench/sim/kv_routing.py's report: the spread table has a row per load and a column per system that has a
    spread, each cell "effective (off in its region / off in another)", "-" where a system has none."""
    from types import SimpleNamespace

    from bench.sim.kv_routing import report

    def summary(scenario: str, system: str):
        return SimpleNamespace(scenario=scenario, system=system, ttft_p90=0.5, throughput_tps=900.0, hit_rate=0.45,
                               ideal_kv_hit_rate=0.52)

    summaries = [summary(f"multi_tenant@{load}x", k) for load in ("0.5", "1") for k in ("SkyLB", "SGL")]

    def groups(effective: float, same: int, other: int) -> dict:
        return {"groups": {"effective": effective, "off_same_region": same, "off_other_region": other}}

    spreads = {("multi_tenant@0.5x", "SkyLB"): groups(1.04, 3, 0), ("multi_tenant@1x", "SkyLB"): groups(1.28, 28, 13),
               ("multi_tenant@0.5x", "SGL"): groups(1.0, 0, 0)}
    text = report(summaries, one_x=4.88, command="test", kv_cache_tokens=8192, spreads=spreads)
    table = text[text.index("## How each tenant's requests spread over replicas"):].splitlines()
    rows = [line for line in table if line.startswith("| ")]
    assert rows == ["| load | SkyLB | SGL |", "| 0.5x | 1.04 (3 / 0) | 1.00 (0 / 0) |", "| 1x | 1.28 (28 / 13) | - |"]
    assert "How each tenant" not in report(summaries, one_x=4.88, command="test", kv_cache_tokens=8192)
