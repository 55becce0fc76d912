"""The controller's active health check (issue 9, item 1) with real processes: a replica that stops answering
leaves every balancer's candidates through a membership revision, and comes back when it answers again; and
`skylb-ctl status` (item 4) shows it, and a balancer that went away."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import requests

from tests.cluster import MODEL, Cluster, get_json
from tests.procs import free_ports

HEALTH = {"health": {"interval_s": 0.2, "timeout_s": 0.5, "rise": 2, "fall": 2}}


def _controller_replica(cluster: Cluster, replica_id: str) -> dict:
    return next(r for r in get_json(f"{cluster.controller_url}/v1/replicas")["replicas"] if r["id"] == replica_id)


def _balancer_replicas(cluster: Cluster) -> list[str]:
    return sorted(r["id"] for r in cluster.status("us")["replicas"])


def _ctl(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.ctl", "--controller", cluster.controller_url, *args],
                          capture_output=True, text=True, timeout=30)


def _ctl_status(cluster: Cluster) -> dict:
    """`skylb-ctl status --json`, checked to exit 0; its table form is checked to name every replica."""
    table = _ctl(cluster, "status")
    assert table.returncode == 0, table.stderr
    assert "REPLICA" in table.stdout and "us-a" in table.stdout and "us-b" in table.stdout
    out = _ctl(cluster, "status", "--json")
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert all("placed_by_rule" in b for b in view["balancers"])
    return view


def test_unhealthy_replica_leaves_the_candidates_and_comes_back(procs, tmp_path):
    """Stop one of two replicas: after ``fall`` failed checks the controller marks it unhealthy (a new revision),
    the balancer drops it and keeps serving on the other; restart it on the same port: after ``rise`` good checks
    it is healthy again and back among the balancer's replicas."""
    cluster = Cluster(procs, tmp_path, controller=HEALTH)
    cluster.start_controller(["us"])
    ports = free_ports(2)

    def emulator(port: int):
        return procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", str(port), "--time-scale",
                           "0.2", name=f"emulator-{port}-{time.monotonic_ns()}",
                           wait_url=f"http://127.0.0.1:{port}/health")

    first = emulator(ports[0])
    emulator(ports[1])
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", f"http://127.0.0.1:{ports[0]}", replica_id="us-a")
    cluster.add_replica("us", f"http://127.0.0.1:{ports[1]}", replica_id="us-b")
    cluster.wait_replicas_healthy("us", 2)
    assert _controller_replica(cluster, "us-a")["healthy"]
    revision = get_json(f"{cluster.controller_url}/healthz")["revision"]

    first.stop()
    cluster.wait_until(lambda: not _controller_replica(cluster, "us-a")["healthy"], timeout_s=5,
                       what="us-a marked unhealthy by the controller")
    assert get_json(f"{cluster.controller_url}/healthz")["revision"] == revision + 1
    cluster.wait_until(lambda: _balancer_replicas(cluster) == ["us-b"], timeout_s=5,
                       what="us-a out of the balancer's replicas")
    view = _ctl_status(cluster)
    assert [(r["id"], r["healthy"]) for r in view["replicas"]] == [("us-a", False), ("us-b", True)]
    assert [(b["region"], b["reachable"]) for b in view["balancers"]] == [("us", True)]
    assert view["replicas"][1]["balancer"] == view["balancers"][0]["url"]
    assert view["replicas"][1]["pending"] == 0 and view["replicas"][0]["balancer"] is None
    for i in range(3):
        resp = requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": f"still served {i}",
                                                            "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200 and resp.headers["X-SkyLB-Served-By"] == "us/us-b"

    emulator(ports[0])
    cluster.wait_until(lambda: _controller_replica(cluster, "us-a")["healthy"], timeout_s=5,
                       what="us-a healthy again")
    cluster.wait_until(lambda: _balancer_replicas(cluster) == ["us-a", "us-b"], timeout_s=5,
                       what="us-a back among the balancer's replicas")
    assert get_json(f"{cluster.controller_url}/healthz")["revision"] == revision + 2

    # The balancer goes away: status still answers (exit 0), saying so.
    next(p for p in procs.procs if p.name == "balancer-us").stop()
    view = _ctl_status(cluster)
    assert [(b["region"], b["reachable"]) for b in view["balancers"]] == [("us", False)]
    assert view["balancers"][0]["error"] == "connection refused"
    assert all(r["balancer"] is None and r["pending"] is None for r in view["replicas"])
