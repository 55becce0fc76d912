"""bench/live/calibrate.py: the engine model's fit to llama-server and the side-by-side replay.

The pure tests fit the model to timings the model itself produced (the fit must give its parameters back) and
replay small bursts; the last test runs the whole calibration on a small scale against a real llama-server (it
skips when the binary or the model is missing here, and fails instead when CI=true). Tests check behaviour, not
timings.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from bench.live.calibrate import (MAX_REQUESTS, PAPER_PREFILL_512_MS, CalRequest, DecodePoint, FitPlan, PrefillPoint,
                             Scenario, SideRun, as_slots, build_parser, calibrate, chunk_probe, compare, decode_points,
                             default_scenarios, fit_decode, fit_prefill, fit_probes, fitted_params, format_markdown,
                             llama_server, paper_check, prefill_points, prompt_words, replay_model, stalls)
from bench.emulator.model import EngineParams
from tests.system import skip_or_fail

#: A small engine like the fitted llama-server (4 slots of 1024 tokens), with step times of a CPU.
CPU_LIKE = EngineParams(max_num_seqs=4, max_num_batched_tokens=2048, kv_cache_tokens=4096, max_model_len=1024,
                        prefill_ms_per_token=4.4, decode_base_ms=8.0, decode_ms_per_seq=13.0,
                        decode_ms_per_kv_token=0.003)


def test_paper_check_gives_about_300_ms_for_a_512_token_prompt_on_the_l4_defaults():
    """EngineParams() prefills a 512-token prompt in about the paper's 300 ms, and decode steps grow with the batch."""
    paper = paper_check()
    assert paper["paper_ms"] == PAPER_PREFILL_512_MS
    assert abs(paper["prefill_512_ms"] - PAPER_PREFILL_512_MS) <= 0.1 * PAPER_PREFILL_512_MS
    steps = list(paper["decode_ms"].values())
    assert steps == sorted(steps) and steps[0] >= EngineParams().decode_base_ms


def test_fit_gives_back_the_parameters_of_the_engine_that_produced_the_timings():
    """Fitting the model's own TTFTs and inter-token gaps (the fit's probes replayed) recovers its step times."""
    pre, dec = fit_probes(FitPlan())
    pre_runs = [replay_model(p, CPU_LIKE, sample_every_s=None) for p in pre]
    dec_runs = [replay_model(p, CPU_LIKE, sample_every_s=None, keep_tokens=True) for p in dec]
    pf = fit_prefill(prefill_points(pre, pre_runs))
    df = fit_decode(decode_points(dec, dec_runs))
    assert pf.ms_per_token == pytest.approx(CPU_LIKE.prefill_ms_per_token, rel=1e-3)
    assert pf.intercept_ms == pytest.approx(CPU_LIKE.decode_base_ms, rel=1e-2)  # one prefill step's overhead
    assert df.base_ms == pytest.approx(CPU_LIKE.decode_base_ms, rel=2e-2)
    assert df.per_seq_ms == pytest.approx(CPU_LIKE.decode_ms_per_seq, rel=2e-2)
    assert df.per_kv_token_ms == pytest.approx(CPU_LIKE.decode_ms_per_kv_token, rel=5e-2)
    params = fitted_params(pf, df, slots=4, ctx_size=4096)
    assert (params.max_num_seqs, params.kv_cache_tokens, params.max_model_len) == (4, 4096, 1024)
    assert params.max_num_batched_tokens == 2048 and params.time_scale == 1.0


def test_decode_fit_keeps_every_coefficient_non_negative():
    """Gaps that shrink with the context drop the context term (0) and still fit base and per-stream cost."""
    points = [DecodePoint(1, 50, 21.0), DecodePoint(2, 100, 42.0), DecodePoint(4, 200, 61.0),
              DecodePoint(1, 800, 20.0)]
    fit = fit_decode(points)
    assert fit.per_kv_token_ms == 0.0 and fit.per_seq_ms > 0 and fit.base_ms >= 0
    assert fit.max_residual_ms == pytest.approx(max(abs(fit.step_ms(p.batch, p.kv_tokens) - p.gap_ms)
                                                    for p in points))


def test_fit_divides_each_measurement_by_the_slowdown_other_processes_caused():
    """Points measured while the server waited for a core (slowdown 2: twice as long) fit like full-core ones."""
    full = [PrefillPoint(32, 150.0), PrefillPoint(256, 1130.0), PrefillPoint(768, 3380.0)]
    slowed = [replace(p, ttft_ms=2 * p.ttft_ms, slowdown=2.0) for p in full]
    assert fit_prefill(slowed) == fit_prefill(full)
    dec = [DecodePoint(1, 56, 24.0), DecodePoint(2, 112, 40.0), DecodePoint(1, 800, 27.0)]
    assert fit_decode([replace(p, gap_ms=1.5 * p.gap_ms, slowdown=1.5) for p in dec]) == fit_decode(dec)


def test_slowdown_is_time_run_plus_time_waiting_for_a_core_over_time_run():
    """A run whose server thread ran 3 s and waited 1 s for a core is slowed 4/3; unmeasured means 1."""
    assert SideRun(server_run_s=3.0, server_wait_s=1.0).slowdown == pytest.approx(4 / 3)
    assert SideRun().slowdown == 1.0 and SideRun(server_run_s=0.0, server_wait_s=0.0).slowdown == 1.0


@pytest.mark.parametrize("points", [[PrefillPoint(64, 300.0)], [PrefillPoint(64, 300.0), PrefillPoint(64, 310.0)],
                                    [PrefillPoint(32, 300.0), PrefillPoint(64, 200.0)]])
def test_prefill_fit_refuses_points_that_do_not_determine_a_cost_per_token(points):
    """One prompt length, or a TTFT that falls as the prompt grows, is a ValueError, not a made-up fit."""
    with pytest.raises(ValueError):
        fit_prefill(points)


def test_replay_queues_requests_beyond_the_slots_and_serves_them_in_order():
    """Four requests at once on two slots: two pending, two running at first; all finish, FCFS first tokens."""
    params = EngineParams(max_num_seqs=2, max_num_batched_tokens=512, kv_cache_tokens=1024, max_model_len=512,
                          prefill_ms_per_token=2.0, decode_base_ms=10.0, decode_ms_per_seq=5.0,
                          decode_ms_per_kv_token=0.0)
    reqs = [CalRequest(f"r{i}", 0.001 * i, 32, 20) for i in range(4)]
    run = replay_model(reqs, params)
    assert set(run.e2e_s) == {r.id for r in reqs} and run.errors == {}
    assert run.ttft_s["r0"] == pytest.approx((10.0 + 2.0 * 32) / 1000)  # one prefill step on an idle engine
    first = {rid: run.sent_s[rid] + t for rid, t in run.ttft_s.items()}
    assert first["r1"] <= first["r2"] <= first["r3"] and first["r0"] <= first["r2"]
    early = [s for s in as_slots(run.samples, 2) if 0.3 <= s[0] <= 0.4]  # mid-way through the first pair's decode
    assert early and all((p, r) == (2, 2) for _, p, r in early)
    assert run.samples[-1][1:] == (0, 0)  # sampled until every request finished


def test_stalls_are_the_gaps_far_longer_than_the_stream_usual_gap():
    """A stream that waited 1.44 s once between 30 ms gaps has exactly that one stall; no probe without a prompt."""
    run = SideRun(token_times={"s": [0.0, 0.03, 0.06, 1.5, 1.53, 1.56]})
    assert stalls(run, "s") == [pytest.approx(1440.0)] and stalls(run, "other") == []
    assert chunk_probe(FitPlan(chunk_prompt=0)) == []
    assert [r.at_s for r in chunk_probe(FitPlan())] == [0.0, 1.0]


def test_slot_meaning_counts_only_requests_beyond_the_slots_as_pending():
    """as_slots turns (waiting, running) into llama-server's (deferred, processing) for the same outstanding count."""
    samples = [(0.0, 3, 1), (0.1, 1, 2), (0.2, 0, 1), (0.3, 5, 4)]
    assert as_slots(samples, 4) == [(0.0, 0, 4), (0.1, 0, 3), (0.2, 0, 1), (0.3, 5, 4)]


def test_compare_of_a_run_with_itself_shows_no_error():
    """The same run on both sides: equal figures, zero TTFT and pending/running errors."""
    run = replay_model([CalRequest(f"r{i}", 0.2 * i, 48, 16) for i in range(6)], CPU_LIKE)
    fig = compare(run, run)
    assert fig["real"] == {k: v for k, v in fig["model"].items() if not k.startswith("own_")}
    assert fig["error"] == {"ttft_mae_s": 0.0, "ttft_bias_s": 0.0, "pending_mad": 0.0, "running_mad": 0.0}
    assert fig["real"]["completed"] == 6 and fig["series"][0][0] == 0.0


def test_compare_measures_how_far_the_model_is_from_the_server():
    """A model twice as slow shows positive TTFT errors and more time with requests pending."""
    reqs = [CalRequest(f"r{i}", 0.0, 64, 24) for i in range(8)]
    fast = replay_model(reqs, CPU_LIKE)
    slow = replay_model(reqs, replace(CPU_LIKE, time_scale=2.0))
    fig = compare(fast, slow, slots=4)
    assert fig["error"]["ttft_bias_s"] > 0 and fig["error"]["ttft_mae_s"] == pytest.approx(fig["error"]["ttft_bias_s"])
    assert fig["model"]["makespan_s"] == pytest.approx(2 * fig["real"]["makespan_s"], rel=1e-6)
    assert fig["model"]["pending_mean"] > fig["real"]["pending_mean"] and fig["error"]["pending_mad"] > 0


def test_default_scenarios_fit_one_slot_and_send_the_burst_in_a_defined_order():
    """Every scenario request fits a 1024-token slot; the burst is sent in order within a fraction of a second."""
    scenarios = {s.name: s for s in default_scenarios(1024)}
    assert set(scenarios) == {"burst", "staggered"}
    burst = [r.at_s for r in scenarios["burst"].requests]
    assert burst == sorted(set(burst)) and burst[-1] < 0.5 and len(burst) == 12
    for sc in scenarios.values():
        assert len({r.id for r in sc.requests}) == len(sc.requests) <= MAX_REQUESTS
        assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in sc.requests)
    with pytest.raises(ValueError):
        default_scenarios(256)


def test_prompts_have_one_word_per_token_but_the_bos_and_are_deterministic():
    """A request of n prompt tokens has n - 1 words (llama-server adds BOS), the same words every time."""
    r = CalRequest("x", 0.0, 100, 4, seed=5)
    assert len(r.text.split()) == 99 and r.text == CalRequest("y", 1.0, 100, 8, seed=5).text
    assert prompt_words(10, 1) != prompt_words(10, 2)


def test_replay_is_bounded_in_requests():
    """More than MAX_REQUESTS requests in one run is refused."""
    with pytest.raises(ValueError):
        replay_model([CalRequest(f"r{i}", 0.0, 8, 1) for i in range(MAX_REQUESTS + 1)], CPU_LIKE)


def test_cli_is_registered_and_defaults_to_three_repetitions():
    """`skylb bench calibrate` runs bench.live.calibrate; it repeats each scenario 3 times and writes calibration.md."""
    from bench.bench_cli import LIVE_BENCHMARKS
    from skylb.cli import build_parser as skylb_parser
    assert "calibrate" in LIVE_BENCHMARKS
    args, _ = skylb_parser("bench").parse_known_args(["bench", "calibrate", "--repeats", "1"])
    assert args.bench_command == "calibrate" and args.passes_options
    defaults = build_parser().parse_args([])
    assert defaults.repeats == 3 and defaults.out_md == "bench/results/calibration.md"


def test_report_without_llama_server_still_gives_the_paper_check():
    """With no llama-server, the report holds the paper check and says why the rest did not run."""
    text = format_markdown({"paper": paper_check(), "unavailable": "llama-server is not built", "wall_s": 1.0})
    assert "512-token prompt" in text and "300 ms" in text and "llama-server is not built" in text


# ------------------------------------------------------------------------------------------- real llama-server


@pytest.fixture(scope="module")
def llama_paths() -> dict:
    """The cached llama-server binary and the gemma model; skip without them, fail when CI=true."""
    from bench.launch.llamacpp import LlamaCppUnavailable, gemma_model_path, llama_server_binary
    try:
        return {"binary": llama_server_binary(build=False), "model": gemma_model_path()}
    except LlamaCppUnavailable as exc:
        skip_or_fail(f"real llama.cpp replica unavailable: {exc}")


@pytest.mark.xdist_group("cpu_heavy")  # with the llama-server, chaos and Prometheus tests: one at a time
def test_small_calibration_against_a_real_llama_server(llama_paths, tmp_path):
    """A 2-slot llama-server and its fitted model both show 2 pending, 2 running for 4 requests sent at once."""
    plan = FitPlan(prefill_lengths=(16, 64), prefill_passes=1, decode_batches=(1, 2), decode_prompt=16,
                   decode_output=12, long_prompt=0, decode_passes=1, chunk_prompt=300, chunk_stream_output=120)
    tiny = Scenario("tiny", "4 requests at once", tuple(CalRequest(f"t{i}", 0.02 * i, 24, 32, seed=i)
                                                       for i in range(4)))
    with llama_server(parallel=2, ctx_size=1024, threads=1, binary=llama_paths["binary"],
                      model_path=llama_paths["model"], log_dir=tmp_path) as server:
        assert server["total_slots"] == 2
        result = calibrate(server, slots=2, ctx_size=1024, plan=plan, scenarios=[tiny], repeats=1)
        pid = server["pid"]
    with pytest.raises(ProcessLookupError):  # stopped on the way out
        os.kill(pid, 0)
    params = result["fit"]["params"]
    assert params["max_num_seqs"] == 2 and params["max_model_len"] == 512
    assert params["prefill_ms_per_token"] > 0 and params["decode_base_ms"] + params["decode_ms_per_seq"] > 0
    [rep] = result["scenarios"]["tiny"]["repetitions"]
    assert rep["real"]["completed"] == rep["model"]["completed"] == 4 and rep["real"]["failed"] == 0
    assert rep["real"]["pending_max"] == rep["model"]["pending_max"] == 2
    assert rep["real"]["running_max"] == rep["model"]["running_max"] == 2
    assert rep["cached_tokens"] == 0 and rep["error"]["ttft_mae_s"] is not None
    assert rep["slowdown"] >= 1.0 and rep["model_at_load"]["completed"] == 4
    assert rep["model_at_load"]["makespan_s"] >= rep["model"]["makespan_s"]  # slowed by the measured factor
    chunk = result["fit"]["chunk"]  # a 300-token prompt sent into a decoding stream stalls it on both sides
    assert chunk["real"]["stalls_ms"] and chunk["model"]["stalls_ms"] and chunk["real"]["ttft_ms"] > 0
    result |= {"paper": paper_check(), "wall_s": 1.0, "threads": 1, "load": result["windows"][0][1]}
    text = format_markdown(result)
    assert "| TTFT p90 (s)" in text and "model (fitted)" in text and "## Conditions" in text
