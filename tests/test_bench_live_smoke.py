"""Smoke tests of the live benchmarks (bench/live/baselines.py, bench/live/overhead.py, bench/live/regions.py): tiny sizes, seconds
each.

They pin down that each benchmark runs end to end and reports every figure, not the figures themselves. The
HAProxy and SGLang router parts are skipped, with the reason, when their binary or package is absent.
"""

from __future__ import annotations

import json

import pytest

from bench.live import baselines, harness, regions as live
from bench.launch import launchers
from bench.live.baselines import BaselinesSetup, format_markdown, run_baselines
from bench.launch.launchers import unavailable_reason
from bench.live.regions import LIVE_SYSTEMS, REGIONS, LiveSetup, deployment_config, kendall_tau, ranking, simulate_setup
from bench.live.overhead import added_latency, decision_time, fill_trie, max_rate, targets, trie_memory
from bench.replay.sampling import MachineLoad
from bench.replay.workload import synthetic_workload
from skylb.core import PrefixTrie
from tests.system import require_binary

TINY = BaselinesSetup(replicas=2, max_num_seqs=2, time_scale=0.02, conversations=3, turns=2, deadline_s=60.0,
                      request_timeout_s=30.0)
FIGURES = ("throughput_rps", "output_tokens_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms",
           "e2e_p90_ms", "prefix_hit_rate", "pending_peak_max")


def _table_rows(text: str) -> list[list[str]]:
    """The rows of every Markdown table in ``text``, as lists of stripped cells (header and rule rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]


def _check_baseline_row(result: dict, name: str) -> None:
    row = next(r for r in result["rows"] if r["system"] == name)
    assert row["status"] == "ok", row.get("reason")
    f = row["figures"]
    assert f["sent"] == 6 and f["completed"] == 6 and f["failed"] == 0, f["errors"]
    for key in FIGURES:
        assert f[key] is not None, key
    assert f["cpu_s"] >= 0 and f["cpu_ms_per_request"] == pytest.approx(1000 * f["cpu_s"] / 6)
    assert [name, str(row["seed"]), "6/6"] in [cells[:3] for cells in _table_rows(format_markdown(result))]


def test_decision_time_reports_every_cell():
    """decision_time gives p50 <= p99 for every (prompt length, fill) cell, the new-conversation column, the
    look-ahead's first and later scans and the decisions with a queue (one placed per sample)."""
    r = decision_time(lengths=(200, 600), fills=(0.0, 0.5, 1.0), trie_max_chars=30_000, samples=lambda L: 4,
                      progress=lambda msg: None)
    cells = [r["cells"][key] for key in ("200@0.0", "600@0.0", "200@0.5", "600@0.5", "200@1.0", "600@1.0",
                                         "200@new", "600@new", "200@queued", "600@queued")]
    cells += [r["cells"][f"{L}@lookahead"][scan] for L in (200, 600) for scan in ("first", "kept")]
    for cell in cells:
        assert 0 < cell["p50_ms"] <= cell["p99_ms"]
    assert r["cells"]["600@queued"]["placed"] == 4 and r["cells"]["600@queued"]["window"] == 64
    assert "ncalls" in r["profile"]


def test_fill_trie_full_stays_within_bound():
    """Filling to 100% goes on until the trie evicts, and the trie never stores more than its bound."""
    trie = PrefixTrie(max_chars=20_000, chunk_chars=64)
    convs = fill_trie(trie, 1.0, targets=["r0", "r1"], stream_words=800)
    assert len(convs) >= 2
    assert 0.5 * trie.max_chars < trie.stored_chars <= trie.max_chars


def test_trie_memory_child_process():
    """trie_memory measures RSS in a child process with both tries filled to a (tiny) bound."""
    r = trie_memory(trie_max_chars=20_000, timeout_s=120)
    assert all(0 < c <= 20_000 for c in r["stored_chars"])
    assert r["after"]["rss_kib"] > 0


def test_added_latency_direct_and_skylb(tmp_path):
    """Part (a) on a handful of requests: every request succeeds, direct, through SkyLB and through the aiohttp
    pass-through floor."""
    r = added_latency(n=10, warmup=2, systems=("direct", "skylb"), run_dir=tmp_path)
    for name in ("direct", "skylb", "aiohttp"):
        assert r["systems"][name]["errors"] == 0 and r["systems"][name]["n"] == 10
    assert r["systems"]["skylb"]["added_p50_ms"] is not None and r["systems"]["skylb"]["cpu_ms_per_request"] >= 0
    assert r["systems"]["skylb"]["added_p50_vs_sglang"] is None  # no SGLang router in this run


def test_streamed_ramp_counts_whole_streams(tmp_path):
    """Part (c)'s streamed ramp on two small steps: every streamed request through SkyLB arrives whole (to
    ``data: [DONE]``), both steps are sustained, and the balancer's CPU per request is measured."""
    r = max_rate(systems=("skylb",), rates=(10, 20), step_s=0.5, stream=True, max_tokens=4, run_dir=tmp_path)
    row = r["systems"]["skylb"]
    assert row["sustained_rps"] == 20 and all(st["errors"] == 0 and st["ok"] == st["sent"] for st in row["steps"])
    assert row["steps"][-1]["balancer_cpu_ms_per_req"] is not None and r["stream"] is True


def test_targets_judge_what_ran():
    """The targets of bench/live/overhead.py: the SGLang ratio from part (a), the decisions from part (d); a target
    whose part did not run is neither met nor missed."""
    a = {"systems": {"skylb": {"added_p50_ms": 0.6, "added_p50_vs_sglang": 1.2},
                     "sglang": {"added_p50_ms": 0.5}}}
    d = {"lengths": [1000, 32000], "cells": {"32000@1.0": {"p99_ms": 0.8}, "32000@queued": {"p99_ms": 1.3}}}
    assert [t["met"] for t in targets({"a": a, "d": d})] == [True, True, True, False]
    assert [t["met"] for t in targets({"a": a})] == [True, True, None, None]
    assert targets({"a": a})[1]["measured"] == "1.20 x (0.60 ms / 0.50 ms)"


def test_baselines_run_against_two_sibling_balancers(tmp_path):
    """One baselines run against two balancers of the region (siblings) completes every request and reports every
    figure; the workload's requests are spread over both siblings. (SkyLB with one balancer: test_baselines_run_skylb_with_one_balancer.)"""
    from bench.replay.run import _balancer_for
    result = run_baselines(["skylb-siblings"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_baseline_row(result, "skylb-siblings")
    assert "2 balancers (siblings" in format_markdown(result)
    ids = [r.id for r in synthetic_workload(TINY.workload_config(), ["us"])]
    assert {_balancer_for(["b1", "b2"], i) for i in ids} == {"b1", "b2"}
    assert [_balancer_for(["b1", "b2"], i) for i in ids] == [_balancer_for(["b1", "b2"], i) for i in ids]


def test_baselines_run_skylb_with_one_balancer(tmp_path):
    """SkyLB's default deployment (one balancer in the region) relays the workload without a failed request and
    reports every figure."""
    result = run_baselines(["skylb"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_baseline_row(result, "skylb")


def test_baselines_over_several_seeds_report_the_spread(tmp_path):
    """--seeds runs each system once per workload seed; the summary gives the runs, mean [min, max] and how often
    each system came first. On HAProxy (generated config, leastconn: Debian's haproxy, installed by `make test`;
    skipped where it is missing, a failure under CI=true), which starts in milliseconds where SkyLB's deployment
    takes seconds."""
    require_binary("haproxy")
    result = run_baselines(["haproxy-leastconn"], setup=TINY, run_dir=tmp_path, progress=False, seeds=[0, 1])
    assert [(r["system"], r["seed"], r["status"]) for r in result["rows"]] == [
        ("haproxy-leastconn", 0, "ok"), ("haproxy-leastconn", 1, "ok")]
    for seed in (0, 1):
        _check_baseline_row({**result, "rows": [r for r in result["rows"] if r["seed"] == seed]}, "haproxy-leastconn")
    [summary] = baselines.summary_rows(result)
    assert summary["runs"] == 2 and summary["first_rps"] == 2 and summary["first_p90"] == 2
    text = format_markdown(result)
    assert "live, 2 paired runs" in text and "seeds 0, 1" in text
    rps = [r["figures"]["throughput_rps"] for r in result["rows"]]
    assert f"[{min(rps):.2f}, {max(rps):.2f}]" in text


@pytest.mark.skipif(bool(unavailable_reason("sglang")), reason=unavailable_reason("sglang") or "")
def test_baselines_run_against_sglang_router(tmp_path):
    """The SGLang router (cache_aware) relays the same workload without a failed request."""
    result = run_baselines(["sglang-cache_aware"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_baseline_row(result, "sglang-cache_aware")


def test_baselines_run_against_haproxy_hash(tmp_path):
    """HAProxy with consistent hashing on the session header (bounded loads) relays the same workload."""
    require_binary("haproxy")
    result = run_baselines(["haproxy-hash"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_baseline_row(result, "haproxy-hash")
    config = (tmp_path / "seed0" / "haproxy-hash" / "haproxy-hash.cfg").read_text()
    assert "balance hdr(X-Session-ID)" in config and "hash-balance-factor 125" in config


def test_missing_baseline_is_skipped_with_reason(tmp_path, monkeypatch):
    """A system whose binary is missing is reported as skipped, with the reason, and nothing is started."""
    monkeypatch.setattr(launchers, "haproxy_binary", lambda: None)
    result = run_baselines(["haproxy-roundrobin"], setup=TINY, run_dir=tmp_path, progress=False)
    row = result["rows"][0]
    assert row["status"] == "skipped" and "haproxy" in row["reason"]
    assert "skipped: haproxy binary not found" in format_markdown(result)


def test_region_local_config_gives_each_balancer_its_own_peer_token():
    """The region-local system differs from skylb only in per-region peer tokens (so no peer is available)."""
    setup = LiveSetup()
    local = deployment_config(setup, policy="skylb", region_local=True)
    shared = deployment_config(setup, policy="skylb", region_local=False)
    tokens = {local.balancer_for(r).peer_token for r in REGIONS}
    assert len(tokens) == len(REGIONS) and None not in tokens
    assert {shared.balancer_for(r).peer_token for r in REGIONS} == {None}


def test_ranking_orders_by_throughput_and_p90_ttft():
    """ranking puts the highest throughput first and the lowest P90 TTFT first."""
    rows = [{"system": "a", "status": "ok", "figures": {"completed": 1, "throughput_rps": 1.0, "ttft_p90_ms": 50}},
            {"system": "b", "status": "ok", "figures": {"completed": 1, "throughput_rps": 2.0, "ttft_p90_ms": 90}},
            {"system": "c", "status": "failed", "reason": "x"}]
    assert ranking(rows) == {"throughput": ["b", "a"], "ttft_p90": ["a", "b"]}


def test_simulated_twin_runs_every_live_system():
    """The live setup replayed in the simulator: every system completes every request; only the forwarding ones
    (skylb, skylb-ch) may forward."""
    setup = LiveSetup(conversations=2, turns=2, token_scale=0.1)
    sim = simulate_setup(setup, list(LIVE_SYSTEMS))
    assert list(sim) == list(LIVE_SYSTEMS)
    sent = 2 * 3 * 2  # conversations per region x regions x turns
    for name, f in sim.items():
        assert f["completed"] == sent and f["throughput_rps"] > 0, name
        assert 0 < f["ttft_p50_ms"] <= f["ttft_p90_ms"] <= f["e2e_p90_ms"], name
        assert set(f["region_ttft_p90_ms"]) == set(REGIONS)
        if name not in ("skylb", "skylb-ch"):
            assert f["forwarded_frac"] == 0, name


def test_kendall_tau():
    """1 for the same order, -1 for the reverse, None with fewer than two common items."""
    assert kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1
    assert kendall_tau(["a", "b", "c"], ["c", "b", "a"]) == -1
    assert kendall_tau(["a", "b", "c"], ["b", "a", "c"]) == pytest.approx(1 / 3)
    assert kendall_tau(["a"], ["a", "b"]) is None


def test_report_sets_the_simulator_beside_live():
    """The live report has a live / simulated table and both rankings with Kendall's tau."""
    setup = LiveSetup(conversations=2, turns=2, token_scale=0.1)
    sim = simulate_setup(setup, ["skylb", "round-robin"])
    figures = {"completed": 12, "sent": 12, "throughput_rps": 1.5, "output_tokens_per_s": 10, "ttft_p50_ms": 100,
               "ttft_p90_ms": 200, "e2e_p50_ms": 300, "e2e_p90_ms": 400, "prefix_hit_rate": 0.5,
               "forwarded_frac": 0.25, "errors": {}}
    rows = [{"system": "skylb", "status": "ok", "figures": figures,
             "report": {"regions": {r: {"ttft_p90_ms": 150} for r in REGIONS}}},
            {"system": "round-robin", "status": "failed", "reason": "boom"}]
    result = {"setup": setup.__dict__.copy(), "workload": "w", "rtt_ms": {"us-eu": 80}, "rows": rows,
              "ranking": ranking(rows), "sim": sim, "sim_ranking": live.order(sim), "wall_s": 1.0,
              "load": MachineLoad().start().stop(), "generated": "now"}
    text = live.format_markdown(result)
    assert "## The simulator beside the live run" in text
    rows = _table_rows(text)
    assert ["skylb", "SkyLB", f"1.50 / {sim['skylb']['throughput_rps']:.2f}"] in [row[:3] for row in rows]
    # the live run failed; the simulated figures still show
    assert any(row[:2] == ["round-robin", "GKE"] and row[2].startswith("- / ") for row in rows)
    assert "Kendall's tau" in text


def test_benchmark_clis_map_flags_to_their_setup():
    """bench.live.baselines and bench.live.regions share one flag set: each flag lands in its setup field, defaults included."""
    args = live.build_parser().parse_args(["--replicas", "3", "--time-scale", "0.5", "--systems", "skylb"])
    setup = harness.setup_from_args(LiveSetup, args)
    assert (setup.replicas, setup.time_scale, setup.turns, args.systems) == (3, 0.5, LiveSetup().turns, ["skylb"])
    assert args.out_md == "bench/results/live.md"
    args = baselines.build_parser().parse_args(["--conversations", "7"])
    assert baselines.setup_and_seeds(args) == (BaselinesSetup(conversations=7), list(baselines.DEFAULT_SEEDS))
    assert args.out_md == "bench/results/baselines.md"


def _trace_file(tmp_path, n: int = 8):
    """A small Mooncake-format trace: two conversations extending their blocks, one request every 2 s."""
    import json
    rows = [{"timestamp": 2000 * i, "input_length": 512 * (2 + i // 2), "output_length": 64,
             "hash_ids": [7] + [1000 * (i % 2) + k for k in range(1 + i // 2)]} for i in range(n)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_live_benchmark_replays_a_trace_window(tmp_path):
    """`skylb bench live --trace --start-s --window-s --time-compression` replays that window open loop; its twin
    in the simulator sends the same requests; a missing trace is an error, not a silent synthetic run."""
    trace = _trace_file(tmp_path)
    args = live.build_parser().parse_args(["--trace", str(trace), "--start-s", "4", "--window-s", "10",
                                           "--time-compression", "2", "--token-scale", "0.05"])
    assert (args.trace, args.start_s, args.window_s, args.time_compression) == (str(trace), 4.0, 10.0, 2.0)
    setup = LiveSetup(token_scale=0.05, trace=str(trace), start_s=4.0, window_s=10.0, time_compression=2.0)
    requests = live.workload_requests(setup)
    assert [r.arrival_s for r in requests] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(r.after is None for r in requests)
    sim = simulate_setup(setup, ["skylb", "region-local"])
    assert all(f["completed"] == len(requests) for f in sim.values())
    with pytest.raises(FileNotFoundError):
        live.workload_requests(LiveSetup(trace=str(tmp_path / "missing.jsonl")))


def test_live_report_gives_the_ideal_hit_rate_beside_the_achieved():
    """The live report prints the trace window's ideal prefix hit rate under the table, and says open loop."""
    setup = LiveSetup(trace="t.jsonl")
    figures = {"completed": 3, "sent": 3, "throughput_rps": 1.0, "output_tokens_per_s": 9.0, "ttft_p50_ms": 10,
               "ttft_p90_ms": 20, "e2e_p50_ms": 30, "e2e_p90_ms": 40, "prefix_hit_rate": 0.2,
               "forwarded_frac": 0.0, "errors": {}}
    rows = [{"system": "skylb", "status": "ok", "figures": figures, "report": {"regions": {}}}]
    result = {"setup": setup.__dict__.copy(), "workload": "w", "rtt_ms": {"us-eu": 80}, "rows": rows,
              "ranking": ranking(rows), "wall_s": 1.0, "load": MachineLoad().start().stop(), "generated": "now",
              "ideal_prefix_hit_rate": 0.345}
    text = live.format_markdown(result)
    assert "Ideal prefix hit rate of these requests: 34.5%" in text and "open loop, trace `t.jsonl`" in text


def test_demo_accepts_a_trace_window():
    """`skylb local --start-s --window-s --time-compression` set the replayed trace window."""
    from bench.launch.demo import apply_overrides
    from skylb.cli import build_parser
    from skylb.config import load_config
    args = build_parser("local").parse_args(["local", "--start-s", "1500", "--window-s", "30",
                                             "--time-compression", "3"])
    _, workload = apply_overrides(load_config(None), args)
    assert (workload.start_s, workload.window_s, workload.time_compression) == (1500.0, 30.0, 3.0)


def test_baselines_seeds_flag():
    """``--seeds 0,2`` runs seeds 0 and 2, ``--seed 3`` seed 3 alone, neither the five default paired runs (seeds
    0-4); anything but comma-separated integers is a usage error (exit 2)."""
    def seeds(*argv):
        setup, chosen = baselines.setup_and_seeds(baselines.build_parser().parse_args(list(argv)))
        assert setup.seed == chosen[0]
        return chosen

    assert seeds("--seeds", "0,2") == [0, 2]
    assert seeds("--seed", "3") == [3]
    assert seeds() == [0, 1, 2, 3, 4]
    with pytest.raises(SystemExit) as exc:
        baselines.build_parser().parse_args(["--seeds", "zero"])
    assert exc.value.code == 2


def test_failover_report_marks_targets_from_the_runs():
    """bench/live/failover.py's report: median [min, max] per event; the two-interval target met or MISSED by the
    slowest run; the leader line against 10 s."""
    from bench.live.failover import format_markdown

    run = {"detected_s": 2.0, "failed_over_s": 2.1, "dns_moved_s": 2.1, "recovered_s": 2.5, "dns_back_s": 2.5}
    slow = dict(run, failed_over_s=4.5)
    result = {"health": {"interval_s": 2.0, "fastinter_s": 0.5, "fall": 3, "rise": 2, "timeout_s": 1.0},
              "runs": [run, slow], "leader_s": [4.0, 5.0], "generated": "now"}
    text = format_markdown(result)
    row = next(line for line in text.splitlines() if "served through eu's balancer" in line)
    assert [cell.strip() for cell in row.strip("|").split("|")] == [
        "us-1 served through eu's balancer", "after the kill", "3.30 [2.10, 4.50]", "<= 4 s: MISSED"]
    assert "4.50 [4.00, 5.00] s after the kill; target <= 10 s: met" in text


def test_soak_classifies_streams():
    """bench/live/soak.py's outcome of a stream: one id, one finish and one [DONE] is ok; an error chunk is an error
    event; two generations spliced are duplicated; a cut stream or a non-API error body is lost. The message of an
    error answer or error chunk is what the report lists."""
    from bench.live.soak import classify_stream

    def sse(*chunks) -> bytes:
        return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)

    a = {"id": "a", "choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
    a_end = {"id": "a", "choices": [{"delta": {}, "finish_reason": "stop"}]}
    b_end = {"id": "b", "choices": [{"delta": {}, "finish_reason": "stop"}]}
    assert classify_stream(200, sse(a, a_end, b"[DONE]")) == "ok"
    assert classify_stream(200, sse(a, {"error": {"message": "replica died"}}, b"[DONE]")) == "error_event"
    assert classify_stream(200, sse(a, a_end, b_end, b"[DONE]")) == "duplicated"
    assert classify_stream(200, sse(a, a_end, b"[DONE]", b"[DONE]")) == "duplicated"
    assert classify_stream(200, sse(a)) == "lost"
    assert classify_stream(503, b'{"error": {"message": "no replica had room"}}') == "http_503"
    assert classify_stream(502, b"<html>bad gateway</html>") == "lost"
    from bench.live.soak import error_message
    assert error_message(sse(a, {"error": {"message": "replica died"}}, b"[DONE]")) == "replica died"
    assert error_message(b'{"error": {"message": "no replica had room"}}') == "no replica had room"
    assert error_message(sse(a, a_end, b"[DONE]")) is None


def test_concurrency_counts_requests_that_waited_in_an_engine_queue(tmp_path):
    """bench.live.concurrency on a tiny load through SkyLB (2 clients, 2 replicas of batch 1): every request completes
    and none waits in an engine queue (the replicas' own log has each one's queue time); a logged wait above the
    threshold is counted, the warm-up's shorter prompts are not."""
    from bench.live.concurrency import ConcurrencySetup, engine_queue_waits, format_markdown, run, workload
    from bench import bench_cli
    assert "concurrency" in bench_cli.LIVE_BENCHMARKS
    setup = ConcurrencySetup(replicas=2, max_num_seqs=1, time_scale=0.05, clients=2, per_client=2, prompt_tokens=32,
                             max_tokens=8, queued_ms=100.0)
    assert [r.after for r in workload(setup, 0)] == [None, "conc-0-00-00", None, "conc-0-01-00"]
    result = run(["skylb", "skylb-stated-batch"], setup, [0], tmp_path, progress=False)
    for row in result["rows"]:  # the batch learned, and stated at registration (--max-concurrency 1)
        assert row["status"] == "ok", row.get("reason")
        f = row["figures"]
        assert f["completed"] == 4 and f["engine_logged"] == 4 and f["engine_queued"] == 0
    log = "\n".join(json.dumps({"event": "request_finished", "prompt_tokens": n, "queue_ms": q})
                    for n, q in ((32, 5.0), (32, 900.0), (2, 3000.0)))
    assert engine_queue_waits(log, 32) == [5.0, 900.0]
    result["provenance"] = {"commit": "abc", "machine": {}}
    report = format_markdown(result)
    assert "| skylb " in report and "not judged" in report and "## Targets of `skylb-stated-batch`" in report


def test_kv_live_runs_the_balancer_routing_by_kv_cache_events(tmp_path):
    """bench.live.kv_live end to end on tiny sizes: the balancer given the replicas' event endpoints serves every request
    of a few seconds of the multi-tenant workload, and the report has its row."""
    from bench import bench_cli
    from bench.live import kv_live
    assert "kv_live" in bench_cli.LIVE_BENCHMARKS  # `skylb bench kv_live`
    out = tmp_path / "kv_live.md"
    assert kv_live.main(["--systems", "skylb-kv", "--rates", "3", "--duration-s", "2", "--time-scale", "0.05",
                         "--tenants", "3", "--run-dir", str(tmp_path / "runs"), "--out-md", str(out)]) == 0
    [row] = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["status"] == "ok", row.get("reason")
    f = row["figures"]
    assert f["sent"] == row["requests"] > 0 and f["completed"] == f["sent"], f["errors"]
    events = row["kv_events"]
    assert events["live"] == events["replicas"] == 4 and events["blocks"] > 0 and events["hashed"] >= f["sent"]
    assert [r for r in _table_rows(out.read_text()) if r[2] == "skylb-kv"]
