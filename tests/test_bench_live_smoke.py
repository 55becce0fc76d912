"""Smoke tests of the live benchmarks (bench/peers.py, bench/overhead.py, bench/live.py): tiny sizes, seconds each.

They pin down that each benchmark runs end to end and reports every figure, not the figures themselves. The
HAProxy and SGLang router parts are skipped, with the reason, when their binary or package is absent.
"""

from __future__ import annotations

import pytest

from bench import peers
from bench.live import REGIONS, LiveSetup, deployment_config, ranking
from bench.overhead import added_latency, decision_time, fill_trie, trie_memory
from bench.peers import PeersSetup, format_markdown, run_peers, unavailable_reason
from skylb.core import PrefixTrie

TINY = PeersSetup(replicas=2, max_num_seqs=2, time_scale=0.02, conversations=3, turns=2, deadline_s=60.0,
                  request_timeout_s=30.0)
FIGURES = ("throughput_rps", "output_tokens_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms",
           "e2e_p90_ms", "prefix_hit_rate", "pending_peak_max")


def _check_peers_row(result: dict, name: str) -> None:
    row = next(r for r in result["rows"] if r["system"] == name)
    assert row["status"] == "ok", row.get("reason")
    f = row["figures"]
    assert f["sent"] == 6 and f["completed"] == 6 and f["failed"] == 0, f["errors"]
    for key in FIGURES:
        assert f[key] is not None, key
    assert f"| {name} | 6/6 |" in format_markdown(result)


def test_decision_time_reports_every_cell():
    """decision_time gives p50 <= p99 for every (prompt length, fill) cell and the new-conversation column."""
    r = decision_time(lengths=(200, 600), fills=(0.0, 0.5, 1.0), trie_max_chars=30_000, samples=lambda L: 4,
                      progress=lambda msg: None)
    for key in ("200@0.0", "600@0.0", "200@0.5", "600@0.5", "200@1.0", "600@1.0", "200@new", "600@new"):
        cell = r["cells"][key]
        assert 0 < cell["p50_ms"] <= cell["p99_ms"], key
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
    """Part (a) on a handful of requests: every request succeeds, direct and through SkyLB."""
    r = added_latency(n=10, warmup=2, systems=("direct", "skylb"), run_dir=tmp_path)
    for name in ("direct", "skylb"):
        assert r["systems"][name]["errors"] == 0 and r["systems"][name]["n"] == 10
    assert r["systems"]["skylb"]["added_p50_ms"] is not None


def test_peers_run_against_skylb(tmp_path):
    """One peers run against SkyLB alone completes every request and reports every figure."""
    result = run_peers(["skylb"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_peers_row(result, "skylb")


@pytest.mark.skipif(bool(unavailable_reason("haproxy")), reason=unavailable_reason("haproxy") or "")
def test_peers_run_against_haproxy(tmp_path):
    """HAProxy (generated config, leastconn) relays the same workload without a failed request."""
    result = run_peers(["haproxy-leastconn"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_peers_row(result, "haproxy-leastconn")


@pytest.mark.skipif(bool(unavailable_reason("sglang")), reason=unavailable_reason("sglang") or "")
def test_peers_run_against_sglang_router(tmp_path):
    """The SGLang router (cache_aware) relays the same workload without a failed request."""
    result = run_peers(["sglang-cache_aware"], setup=TINY, run_dir=tmp_path, progress=False)
    _check_peers_row(result, "sglang-cache_aware")


def test_missing_peer_is_skipped_with_reason(tmp_path, monkeypatch):
    """A system whose binary is missing is reported as skipped, with the reason, and nothing is started."""
    monkeypatch.setattr(peers, "haproxy_binary", lambda: None)
    result = run_peers(["haproxy-roundrobin"], setup=TINY, run_dir=tmp_path, progress=False)
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
