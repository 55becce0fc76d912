"""The calibrated regime file, the calibration table beside the paper's cells, the load sweep's rows, and the
provenance every report records."""

from __future__ import annotations

import json
from dataclasses import replace

import pydantic
import pytest

from bench.emulator.model import EngineParams, make_engine
from bench.reporting.provenance import provenance, provenance_line
from bench.replay.report import emit_markdown, with_provenance
from bench.sim.calibration import calibration_rows, sweep_rows
from bench.sim.regime import engine_params, regime, shape
from bench.sim.scenarios import SCENARIOS, SWEEP_LOADS, RunSpec, execute, sweep_name


@pytest.fixture(scope="module")
def smoke():
    """One smoke run to copy figures into (a RunSummary has many fields)."""
    return execute(RunSpec("smoke", "SkyLB", (("us", 1), ("eu", 1), ("asia", 1)), 0))


def test_the_committed_regime_loads_and_a_misspelt_key_is_named(tmp_path):
    """bench/sim/regime.yaml loads; a key that is not in the schema fails with its name."""
    assert regime().mooncake.prompt_scale == 1.0
    engine_params()
    assert shape("arena").name == "arena" and shape("wildchat").name == "wildchat"
    bad = tmp_path / "regime.yaml"
    bad.write_text("mooncake:\n  replicas_per_regoin: 3\n")
    with pytest.raises(pydantic.ValidationError, match="replicas_per_regoin"):
        regime(bad)
    bad.write_text("engine:\n  max_num_seqz: 3\n")
    with pytest.raises(TypeError, match="max_num_seqz"):
        regime(bad)


@pytest.mark.parametrize("admission", ["vllm", "sglang"])
def test_a_reply_shorter_than_max_tokens_ends_there(admission):
    """A client asks for max_tokens; the engine generates the reply's own length and reports a stop."""
    engine = make_engine(EngineParams(admission=admission))
    engine.submit("a", ["w"] * 20, 100, ignore_eos=True, now=0.0, output_len=3)
    finished = []
    while engine.has_request("a"):
        finished += engine.next_step(0.0).finished
    assert finished[0].completion_tokens == 3 and finished[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="output_len"):
        engine.submit("b", ["w"] * 20, 10, ignore_eos=True, now=0.0, output_len=11)


def test_calibration_verdicts_in_range_within_25_percent_and_outside(smoke):
    """A paper cell is matched inside its range or within 25% of it; outside, the row says why."""
    def rows(hit_rr: float, var_sgl: float):
        out = []
        for d in ("arena", "wildchat"):
            out += [replace(smoke, scenario=d, system="RR", hit_rate=hit_rr),
                    replace(smoke, scenario=d, system="SkyLB", outstanding_var=1.0),
                    replace(smoke, scenario=d, system="SGL", outstanding_var=var_sgl)]
        return {r.cell: r for r in calibration_rows(out, capacity=([("arena", 30.0)], "sweep"))}
    got = rows(0.12, 3.0)
    assert got["prefix hit rate, RR"].verdict == "in range"
    assert got["outstanding variance, SGL / SkyLB"].verdict == "in range"
    assert got["prefix hit rate, LL"].verdict == "not run"
    assert got["outstanding requests one L4 holds (§3.3)"].verdict == "in range"
    got = rows(0.19, 1.9)  # 16.57% x 1.25 = 20.7%; 2.33 x 0.75 = 1.75
    assert got["prefix hit rate, RR"].verdict == "within 25%"
    assert got["outstanding variance, SGL / SkyLB"].verdict == "within 25%"
    got = rows(0.60, 1.2)
    assert got["prefix hit rate, RR"].verdict == "outside" and "ideal hit" in got["prefix hit rate, RR"].why
    assert got["outstanding variance, SGL / SkyLB"].verdict == "outside"


def test_the_sweep_has_a_scenario_per_load_and_rows_per_load(smoke):
    """Arena and Mixed Tree at each sweep load exist as scenarios; sweep rows give SkyLB's ratios per load."""
    for wl in ("arena", "mixed_tree"):
        for load in SWEEP_LOADS:
            assert sweep_name(wl, load) in SCENARIOS
    assert sweep_name("arena", 1.0) == "arena"
    results = []
    for load, sky_rps in ((1.0, 12.0), (2.0, 9.0)):
        name = sweep_name("arena", load)
        results += [replace(smoke, scenario=name, system="SkyLB", throughput_rps=sky_rps, ttft_p90=1.0),
                    replace(smoke, scenario=name, system="LL", throughput_rps=10.0, ttft_p90=2.0),
                    replace(smoke, scenario=name, system="GKE", throughput_rps=6.0, ttft_p90=3.0)]
    rows = sweep_rows(results, "arena", (1.0, 1.5, 2.0), sweep_name, ("RR", "LL"))
    assert [r["load"] for r in rows] == [1.0, 2.0]
    assert rows[0]["tput_ratio"] == pytest.approx(1.2) and rows[0]["p90_ratio"] == pytest.approx(0.5)
    assert rows[0]["gke_ratio"] == pytest.approx(2.0) and rows[1]["tput_ratio"] == pytest.approx(0.9)


def test_every_report_records_commit_date_command_and_machine(tmp_path):
    """emit_markdown puts the provenance line under the title and the dict into the JSON, once."""
    p = provenance("python -m bench.x --runs 3")
    assert p["command"] == "python -m bench.x --runs 3" and p["machine"]["cores"] >= 1
    assert p["commit"] and p["date"].endswith("Z")
    text = with_provenance("# Title\n\nbody\n", p)
    assert text.splitlines()[2] == provenance_line(p) and with_provenance(text, p) == text
    result = {"provenance": p, "figure": 1}
    emit_markdown("# Title\n\nbody\n", result, out_md=str(tmp_path / "r.md"), out_json=str(tmp_path / "r.json"))
    assert provenance_line(p) in (tmp_path / "r.md").read_text()
    assert json.loads((tmp_path / "r.json").read_text())["provenance"] == p
