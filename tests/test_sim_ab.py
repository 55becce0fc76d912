"""bench.sim.ab runs a system with policy options in the simulator and tabulates its lines; bench.sim.synth_trace
writes a Mooncake-format trace whose sessions extend each other's blocks."""

from __future__ import annotations

import json

import pytest

from bench.sim import synth_trace
from bench.sim.ab import main, parse_line, run_one, table


def test_run_one_applies_policy_options_end_to_end():
    """The predicted-TTFT placement runs the smoke scenario to completion; an unknown option is refused."""
    summary = run_one(("smoke", 'SkyLB+placement="predicted-ttft"', 0))
    assert summary.completed > 0 and summary.ttft_p90 > 0
    try:
        run_one(("smoke", "SkyLB+no_such_option=1", 0))
    except Exception as exc:  # pydantic's ValidationError, naming the option
        assert "no_such_option" in str(exc)
    else:
        raise AssertionError("an unknown policy option was accepted")


def test_run_one_runs_a_matrix_cell_with_an_option(monkeypatch):
    """A robustness-matrix cell as the scenario: its own workload and replicas (12), and a policy option reaches
    the policy (turning the push of cache hits off changes the run)."""
    monkeypatch.setitem(__import__("bench.sim.matrix", fromlist=["TIMES"]).TIMES, "open", (20.0, 5.0))
    on = run_one(("multi_tenant@2x", "SkyLB", 0))
    off = run_one(("multi_tenant@2x", "SkyLB+push_to_prefix_holder=False", 0))
    assert on.replicas == off.replicas == 12 and on.scenario == "multi_tenant@2x"
    assert on.completed > 0 and (on.hit_rate, on.ttft_p90) != (off.hit_rate, off.ttft_p90)


def test_table_gives_mean_and_spread_per_label_scenario_system():
    """Two seeds of one system become one row with their mean and [min, max]; other lines are ignored."""
    lines = ["VAL arena        SkyLB      s3 p90=  0.40 p50= 0.17 thr= 14.00 hit= 50.0% q= 0.00 pend=0.06 fwd= 7.0% wall=1",
             "VAL arena        SkyLB      s4 p90=  0.20 p50= 0.17 thr= 16.00 hit= 40.0% q= 0.00 pend=0.06 fwd= 5.0% wall=1",
             "DONE"]
    assert parse_line(lines[2]) is None
    out = table(lines)
    assert "| VAL | arena | SkyLB | 3,4 | 0.30 [0.20, 0.40] | 15.00 [14.00, 16.00] | 45.0 [40.0, 50.0] |" in out


def test_synth_trace_sessions_extend_their_blocks(tmp_path, capsys):
    """Every row has the Mooncake fields, timestamps never decrease, and a later turn of a session starts with an
    earlier turn's blocks (the prefix structure a prefix trie can use)."""
    path = tmp_path / "t.jsonl"
    synth_trace.main(str(path), hours=0.02, session_rate=2.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    firsts = {}
    extended = 0
    for r in rows:
        key = tuple(r["hash_ids"][:3])
        if key in firsts and r["hash_ids"][:len(firsts[key])] == firsts[key]:
            extended += 1
        firsts.setdefault(key, r["hash_ids"])
    assert extended > 0
    assert main(["--table", str(path)]) == 0


def test_a_matrix_cell_runs_on_other_replicas_per_region(monkeypatch):
    """``COUNTS`` deploys a cell on regions of other sizes (its clients unchanged); a malformed or partial list is
    refused with what is wrong."""
    from bench.sim.matrix import parse_counts
    monkeypatch.setitem(__import__("bench.sim.matrix", fromlist=["TIMES"]).TIMES, "open", (20.0, 5.0))
    monkeypatch.setenv("COUNTS", "us=1,eu=1,asia=2")
    summary = run_one(("multi_tenant@1x", "SkyLB", 0))
    assert summary.replicas == 4 and summary.completed > 0
    assert parse_counts("asia=6, us=2,eu=4") == (("us", 2), ("eu", 4), ("asia", 6))
    for bad in ("us=2,eu=4", "us=0,eu=4,asia=6", "us=2,eu=4,asia=6,mars=1", "us=2,us=3,eu=4,asia=6", "us2"):
        try:
            parse_counts(bad)
        except ValueError as exc:
            assert "replica counts" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_round_trips_between_regions_scale(monkeypatch):
    """``RTT_SCALE`` lengthens every round trip between regions: with one balancer in us for every replica, the
    eu and asia clients' network time in TTFT grows about as much; a scale that is no positive number is refused."""
    monkeypatch.setitem(__import__("bench.sim.matrix", fromlist=["TIMES"]).TIMES, "open", (20.0, 5.0))
    near = run_one(("multi_tenant@1x", "SGL", 0))
    monkeypatch.setenv("RTT_SCALE", "4")
    far = run_one(("multi_tenant@1x", "SGL", 0))
    assert 3.0 < far.network_mean / near.network_mean < 4.5
    monkeypatch.setenv("RTT_SCALE", "0")
    try:
        run_one(("multi_tenant@1x", "SGL", 0))
    except ValueError as exc:
        assert "round-trip scale" in str(exc)
    else:
        raise AssertionError("RTT_SCALE=0 was accepted")


def test_a_cell_runs_with_the_engines_in_another_order(monkeypatch):
    """``SCHEDULE=fcfs`` runs every engine first come, first served: a saturated cell's waits change with the same
    arrivals; an unknown order is refused with its name."""
    monkeypatch.setitem(__import__("bench.sim.matrix", fromlist=["TIMES"]).TIMES, "open", (30.0, 0.0))
    lpm = run_one(("multi_tenant@3x", "LL", 0))
    monkeypatch.setenv("SCHEDULE", "fcfs")
    fcfs = run_one(("multi_tenant@3x", "LL", 0))
    assert lpm.sent == fcfs.sent and lpm.ttft_p90 != fcfs.ttft_p90
    monkeypatch.setenv("SCHEDULE", "random")
    with pytest.raises(ValueError, match="'random'"):
        run_one(("multi_tenant@3x", "LL", 0))
