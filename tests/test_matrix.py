"""The robustness matrix (bench/sim/matrix.py): its workload generators, its per-replica speeds, its verdicts, and
`skylb bench matrix --quick` end to end."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from bench.emulator.model import EngineParams
from bench.sim.cluster import Cluster
from bench.sim.matrix import (DEFAULT, QUICK, SLOW_FACTOR, SPLITS, VAL_START_S, WORKLOADS, cell_name, parse_cell,
                              replica_params, runs_for, one_x_rps)
from bench.sim.matrix_report import _checks_section, first_loaded, mean_single_ratios, verdicts
from bench.sim.metrics import RunSummary
from bench.sim.scenarios import trace_available
from bench.sim.systems import SYSTEMS, build
from bench.sim.workloads import Workload
from bench.sim.workloads_extra import multi_tenant, reviews, tool_agents
from skylb import cli


def _tokens(wl: Workload) -> list[tuple[str, tuple[str, ...], int, float | None, str]]:
    return [(r.id, tuple(r.tokens), r.output_tokens, r.arrival_s, r.region) for r in wl.arrivals]


def test_multi_tenant_is_deterministic_by_seed():
    """The same seed gives the same requests (ids, prompts, outputs, times, regions); another seed other ones."""
    a = multi_tenant(seed=3, rate_rps=5.0, duration_s=20.0)
    assert _tokens(a) == _tokens(multi_tenant(seed=3, rate_rps=5.0, duration_s=20.0))
    assert _tokens(a) != _tokens(multi_tenant(seed=4, rate_rps=5.0, duration_s=20.0))


def test_multi_tenant_tenants_share_identical_prefix_text():
    """Every request of a tenant opens with the same 750-token prefix text, then a 150-token question of its own;
    different tenants' prefixes differ; outputs are 100-300 tokens; arrivals are sorted inside the duration."""
    wl = multi_tenant(seed=0, rate_rps=40.0, duration_s=30.0)
    by_tenant: dict[str, list] = {}
    for r in wl.arrivals:
        assert len(r.tokens) == 750 + 150 and 100 <= r.output_tokens <= 300
        by_tenant.setdefault(r.session_key.split("-")[0], []).append(r)
    shared = [reqs for reqs in by_tenant.values() if len(reqs) > 1]
    assert shared, "some tenant should have two requests in 1,200 arrivals over 150 tenants"
    for reqs in shared:
        assert len({" ".join(r.tokens[:750]) for r in reqs}) == 1
        assert len({r.region for r in reqs}) == 1
        assert len({tuple(r.tokens[750:]) for r in reqs}) == len(reqs)
    prefixes = {" ".join(reqs[0].tokens[:750]) for reqs in by_tenant.values()}
    assert len(prefixes) == len(by_tenant)
    times = [r.arrival_s for r in wl.arrivals]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 30.0
    assert 0.8 * 1200 < len(times) < 1.2 * 1200


def test_tool_agent_turns_extend_the_session_and_agents_share_prefixes():
    """A tool-agent session's turn t prompt extends turn t-1's; each turn waits 0.2-2 s after its parent; every
    session of one agent opens with that agent's 3,000-6,000-token prefix; the same seed gives the same sessions."""
    wl = tool_agents(seed=1, sessions_per_s=2.0, duration_s=20.0)
    again = tool_agents(seed=1, sessions_per_s=2.0, duration_s=20.0)
    assert [(c.id, c.region, c.start_s) for c in wl.clients] == [(c.id, c.region, c.start_s) for c in again.clients]
    heads = set()
    for c in wl.clients:
        program = c.programs(0)
        assert c.programs(1) is None and program[0].parent is None
        assert [tuple(r.tokens) for r in program] == [tuple(r.tokens) for r in again.clients[wl.clients.index(c)]
                                                      .programs(0)]
        for prev, turn in zip(program, program[1:]):
            assert turn.parent == prev.id and 0.2 <= turn.think_s <= 2.0
            assert turn.tokens[:len(prev.tokens)] == prev.tokens and len(turn.tokens) > len(prev.tokens)
            assert 16 <= turn.output_tokens <= 400
        prefix_end = program[0].tokens.index("me:")
        assert 3000 <= prefix_end - 1 <= 6000
        heads.add(" ".join(program[0].tokens[:prefix_end]))
    assert 1 < len(heads) <= 5


def test_reviews_arrive_at_a_constant_rate():
    """Review requests are evenly spaced at 1 / rate, 40-240 review tokens plus the shared instruction, outputs
    100-300 tokens."""
    wl = reviews(seed=2, rate_rps=4.0, duration_s=10.0)
    gaps = {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(wl.arrivals, wl.arrivals[1:])}
    assert gaps == {0.25} and len(wl.arrivals) in (39, 40)
    tails = {tuple(r.tokens[-12:]) for r in wl.arrivals}
    assert len(tails) == 1
    assert all(1 + 40 + 12 <= len(r.tokens) <= 1 + 240 + 12 and 100 <= r.output_tokens <= 300 for r in wl.arrivals)


def test_heterogeneous_half_of_each_region_is_slower():
    """In the heterogeneous deployment the second half of each region's replicas steps SLOW_FACTOR times slower,
    and the simulated cluster gives each replica its own parameters."""
    base = EngineParams()
    slow = replica_params((("us", 4), ("eu", 2)), base)
    assert sorted(slow) == ["eu-r1", "us-r2", "us-r3"]
    step = dict(prefill_tokens=100, decode_seqs=3, decode_kv_tokens=300)
    assert slow["us-r2"].step_seconds(**step) == pytest.approx(SLOW_FACTOR * base.step_seconds(**step))
    wl = reviews(seed=0, rate_rps=1.0, duration_s=1.0)
    cluster = build(SYSTEMS["LL"], wl, {"us": 4, "eu": 2}, seed=0, stop_at=1.0, params=base, replica_params=slow)
    assert {rid: r.engine.params.time_scale for rid, r in cluster.replicas.items()} == {
        "us-r0": 1.0, "us-r1": 1.0, "us-r2": SLOW_FACTOR, "us-r3": SLOW_FACTOR, "eu-r0": 1.0, "eu-r1": SLOW_FACTOR}
    with pytest.raises(ValueError, match="unknown replicas"):
        Cluster(workload=wl, replicas={"a": "us"}, balancers=[], entry={}, replica_params={"b": base})


def test_slow_replicas_take_longer_in_a_run():
    """The same requests take longer end to end on replicas SLOW_FACTOR times slower."""
    wl = reviews(seed=0, rate_rps=2.0, duration_s=5.0)
    base = EngineParams()
    times = []
    slow = replace(base, time_scale=SLOW_FACTOR)
    for own in ({}, {"us-r0": slow, "us-r1": slow}):
        cluster = build(SYSTEMS["RR"], replace(wl, arrivals=[replace(r, region="us") for r in wl.arrivals]),
                        {"us": 2}, seed=0, stop_at=10.0, params=base, replica_params=own).run()
        times.append(sum(f.done_at - f.sent_at for f in cluster.records))
    assert times[1] > 2.5 * times[0]


def test_one_x_is_positive_and_the_same_in_every_call():
    """The 1x rate of a generated open-loop workload is a positive request rate, computed the same way each time."""
    for name in ("multi_tenant", "heterogeneous", "tool_agent"):
        rate = one_x_rps(name)
        assert rate > 0 and math.isfinite(rate)
        one_x_rps.cache_clear()
        assert one_x_rps(name) == rate


@pytest.mark.skipif(not trace_available(), reason="the Mooncake trace is not in this workspace")
def test_trace_windows_follow_the_split():
    """Dev trace windows replay trace time before minute 40, val windows from minute 40; the load compresses time."""
    make = WORKLOADS["conversation_1_8"].make
    dev, val = make(0, 2.0, "dev", 30.0), make(3, 2.0, "val", 30.0)
    assert "60 s from 0 s at 2x" in dev.description and f"from {VAL_START_S:g} s at 2x" in val.description
    assert all(r.arrival_s < 30.0 for r in dev.arrivals + val.arrivals)
    assert SPLITS["dev"] == (0, 1, 2) and SPLITS["val"] == (3, 4, 5)


def _summary(scenario: str, system: str, p90: float, rps: float) -> RunSummary:
    figures = dict.fromkeys(("throughput_tps", "ttft_mean", "ttft_p10", "ttft_p25", "ttft_p50", "ttft_p75",
                             "e2e_mean", "e2e_p10", "e2e_p25", "e2e_p50", "e2e_p75", "e2e_p90", "hit_rate",
                             "ideal_hit_rate", "ideal_kv_hit_rate", "outstanding_var", "pending_mean", "queue_mean",
                             "kv_usage_mean", "forwarded_frac", "remote_frac", "network_mean", "sim_end_s"), 0.0)
    return RunSummary(scenario=scenario, system=system, replicas=12, layout="", seed=0, window_s=100.0, sent=1,
                      completed=1, throughput_rps=rps, ttft_p90=p90, served_share={}, sent_share={}, **figures)


@pytest.mark.parametrize("rows, p90_ratio, tput_ratio, check1, check2", [
    # default best on both, oracle within 1.15x: check 1 met; best single at 0.8 s: check 2 n/a
    ({"SkyLB": (0.5, 10.0), "RR": (0.8, 9.0), "SGL": (0.6, 9.5), "Oracle": (0.45, 10.0)}, 0.5 / 0.6, 10 / 9.5,
     True, None),
    # 2% behind the best other on P90, oracle 1.2x: check 1 missed by the oracle part only
    ({"SkyLB": (1.02, 10.0), "SkyLB-CH": (1.0, 10.0), "Oracle": (0.85, 10.0)}, 1.02, 1.0, False, None),
    # singles queue for seconds: default at 0.4x their P90 and 1.2x their throughput meets check 2
    ({"SkyLB": (1.2, 12.0), "LL": (3.0, 10.0), "CH": (4.0, 9.0)}, 0.4, 1.2, True, True),
    # ... at 0.6x their P90 misses it
    ({"SkyLB": (1.8, 12.0), "LL": (3.0, 10.0)}, 0.6, 1.2, True, False),
])
def test_verdicts_compute_ratios_and_checks_from_the_rows(rows, p90_ratio, tput_ratio, check1, check2):
    """A cell's ratios are the default's over the best other system (lowest P90, highest throughput; the oracle
    left out) and its checks follow the declared limits (check 2 only where the best single's P90 >= 2 s)."""
    results = [_summary("w@1x", s, p, t) for s, (p, t) in rows.items()]
    (v,) = verdicts(results)
    assert (v.workload, v.load) == ("w", 1.0)
    assert v.p90_ratio == pytest.approx(p90_ratio) and v.tput_ratio == pytest.approx(tput_ratio)
    assert v.check1 is check1 and v.check2 is check2


def test_check2_is_also_judged_on_the_oracles_figures():
    """Where check 2 applies, the oracle's P90 and throughput are held to the same clauses, and the checks section
    counts the cells where the oracle meets it; without an oracle or below 2 s it is not judged."""
    loaded = [_summary("w@2x", "SkyLB", 1.8, 12.0), _summary("w@2x", "LL", 3.0, 10.0),
              _summary("w@2x", "Oracle", 1.2, 11.5)]
    (v,) = verdicts(loaded)
    assert (v.check2, v.oracle_check2) == (False, True)
    (v,) = verdicts(loaded[:2] + [_summary("w@2x", "Oracle", 1.2, 11.0)])
    assert v.oracle_check2 is False  # 1.10x the best single's throughput
    (v,) = verdicts(loaded[:2])
    assert v.oracle_check2 is None
    (v,) = verdicts([_summary("w@1x", "SkyLB", 0.5, 10.0), _summary("w@1x", "LL", 0.8, 10.0),
                     _summary("w@1x", "Oracle", 0.3, 12.0)])
    assert v.oracle_check2 is None
    (v,) = verdicts(loaded)
    text = "\n".join(_checks_section([v], {}))
    assert "The oracle's own figures meet check 2 in 1 of those 1 cells (w@2x)" in text
    assert "its P90 is 0.40-0.40x and its throughput 1.15-1.15x (below 1.12x in 0 of the 1)" in text


def test_check1_is_judged_on_each_oracle_candidate_alone():
    """One candidate rule must meet check 1's P90 and throughput lines at once: where the oracle's best P90 and best
    throughput come from different rules and neither rule reaches the other's figure, no rule meets it."""
    def oracle(candidates):
        s = _summary("w@1x", "Oracle", min(p for p, _ in candidates.values()),
                     max(t for _, t in candidates.values()))
        s.candidates = {name: {"ttft_p90": p, "throughput_rps": t} for name, (p, t) in candidates.items()}
        return s
    rows = [_summary("w@1x", "SkyLB", 0.4, 30.0), _summary("w@1x", "CH", 0.45, 34.0)]
    # spreading: the oracle's P90 (0.30 s) but 0.92x the best other's throughput; concentrating: the throughput but
    # 1.43x the oracle's P90
    (v,) = verdicts(rows + [oracle({"skylb-paper": (0.30, 31.3), "skylb": (0.43, 35.0)})])
    assert v.oracle_check1 == []
    text = "\n".join(_checks_section([v], {}))
    assert v.check1_rules == []
    assert "met by at least one rule in 0 of 1 cells (by the oracle's candidates in 0, the default in 0); by none in 1 (w@1x)" in text
    (v,) = verdicts(rows + [oracle({"skylb-paper": (0.30, 33.2), "skylb": (0.43, 35.0)})])
    assert v.oracle_check1 == ["skylb-paper"]  # 0.976x the best other's throughput: within 3%
    assert v.check1_rules == ["Oracle/skylb-paper"]
    (v,) = verdicts([rows[0], _summary("w@1x", "CH", 0.33, 34.0), oracle({"skylb": (0.30, 35.0)})])
    assert v.check1_rules == ["CH", "Oracle/skylb"]  # another system meets it alone: a rule reaches both lines
    text = "\n".join(_checks_section([v], {}))
    assert "Of the default's 1 missed cells, another system (a balancer that can be deployed) meets check 1 alone " \
           "in 1: w@1x (CH); only an oracle candidate (its fresh global view and free network) in 0." in text
    (v,) = verdicts(rows)
    assert v.oracle_check1 is None


def test_check3_and_first_loaded_load():
    """Check 3 averages the default's P90 over each single balancer's across cells; the first loaded load is the
    lowest where the best single balancer's P90 reaches 2 s."""
    results = [_summary("w@1x", "SkyLB", 1.0, 1), _summary("w@1x", "RR", 1.5, 1),
               _summary("w@2x", "SkyLB", 1.0, 1), _summary("w@2x", "RR", 2.5, 1)]
    assert mean_single_ratios(results) == pytest.approx({"RR": (1 / 1.5 + 1 / 2.5) / 2})
    assert first_loaded(verdicts(results)) == {"w": 2.0}
    assert parse_cell(cell_name("tool_agent", 0.5)) == ("tool_agent", 0.5)


def test_runs_for_covers_every_cell_system_and_seed():
    """The matrix's runs are the product of workloads, their loads, systems and seeds; an unknown system fails."""
    specs = runs_for(["arena", "tot"], ["SkyLB", "RR"], [0, 1], loads=[0.5, 2.0])
    assert len(specs) == 2 * 2 * 2 * 2 and {s.scenario for s in specs} == {"arena@0.5x", "arena@2x", "tot@0.5x",
                                                                             "tot@2x"}
    assert len(runs_for(["arena"], ["SkyLB"], [0])) == len(WORKLOADS["arena"].loads)
    with pytest.raises(KeyError):
        runs_for(["arena"], ["nope"], [0])


def test_quick_matrix_end_to_end(tmp_path):
    """`skylb bench matrix --quick` runs every cell in worker processes and writes a report with every cell, a JSON
    with provenance whose ratios are the ones its runs give, and the heat map."""
    assert cli.main(["bench", "matrix", "--quick", "--out", str(tmp_path), "--no-progress", "--jobs", "2"]) == 0
    data = json.loads((tmp_path / "matrix.json").read_text())
    assert {"commit", "date", "command", "machine"} <= set(data["provenance"])
    assert data["provenance"]["command"].startswith("skylb bench matrix --quick")
    cells = {(c["workload"], c["load"]) for c in data["cells"]}
    assert cells == {(w, x) for w in QUICK["workloads"] for x in QUICK["loads"]}
    assert len(data["runs"]) == len(cells) * len(QUICK["systems"]) and data["seeds"] == [0]
    report = (tmp_path / "matrix.md").read_text()
    for w, x in cells:
        assert f"| {w} " in report and f"### {w}@{x:g}x" in report
    assert "Provenance: commit" in report and "Check 3" in report
    # every cell's table gives the mean TTFT beside the P90
    assert len(re.findall(r"\| system +\| P90 TTFT s +\| mean TTFT s +\| req/s", report)) == len(cells)
    for cell in data["cells"]:  # recompute the ratios from the aggregated results
        rows = {r["system"]: r for r in data["results"] if r["scenario"] == cell_name(cell["workload"], cell["load"])}
        others = [r for s, r in rows.items() if s not in (DEFAULT, "Oracle")]
        assert cell["p90_ratio"] == pytest.approx(rows[DEFAULT]["ttft_p90"] / min(r["ttft_p90"] for r in others))
        assert cell["tput_ratio"] == pytest.approx(rows[DEFAULT]["throughput_rps"]
                                                   / max(r["throughput_rps"] for r in others))
        assert cell["oracle_ratio"] == pytest.approx(rows[DEFAULT]["ttft_p90"] / rows["Oracle"]["ttft_p90"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "matrix.png").stat().st_size > 1000 and "![" in report
    _replace_in(tmp_path, data)


def _replace_in(tmp_path, data):
    """`--from-json RERUN --replace-in SAVED`: the default's runs of a rerun replace the saved ones (ratios follow),
    every other system's stay, both commands are recorded; a rerun of other seeds is refused."""
    rerun = {k: data[k] for k in ("split", "seeds", "counts", "schedule_policy", "systems", "quick", "times",
                                  "jobs")} | {
        "command": "skylb bench matrix --systems SkyLB", "wall_s": 5.0,
        "provenance": {**data["provenance"], "commit": "abcdef1234", "date": "2026-12-03T17:00:00Z"},
        "runs": [{**r, "ttft_p90": r["ttft_p90"] * 2} for r in data["runs"] if r["system"] == DEFAULT]}
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))
    merged = tmp_path / "merged"
    assert cli.main(["bench", "matrix", "--from-json", str(tmp_path / "rerun.json"), "--replace-in",
                     str(tmp_path / "matrix.json"), "--out", str(merged)]) == 0
    got = json.loads((merged / "matrix.json").read_text())
    assert len(got["runs"]) == len(data["runs"]) and got["provenance"]["commit"] == "abcdef1234"
    assert got["command"].startswith("skylb bench matrix --systems SkyLB (5 s, 2026-12-03, at abcdef1); earlier, "
                                     f"replaced for {DEFAULT}: {data['command']}")
    before = {(c["workload"], c["load"]): c["p90_ratio"] for c in data["cells"]}
    for c in got["cells"]:
        assert c["p90_ratio"] == pytest.approx(2 * before[c["workload"], c["load"]])
    assert got["systems"] == data["systems"]
    for other in ({**rerun, "seeds": [7]}, {**rerun, "quick": not rerun["quick"]}, {**rerun, "runs": []}):
        (tmp_path / "other.json").write_text(json.dumps(other))
        assert cli.main(["bench", "matrix", "--from-json", str(tmp_path / "other.json"), "--replace-in",
                         str(tmp_path / "matrix.json"), "--out", str(merged)]) == 2
    assert cli.main(["bench", "matrix", "--from-json", str(tmp_path / "rerun.json"), "--replace-in",
                     str(tmp_path / "missing.json"), "--out", str(merged)]) == 2
    assert cli.main(["bench", "matrix", "--replace-in", str(tmp_path / "matrix.json"), "--out", str(merged)]) == 2


def test_matrix_diff_compares_one_systems_seed_means_cell_by_cell(tmp_path, capsys):
    """bench.sim.matrix_diff: per cell the seed means of one system before and after, ratios, and a summary that
    counts the cells the change did not reach; 2 when the files share no cell of the system."""
    from bench.sim import matrix_diff

    def run(cell, system, seed, p90, thr, hit):
        return {"scenario": cell, "system": system, "seed": seed, "ttft_p90": p90, "throughput_rps": thr,
                "hit_rate": hit}

    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"runs": [
        run("a@2x", "SkyLB", 0, 1.0, 10.0, 0.5), run("a@2x", "SkyLB", 1, 3.0, 10.0, 0.5),
        run("a@0.5x", "SkyLB", 0, 1.0, 4.0, 0.2), run("a@2x", "LL", 0, 9.0, 1.0, 0.0),
        {**run("a@2x", "SkyLB", 0, 99.0, 1.0, 0.0), "seed": [0, 1]}]}))  # a mean row of the report: not a run
    after.write_text(json.dumps({"runs": [
        run("a@2x", "SkyLB", 0, 1.0, 11.0, 0.5), run("a@2x", "SkyLB", 1, 2.0, 11.0, 0.5),
        run("a@0.5x", "SkyLB", 0, 1.0, 4.0, 0.2)]}))
    assert matrix_diff.main([str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert out.index("a@0.5x") < out.index("a@2x")  # by workload, then load
    assert "| a@2x | 2.00 -> 1.50 | 0.750 | 10.00 -> 11.00 | 1.100 |" in out
    assert "P90 lower by more than 3% in 1" in out and "unchanged (same figures) in 1" in out
    assert matrix_diff.main([str(before), str(after), "--system", "SGL"]) == 2
    assert matrix_diff.main([str(before), str(after), "--seeds", "1"]) == 0
    assert "| a@2x | 3.00 -> 2.00 |" in capsys.readouterr().out


def test_matrix_on_other_replicas_per_region(tmp_path, capsys):
    """`--counts` runs every cell on other replicas per region, records them in the JSON and says so in the report;
    a malformed list is refused by the command line with what is wrong."""
    out = tmp_path / "uneven"
    assert cli.main(["bench", "matrix", "--quick", "--workloads", "multi_tenant", "--loads", "1", "--systems",
                     "SkyLB,RR", "--counts", "us=1,eu=1,asia=2", "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "matrix.json").read_text())
    assert data["counts"] == {"us": 1, "eu": 1, "asia": 2} and data["command"].endswith("--counts us=1,eu=1,asia=2")
    assert {r["replicas"] for r in data["runs"]} == {4}
    assert "**Replicas per region.** us 1, eu 1, asia 2" in (out / "matrix.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(["bench", "matrix", "--quick", "--counts", "us=1,eu=1", "--out", str(out)])
    assert "missing asia" in capsys.readouterr().err


def test_matrix_with_the_engines_in_another_scheduling_order(tmp_path, capsys):
    """`--schedule-policy fcfs` runs every engine first come, first served instead of the regime's longest prefix
    match: the same cell at the same offered load gives other waits, the JSON, command and report say which order
    ran, and a rerun under another order cannot replace the saved runs."""
    cell = ["bench", "matrix", "--quick", "--workloads", "multi_tenant", "--loads", "3", "--systems", "LL",
            "--no-progress", "--jobs", "1"]
    assert cli.main([*cell, "--out", str(tmp_path / "regime")]) == 0
    assert cli.main([*cell, "--schedule-policy", "fcfs", "--out", str(tmp_path / "fcfs")]) == 0
    regime_run, fcfs_run = (json.loads((tmp_path / d / "matrix.json").read_text()) for d in ("regime", "fcfs"))
    assert regime_run["schedule_policy"] is None and fcfs_run["schedule_policy"] == "fcfs"
    assert fcfs_run["command"].endswith("--schedule-policy fcfs")
    (a,), (b,) = regime_run["runs"], fcfs_run["runs"]
    assert a["sent"] == b["sent"] and a["ttft_p90"] != b["ttft_p90"]  # same arrivals, other waits
    assert "**Engine scheduling.** Every simulated engine takes its waiting queue first come, first served" in (
        tmp_path / "fcfs" / "matrix.md").read_text()
    assert cli.main(["bench", "matrix", "--from-json", str(tmp_path / "fcfs" / "matrix.json"), "--replace-in",
                     str(tmp_path / "regime" / "matrix.json"), "--out", str(tmp_path / "merged")]) == 2
    with pytest.raises(SystemExit):
        cli.main([*cell, "--schedule-policy", "random", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_matrix_with_an_option_of_the_default_policy(tmp_path, capsys):
    """`--option KEY=VALUE` runs the default's policy with that option (a literal value): the same cell gives other
    figures, the JSON, command and report record it, and an option the policy does not declare is refused with the
    ones it does."""
    cell = ["bench", "matrix", "--quick", "--workloads", "multi_tenant", "--loads", "2", "--systems", "SkyLB",
            "--no-progress", "--jobs", "1"]
    assert cli.main([*cell, "--out", str(tmp_path / "as_is")]) == 0
    assert cli.main([*cell, "--option", "push_to_prefix_holder=False", "--out", str(tmp_path / "no_push")]) == 0
    as_is, no_push = (json.loads((tmp_path / d / "matrix.json").read_text()) for d in ("as_is", "no_push"))
    assert as_is["options"] is None and no_push["options"] == {"push_to_prefix_holder": False}
    assert no_push["command"].endswith("--option push_to_prefix_holder=False")
    (a,), (b,) = as_is["runs"], no_push["runs"]
    assert a["sent"] == b["sent"] and (a["ttft_p90"], a["hit_rate"]) != (b["ttft_p90"], b["hit_rate"])
    assert "`push_to_prefix_holder=False` (`--option`)" in (tmp_path / "no_push" / "matrix.md").read_text()
    assert cli.main([*cell, "--option", "no_such_option=1", "--out", str(tmp_path / "x")]) == 2
    assert "no_such_option" in capsys.readouterr().err
