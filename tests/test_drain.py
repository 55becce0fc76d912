"""Drain (issue 9, item 3) with real processes: `skylb-ctl replica drain` lets the streams in flight finish, sends
nothing new to the replica, and returns when it is done; `skylb-ctl balancer drain` moves a region's replicas to
the closest live region's balancer and returns when the drained balancer holds nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import requests

from tests.cluster import MODEL, Cluster

HEALTH = {"interval_s": 0.5, "fastinter_s": 0.2, "timeout_s": 1.0, "rise": 2, "fall": 3}  # 1 s: a loaded machine


def _stream(url: str, prompt: str, out: list, max_tokens: int = 80) -> None:
    """One streamed completion; appends (served_by, chunks, saw [DONE], end time) to ``out``."""
    with requests.post(f"{url}/v1/completions", stream=True, timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}) as resp:
        assert resp.status_code == 200, resp.text
        lines = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
        out.append((resp.headers["X-SkyLB-Served-By"], len(lines) - 1, lines[-1] == b"data: [DONE]",
                    time.monotonic()))


def _ctl_popen(cluster: Cluster, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "controller.ctl", "--controller", cluster.controller_url, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_replica_drain_lets_streams_finish_and_reports_done(procs, tmp_path):
    cluster = Cluster(procs, tmp_path, controller={"health": HEALTH}, balancer={"policy": "round-robin"})
    cluster.start_controller(["us"])
    url_a, url_b = cluster.start_emulator(2, "--time-scale", "1.0")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", url_a, replica_id="us-a")
    cluster.add_replica("us", url_b, replica_id="us-b")
    cluster.wait_replicas_healthy("us", 2)

    streams: list = []
    threads = [threading.Thread(target=_stream, args=(url, f"long story {i}", streams)) for i in range(4)]
    for t in threads:
        t.start()
    cluster.wait_until(lambda: next(r for r in cluster.status("us")["replicas"] if r["id"] == "us-a")["outstanding"],
                       timeout_s=10, what="streams in flight on us-a")
    drain = _ctl_popen(cluster, "replica", "drain", "us-a", "-o", "json", "--wait-timeout", "60")
    cluster.wait_until(lambda: next(r for r in cluster.status("us")["replicas"] if r["id"] == "us-a")["draining"],
                       timeout_s=5, what="us-a draining at the balancer")
    new = []
    for i in range(4):  # while us-a drains, new requests go to us-b only
        resp = requests.post(f"{url}/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": f"new {i}", "max_tokens": 2})
        assert resp.status_code == 200
        new.append(resp.headers["X-SkyLB-Served-By"])
    stdout, stderr = drain.communicate(timeout=60)
    drained_at = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert drain.returncode == 0, stderr
    report = json.loads(stdout)
    assert report["done"] is True and report["replica"]["draining"] is True
    assert new == ["us/us-b"] * 4
    assert len(streams) == 4 and all(done and chunks > 0 for _, chunks, done, _ in streams), streams
    on_a = [end for served_by, _, _, end in streams if served_by == "us/us-a"]
    assert on_a and max(on_a) <= drained_at  # the command returned only after us-a's streams ended
    table = cluster.ctl("replica", "list").stdout
    assert "DRAINING" in table and "us-a" in table
    assert cluster.ctl("replica", "undrain", "us-a").returncode == 0
    cluster.wait_until(lambda: not next(r for r in cluster.status("us")["replicas"]
                                        if r["id"] == "us-a")["draining"], timeout_s=5, what="us-a undrained")


def test_balancer_drain_moves_the_region_and_reports_empty(procs, tmp_path):
    cluster = Cluster(procs, tmp_path, controller={"health": HEALTH, "failover": {"rtt_ms": {"us-eu": 80}}})
    cluster.start_controller(["us", "eu"])
    for region in ("us", "eu"):
        (replica_url,) = cluster.start_emulator(1, "--time-scale", "1.0", name=f"emulator-{region}")
        cluster.add_replica(region, replica_url, replica_id=f"{region}-1")
    for region in ("us", "eu"):
        cluster.start_balancer(region, ["us", "eu"])
    cluster.wait_replicas_healthy("us", 1)
    cluster.wait_peers_probed("us", 1)

    streams: list = []
    thread = threading.Thread(target=_stream, args=(cluster.balancers["us"], "a long answer", streams))
    thread.start()
    cluster.wait_until(lambda: cluster.status("us")["in_flight"], timeout_s=10, what="a stream in flight at us")
    drain = cluster.ctl("balancer", "drain", "us", "-o", "json", "--wait-timeout", "60")
    report = json.loads(drain.stdout)
    thread.join(timeout=60)
    assert report["done"] is True and report["served_by"] == "eu"
    assert streams and streams[0][2], "the stream in flight at the drained balancer finished"
    status = cluster.status("us")
    assert status["draining"] and status["in_flight"] == 0 and status["replicas"] == []
    assert sorted(r["id"] for r in cluster.status("eu")["replicas"]) == ["eu-1", "us-1"]
    # A client still sent to us (DNS caches) is served: forwarded to eu, which holds us-1 now.
    resp = requests.post(f"{cluster.balancers['us']}/v1/completions", timeout=30,
                         json={"model": MODEL, "prompt": "late client", "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["X-SkyLB-Served-By"].startswith("eu/")
    view = json.loads(cluster.ctl("status", "-o", "json").stdout)
    assert {r["region"]: r["balancer_region"] for r in view["regions"]} == {"eu": "eu", "us": "eu"}
    assert cluster.ctl("balancer", "undrain", "us").returncode == 0
    cluster.wait_until(lambda: [r["id"] for r in cluster.status("us")["replicas"]] == ["us-1"], timeout_s=10,
                       what="us-1 back at us")
