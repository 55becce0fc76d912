"""What a chaos run watches while faults run: a timeline of the deployment's own view of itself, and the logs.

:class:`Observer` samples, every ``interval_s`` from a thread: which controller leads; the controllers' verdict on
each balancer (by its name in the cluster: ``ChaosCluster.balancers``) and each region's assignment (the region
whose balancer serves it, and its epoch); each balancer's status (reachable, whether it reaches the controller,
whether its quota fell back from Redis, and for every replica it serves: healthy, ejected, pending and running at
its last probe, its own requests outstanding there; and its peers' availability, by peer name); and each etcd
member's health. bench/chaos/measure.py reads detection and recovery times, the
split brain's overlap and the pending requests on shared replicas from this timeline.

:func:`executions` reads the replicas' and balancers' logs: every request a replica finished (``request_finished``
with the ``X-Request-Id`` it arrived with) traced back through the balancers' request lines (a balancer logs its own
id and the X-Request-Id it was sent, which for a forwarded request is the first balancer's id) to the client's
attempt id.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import requests

from bench.chaos.cluster import ChaosCluster

__all__ = ["Observer", "executions", "stale_epoch_refusals", "evidence"]


class Observer:
    """Samples ``cluster`` every ``interval_s`` into ``samples`` (``clock()``: s since the load began)."""

    def __init__(self, cluster: ChaosCluster, clock: Callable[[], float], *, interval_s: float = 0.3):
        self.cluster, self.clock, self.interval_s = cluster, clock, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-observer", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (waits for the sample in progress)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.samples.append(self.sample())
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def sample(self) -> dict[str, Any]:
        """One sample (see the module docstring); a part that does not answer is None."""
        c = self.cluster
        row: dict[str, Any] = {"t": round(self.clock(), 3), "leader": c.leader(), "ctl": None, "assign": None,
                               "b": {}, "etcd": []}
        try:
            row["ctl"] = {c.name_of(b): bool(b["healthy"]) for b in c.admin("GET", "/v1/balancers")["balancers"]}
            row["assign"] = {a["region"]: [a["balancer_region"], a["epoch"]]
                             for a in c.admin("GET", "/v1/assignments")["assignments"]}
        except RuntimeError:
            pass
        for name in c.balancers:
            row["b"][name] = self._balancer(name)
        for url in c.etcd_client_urls:
            try:
                row["etcd"].append(requests.get(f"{url}/health", timeout=0.5).json().get("health") == "true")
            except (requests.RequestException, ValueError):
                row["etcd"].append(False)
        return row

    def _balancer(self, name: str) -> dict[str, Any] | None:
        """A balancer's view: its replicas, and its peers by peer name (``<region>`` or ``<region>@<id>``)."""
        try:
            st = self.cluster.status(name, timeout_s=1.0)
        except (requests.RequestException, ValueError):
            return None
        quota = st.get("quota") or {}
        return {"ctl": st.get("controller_reachable"), "fallback": quota.get("redis_fallback"),
                "served": st.get("served_regions"),
                "replicas": {r["id"]: {"h": r["healthy"], "ej": (r.get("ejected_for_s") or 0) > 0,
                                       "p": r.get("pending"), "r": r.get("running"), "o": r.get("outstanding")}
                             for r in st["replicas"]},
                "peers": {p["region"]: bool(p["available"] or p["healthy"]) for p in st["peers"]}}


def _lines(paths: list[Path], event: str):
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' not in line:
                continue
            try:
                obj = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            if obj.get("event") == event:
                yield obj


def executions(cluster: ChaosCluster) -> dict[str, list[str]]:
    """Client attempt id -> the replicas that finished a generation for it (several: a duplicate). Replica
    executions whose chain does not reach a client id (a balancer killed before it logged) go under
    ``"?<upstream id>"``."""
    parent: dict[str, str | None] = {}
    for obj in _lines(cluster.logs("balancer-"), "request"):
        parent[obj["id"]] = obj.get("client_request_id")
    found: dict[str, list[str]] = defaultdict(list)
    for obj in _lines(cluster.logs("replica-"), "request_finished"):
        upstream = rid = obj.get("upstream_request_id")
        hops = 0
        while rid in parent and parent[rid] is not None and hops < 4:  # at most two balancers, one hop
            rid, hops = parent[rid], hops + 1
        key = rid if hops and rid not in parent else f"?{upstream}"
        found[key].append(obj.get("replica", "?"))
    return dict(found)


def stale_epoch_refusals(cluster: ChaosCluster, region: str, since: float, until: float) -> int:
    """How many heartbeats of ``region``'s balancer (all its generations) the controllers refused for a stale
    epoch between the unix times ``since`` and ``until`` (its ``stale_epoch`` log lines: it then re-read
    membership and dropped the replicas it no longer serves)."""
    from datetime import datetime
    return sum(1 for obj in _lines(cluster.logs(f"balancer-{region}-"), "stale_epoch")
               if since <= datetime.fromisoformat(obj["timestamp"].replace("Z", "+00:00")).timestamp() <= until)


def evidence(cluster: ChaosCluster, attempt_ids: list[str], *, limit: int = 30) -> dict[str, list[str]]:
    """For each attempt id (a duplicate, say), the log lines that name it or a balancer id its lines carry
    (balancers' request lines, replicas' request_finished lines), ``name: line`` each, at most ``limit``."""
    logs = {path.name: path.read_text(errors="replace").splitlines()
            for path in [*cluster.logs("balancer-"), *cluster.logs("replica-")]}
    out: dict[str, list[str]] = {}
    for attempt in attempt_ids:
        wanted, found = {attempt}, []
        for _ in range(3):  # attempt -> first balancer's id -> second balancer's id
            for name, lines in logs.items():
                for line in lines:
                    if any(w in line for w in wanted) and f"{name}: {line}" not in found:
                        found.append(f"{name}: {line}")
                        try:
                            wanted.add(json.loads(line[line.index("{"):]).get("id") or attempt)
                        except ValueError:
                            pass
        out[attempt] = found[:limit]
    return out
