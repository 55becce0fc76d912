"""bench/live/kv_regions.py: the forward audit's rule, and the benchmark end to end on tiny sizes (three regions of
one emulated vLLM replica publishing KV-cache events, the balancers routing by them)."""

from __future__ import annotations

import json

from bench.live import kv_regions
from bench.replay.report import RequestRecord


def _record(rid: str, region: str, route: str | None, sent_s: float = 1.0) -> RequestRecord:
    return RequestRecord(id=rid, region=region, route=route, sent_s=sent_s)


def test_a_forward_counts_as_held_only_when_a_region_other_than_the_clients_held_half_the_prompt():
    """Local answers are not forwards; a forward whose prompt no peer region held (the client's own region does not
    count) is not judged; one a peer held counts as to a holding region when it went to any holder, and as to the
    deepest only when it went to the one holding the most. With the balancers' readings of open peers, a forward
    counts as "held, a holder open" when a holder was open in the client's balancer's latest reading before it was
    sent."""
    held = {
        "local": {"us": 0.9, "eu": 0.9, "asia": 0.0},
        "own-only": {"us": 0.9, "eu": 0.4, "asia": 0.0},
        "to-deepest": {"us": 0.0, "eu": 0.8, "asia": 0.6},
        "to-holder": {"us": 0.0, "eu": 0.8, "asia": 0.6},
        "elsewhere": {"us": 0.0, "eu": 0.8, "asia": 0.1},
    }
    records = [_record("local", "us", "local"), _record("own-only", "us", "peer:eu"),
               _record("to-deepest", "us", "peer:eu", 1.0), _record("to-holder", "us", "peer:asia", 3.0),
               _record("elsewhere", "us", "peer:asia", 3.0)]
    assert kv_regions.forward_audit(records, held) == {"forwarded": 4, "held_by_peer": 3, "to_holder": 2,
                                                       "to_deepest": 1, "held_with_room": 0,
                                                       "to_holder_with_room": 0}
    # us could forward to eu and asia until 2 s, then to asia only: "elsewhere" (eu held it) had no open holder.
    open_peers = {"us": [(0.5, frozenset({"eu", "asia"})), (2.0, frozenset({"asia"}))], "eu": [], "asia": []}
    audit = kv_regions.forward_audit(records, held, open_peers)
    assert (audit["held_with_room"], audit["to_holder_with_room"]) == (2, 2)


def test_kv_regions_runs_three_regions_routing_by_their_replicas_kv_cache_events(tmp_path):
    """End to end on tiny sizes: every request of a few seconds of the workload is served, every balancer follows
    its replica's events, the bench's own audit follows all three streams, and the report has the row."""
    from bench import bench_cli
    assert "kv_regions" in bench_cli.LIVE_BENCHMARKS  # `skylb bench kv_regions`
    out = tmp_path / "kv_regions.md"
    assert kv_regions.main(["--systems", "skylb-kv", "--rates", "3", "--duration-s", "3", "--time-scale", "0.05",
                            "--tenants", "3", "--replicas", "1", "--run-dir", str(tmp_path / "runs"),
                            "--out-md", str(out)]) == 0
    [row] = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["status"] == "ok", row.get("reason")
    f = row["figures"]
    assert f["sent"] == row["requests"] > 0 and f["completed"] == f["sent"], f["errors"]
    assert {r: (e["live"], e["replicas"]) for r, e in row["kv_events"].items()} == dict.fromkeys(kv_regions.REGIONS,
                                                                                                (1, 1))
    assert sum(e["blocks"] for e in row["kv_events"].values()) > 0
    streams = row["audit_streams"]
    assert sorted(streams) == ["asia/0", "eu/0", "us/0"] and all(s["live"] for s in streams.values())
    assert sum(s["batches"] for s in streams.values()) > 0
    fw = row["forwards"]
    assert fw["forwarded"] >= fw["held_by_peer"] >= fw["to_holder"] >= fw["to_holder_with_room"]
    assert "| 3 | 0 | skylb-kv | " in out.read_text()
