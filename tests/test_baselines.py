"""bench/live/baselines.py without running anything: the systems of a default run and their configuration for the
cluster, the figures over paired runs, the targets and the report's tables (the live runs are in
tests/test_bench_live_smoke.py)."""

from __future__ import annotations

import pytest

from bench.live import baselines
from bench.live.baselines import DEFAULT_SYSTEMS, SYSTEMS, BaselinesSetup, acceptance, configured, format_markdown
from bench.replay.run import SESSION_HEADER
from bench.replay.sampling import MachineLoad


def _figures(rps: float, p90: float, peaks: list[int], cpu_ms: float | None = 1.0) -> dict:
    completed = 500
    return {"completed": completed, "sent": completed, "failed": 0, "throughput_rps": rps,
            "output_tokens_per_s": 40 * rps, "ttft_mean_ms": p90 / 2, "ttft_p50_ms": p90 / 2, "ttft_p90_ms": p90,
            "e2e_p50_ms": p90, "e2e_p90_ms": 2 * p90, "prefix_hit_rate": 0.5, "pending_peak": peaks,
            "pending_peak_max": max(peaks), "pending_mean_total": 1.0, "errors": {},
            "cpu_s": None if cpu_ms is None else cpu_ms * completed / 1000, "cpu_ms_per_request": cpu_ms}


def _result(per_seed: dict[int, dict[str, dict]]) -> dict:
    """A result as run_baselines returns it, from {seed: {system: figures}}."""
    load = MachineLoad().start().stop()
    setup = BaselinesSetup()
    rows = [{"system": name, "seed": seed, "status": "ok", "figures": f, "load": load}
            for seed, systems in per_seed.items() for name, f in systems.items()]
    names = list(dict.fromkeys(r["system"] for r in rows))
    systems = {n: {"kind": s.kind, "policy": s.policy, "options": s.options, "skylb_overrides": s.skylb_overrides}
               for n, s in ((n, configured(SYSTEMS[n], setup)) for n in names)}
    return {"setup": setup.__dict__.copy(), "workload": "synthetic: 512 requests", "systems": systems, "rows": rows,
            "seeds": list(per_seed), "wall_s": 100.0, "load": load, "generated": "now",
            "versions": {"sglang-router": "0.3.2", "haproxy": "HAProxy version 2.6", "python": "3.11"}}


def _cells(text: str, first: str) -> list[str]:
    """The cells of the first Markdown table row of ``text`` whose first cell is ``first``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r}")


def test_a_default_run_has_skylb_and_each_baseline_as_operators_deploy_it():
    """Default: SkyLB's default configuration (no overrides), its hash ring, SGLang cache_aware and round_robin,
    HAProxy leastconn and bounded-load hashing; skylb-cap1 and plain round robin stay selectable only."""
    assert DEFAULT_SYSTEMS == ("skylb", "skylb-ch", "sglang-cache_aware", "sglang-round_robin", "haproxy-leastconn",
                               "haproxy-hash")
    assert set(DEFAULT_SYSTEMS) <= set(SYSTEMS)
    assert SYSTEMS["skylb"].skylb_overrides == {} and SYSTEMS["skylb"].options == {}
    for selectable in ("skylb-cap1", "haproxy-roundrobin", "sglang-cache_aware-defaults"):
        assert selectable in SYSTEMS and selectable not in DEFAULT_SYSTEMS
    assert baselines.DEFAULT_SEEDS == (0, 1, 2, 3, 4)


def test_a_default_run_has_at_least_500_requests_at_batch_4():
    """The default workload has >= 500 requests and keeps batch 4 per replica."""
    setup = BaselinesSetup()
    assert setup.conversations * setup.turns >= 500 and setup.max_num_seqs == 4


@pytest.mark.parametrize("batch, abs_threshold", [(4, 2), (8, 4), (1, 1)])
def test_baselines_are_sized_for_the_cluster(batch, abs_threshold):
    """HAProxy leastconn: maxconn = the engine's batch, queue timeout = the client's; the SGLang router's balance
    threshold is half a batch; the hash row hashes the client's session header with hash-balance-factor 125."""
    setup = BaselinesSetup(max_num_seqs=batch, request_timeout_s=90.0)
    assert configured(SYSTEMS["haproxy-leastconn"], setup).options == {"maxconn": batch, "timeout_queue_s": 90.0}
    assert configured(SYSTEMS["sglang-cache_aware"], setup).options == {
        "cache_threshold": 0.3, "balance_abs_threshold": abs_threshold, "balance_rel_threshold": 1.25}
    assert configured(SYSTEMS["haproxy-hash"], setup).options == {"hash_header": SESSION_HEADER,
                                                                 "hash_balance_factor": 125}
    assert configured(SYSTEMS["sglang-cache_aware-defaults"], setup).options == {}
    assert configured(SYSTEMS["skylb"], setup) is SYSTEMS["skylb"]


def test_summary_gives_spreads_cpu_and_who_was_lowest():
    """Per system: mean [min, max] over the runs of every figure, CPU ms/request included, and in how many runs
    its TTFT p90 was strictly lower than every other system's (a tie counts for no one)."""
    result = _result({
        0: {"skylb": _figures(10, 900, [1, 1, 0, 2], 3.0), "haproxy-leastconn": _figures(11, 1000, [0] * 4)},
        1: {"skylb": _figures(12, 800, [2, 1, 1, 1], 5.0), "haproxy-leastconn": _figures(11, 800, [0] * 4)}})
    summary = {s["system"]: s for s in baselines.summary_rows(result)}
    assert summary["skylb"]["cpu_ms"] == [3.0, 5.0] and summary["skylb"]["pending_peak"] == [2, 2]
    assert summary["skylb"]["lowest_p90"] == 1 and summary["haproxy-leastconn"]["lowest_p90"] == 0
    text = format_markdown(result)
    cells = _cells(text, "skylb")
    assert cells[2] == "11.00 [10.00, 12.00]" and cells[6] == "2.0 [2, 2]" and cells[7] == "4.00 [3.00, 5.00]"
    assert _cells(text, "haproxy-leastconn")[7] == "1.00 [1.00, 1.00]"
    assert "CPU ms/request" in text and "maxconn 4" in text and "--balance-abs-threshold" not in text


def test_targets_are_met_or_missed_from_the_figures():
    """Each target MET or MISSED: lowest mean TTFT p90, lower in >= 4 of 5 paired runs, throughput within the best
    other system's spread, peak pending per replica <= 2."""
    good = {seed: {"skylb": _figures(10.0, 700, [1, 2, 0, 1]), "sglang-round_robin": _figures(10.2 - seed * 0.1, 900,
                                                                                               [3, 3, 3, 3])}
            for seed in range(5)}
    assert [met for _, _, met in acceptance(_result(good))] == [True, True, True, True]
    text = format_markdown(_result(good))
    assert "## Targets" in text and text.count("| MET ") == 4
    bad = dict(good)
    bad[0] = {"skylb": _figures(8.0, 1000, [3, 0, 0, 0]), "sglang-round_robin": _figures(10.2, 900, [3, 3, 3, 3])}
    bad[1] = {"skylb": _figures(8.0, 1000, [0, 0, 0, 0]), "sglang-round_robin": _figures(10.2, 900, [3, 3, 3, 3])}
    verdicts = acceptance(_result(bad))
    assert [met for _, _, met in verdicts] == [True, False, False, False]
    assert verdicts[1][1] == "3 of 5 (needs 4)"
    assert "| MISSED " in format_markdown(_result(bad))


def test_targets_are_not_judged_without_skylb_or_a_baseline():
    """Without a skylb run, or with skylb alone, no target is judged."""
    alone = _result({0: {"skylb": _figures(10, 700, [0] * 4)}})
    assert {met for _, _, met in acceptance(alone)} == {None}
    other = _result({0: {"haproxy-hash": _figures(10, 700, [0] * 4)}})
    assert {met for _, _, met in acceptance(other)} == {None}
    assert "not judged" in format_markdown(other)


def test_report_names_each_systems_configuration():
    """The setup section gives each system's configuration with its values and reasons."""
    text = format_markdown(_result({0: {n: _figures(10, 700, [0] * 4) for n in DEFAULT_SYSTEMS}}))
    for needle in ("`skylb`: SkyLB controller", "the default configuration otherwise (no overrides)",
                   "--policy cache_aware --cache-threshold 0.3 --balance-abs-threshold 2 --balance-rel-threshold 1.25",
                   "`balance leastconn`, `server ... maxconn 4`", "`timeout queue 120s`",
                   "`balance hdr(X-Session-ID)`, `hash-type consistent`, `hash-balance-factor 125`",
                   "--policy round_robin", "time-scale 0.5"):
        assert needle in text, needle
