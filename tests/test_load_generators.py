"""`skylb bench load_generators` (bench/live/load_generators.py): AIPerf against a balancer, judged on what both
counted. AIPerf itself is installed apart (about 1.2 GB), so the run is not in `make test`; its result file is
bench/results/load_generators.md. These tests check the parts that decide the verdict."""

from __future__ import annotations

import json

from bench.live.load_generators import _statuses, main, passed


def _result(**over):
    base = {"exit": 0, "requests": 40, "aiperf_valid": 40, "aiperf_errors": 0, "error_summary": [],
            "balancer_statuses": {"200": 40}}
    return base | over


def test_a_run_passes_only_when_aiperf_and_the_balancer_both_saw_every_request_succeed():
    assert passed(_result())
    assert not passed(_result(exit=1))
    assert not passed(_result(aiperf_valid=39, aiperf_errors=1))
    assert not passed(_result(error_summary=[{"code": 502, "count": 1}]))
    assert not passed(_result(balancer_statuses={"200": 39, "503": 1}))
    assert not passed(_result(aiperf_valid=None, aiperf_errors=None))  # AIPerf's log said nothing


def test_the_balancer_statuses_are_read_from_its_request_lines_only(tmp_path):
    log = tmp_path / "balancer.log"
    log.write_text("\n".join([json.dumps({"event": "request", "status": 200}),
                              "2026-11-29 plain text line mentioning \"request\"",
                              json.dumps({"event": "request_finished", "status": 500}),
                              "prefix " + json.dumps({"event": "request", "status": 503})]))
    assert _statuses(log) == {200: 1, 503: 1}


def test_without_aiperf_it_says_how_to_install_it_and_exits_2(tmp_path, capsys):
    assert main(["--aiperf", str(tmp_path / "missing" / "aiperf")]) == 2
    err = capsys.readouterr().err
    assert "pip install aiperf" in err and "--aiperf" in err
