"""bench/sim/rules.py: the simulated requests grouped by the profile's plugin that placed them."""

from __future__ import annotations

import pytest

from bench.sim.rules import main, rule_table
from bench.sim.systems import SYSTEMS, build
from bench.sim.workloads import SimRequest, Workload


def test_a_burst_in_one_region_is_split_into_local_picks_and_forwards_by_their_rules():
    """Eight distinct 400-token prompts within 70 ms at us's one replica: some are placed there by the local pick,
    the rest, with no room left in us, go to a peer by the peer picker and are placed there by its local pick;
    every request is counted once and the figures are the requests' own."""
    requests = [SimRequest(f"r{i}", f"k{i}", [f"w{i}"] * 400, 16, arrival_s=0.01 * i, region="us") for i in range(8)]
    cluster = build(SYSTEMS["SkyLB"], Workload("burst", "burst", arrivals=requests), {"us": 1, "eu": 1, "asia": 1},
                    seed=0, stop_at=5.0).run()
    rows = {r["rule"]: r for r in rule_table(cluster, 0.0)}
    assert set(rows) == {"estimated_ttft", "prefix_match -> estimated_ttft"}
    assert sum(r["requests"] for r in rows.values()) == 8 and sum(r["share"] for r in rows.values()) == 1.0
    forwarded = [f for f in cluster.records if f.peer_decision is not None]
    assert rows["prefix_match -> estimated_ttft"]["requests"] == len(forwarded) > 0
    assert all(r["hit_rate"] == 0.0 and 0 < r["p50_s"] <= r["p90_s"] for r in rows.values())  # nothing shared
    assert sum(r["in_slowest_tenth"] for r in rows.values()) >= 1
    assert rule_table(cluster, 10.0) == []  # nothing sent in that window
    # The same requests by region: us's own, and those it forwarded, by where they were served.
    by_region = {r["rule"]: r for r in rule_table(cluster, 0.0, by="region")}
    served_abroad = {f"us -> {f.replica.region}" for f in forwarded}
    assert set(by_region) == {"us -> us", *served_abroad} and served_abroad <= {"us -> eu", "us -> asia"}
    assert sum(r["requests"] for r in by_region.values()) == 8
    assert by_region["us -> us"]["requests"] == rows["estimated_ttft"]["requests"]
    # Where they waited: a forwarded request waited in us's queue or went at once; the figures are the flights' own.
    for rows_ in (rows, by_region):
        assert all(r["balancer_queue_s"] >= 0.0 and r["engine_queue_s"] >= 0.0 for r in rows_.values())
    engine_waits = [f.result.queue_s for f in cluster.records if f.peer_decision is None]
    assert rows["estimated_ttft"]["engine_queue_s"] == pytest.approx(sum(engine_waits) / len(engine_waits))
    with pytest.raises(ValueError, match="'rule' or 'region'"):
        rule_table(cluster, 0.0, by="replica")


def test_the_command_writes_a_report_with_its_provenance(tmp_path):
    """``--out-md``: the provenance line, the summary of each run's slowest tenth and its table, by rule or with
    ``--by region`` by region; bad seeds or no arguments are a usage error (exit 2), never a traceback."""
    out = tmp_path / "rules.md"
    assert main(["multi_tenant@0.5x", "SkyLB", "0", "--out-md", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Placements by rule: SkyLB") and "Provenance: commit" in text
    assert "| multi_tenant@0.5x s0 |" in text and "### multi_tenant@0.5x SkyLB seed 0" in text
    assert "estimated_ttft" in text
    assert main(["multi_tenant@0.5x", "SkyLB", "0", "--by", "region", "--out-md", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Requests by region: SkyLB") and "| client region -> serving region " in text
    assert "engine queue s" in text and "| us -> us " in text
    assert main(["multi_tenant@0.5x", "SkyLB", "zero"]) == 2
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
