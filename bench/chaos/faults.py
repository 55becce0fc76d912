"""The faults of a chaos run: what each does to a :class:`bench.chaos.cluster.ChaosCluster`, and the seeded schedule.

A :class:`Fault` has a kind, a target drawn from the seed, a planned start and duration (s after the load began)
and, once run, its actual start and end. ``inject`` breaks something, ``heal`` undoes it (a killed process is
restarted with its original command line on its original port; a cut link is restored). Kinds (:data:`KINDS`):

- ``replica_kill``: SIGKILL one replica's process while it streams (the region's replica with most running
  requests by its own metrics, waiting up to 5 s for one to run any), restart it at the end;
- ``balancer_kill``: SIGKILL a region's balancer (the controllers fail its region over to the closest live one and
  point its DNS name there), restart it at the end (and the region moves back); with siblings, one of them (its
  replicas move to the live siblings; the region stays its own);
- ``leader_kill``: SIGKILL the controller that leads, restart it at the end;
- ``etcd_kill``: SIGKILL one etcd member (two of three keep the quorum), restart it at the end;
- ``redis_kill``: SIGKILL redis-server (the balancers fall back to their shares of the quota), restart it at the end;
- ``partition``: cut one region (all its balancers) from the other regions (both directions), from every controller
  (both directions) and from Redis; heal at the end;
- ``asymmetric``: cut only one balancer's -> controllers links (the controllers still reach the balancer);
- ``latency_spike``: both directions of one inter-region link at 10x their round trip;
- ``slow_replica``: one replica's engine steps 5x longer; ``replica_500``: one replica answers every generation
  with HTTP 500 while its /health stays 200;
- ``split_brain``: cut one balancer from the controllers both ways while it keeps serving its region and its peers:
  the controllers fail its region over to another balancer (with siblings: give its replicas to a sibling), which
  then pushes to the same replicas.

A balancer's fault targets a balancer by its cluster name (``ChaosCluster.balancers``: its region, or with siblings
``<region>-a``, ...), a partition a region.

A cut is a blackhole, not a refusal: Toxiproxy's ``timeout`` toxic (timeout 0) on both streams of every link of the
cut holds the data of open and new connections until the toxic is removed, as a partitioned network does.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from bench.chaos.cluster import ChaosCluster, _wait_redis, balancer_name

__all__ = ["Fault", "KINDS", "FULL_SCHEDULE", "SHORT_SCHEDULE", "schedule", "inject", "heal"]

KINDS = ("replica_kill", "balancer_kill", "leader_kill", "etcd_kill", "redis_kill", "partition", "asymmetric",
         "latency_spike", "slow_replica", "replica_500", "split_brain")

#: (kind, planned start s, planned duration s) after the load began; the full run's schedule.
FULL_SCHEDULE = (("replica_kill", 10, 8), ("slow_replica", 22, 15), ("replica_500", 40, 12),
                 ("balancer_kill", 55, 12), ("latency_spike", 72, 30), ("leader_kill", 80, 10),
                 ("etcd_kill", 106, 10), ("redis_kill", 120, 12), ("partition", 138, 15),
                 ("asymmetric", 158, 28), ("split_brain", 176, 18))
#: The short schedule of the test (under 60 s): a replica kill, a balancer kill, a partition and the split brain.
#: The partition lasts 12 s: the controllers take about 6 s to mark a cut region's balancers unhealthy (interval,
#: then ``fall`` checks that each time out; chaos-siblings.md 5.96-6.18 s), and under a loaded ``make test`` an 8 s
#: cut once healed before both siblings were marked.
SHORT_SCHEDULE = (("replica_kill", 3, 5), ("balancer_kill", 8, 6), ("partition", 24, 12), ("split_brain", 40, 12))
SLOWDOWN = 5.0
SPIKE = 10.0


@dataclass
class Fault:
    """One fault: ``kind``, ``target`` (a region, replica id, "a-b" link, controller or member index), the plan
    (``start_s``, ``duration_s``) and what happened (``started_s``, ``ended_s``, ``notes``)."""

    kind: str
    target: str
    start_s: float
    duration_s: float
    started_s: float | None = None
    ended_s: float | None = None
    healed_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``kind(target)``, as the report names it."""
        return f"{self.kind}({self.target})"

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {**asdict(self), "name": self.name}


def schedule(plan: tuple, regions: tuple[str, ...], replicas_per_region: int, seed: int,
             siblings: int = 1) -> list[Fault]:
    """The faults of ``plan`` with targets drawn from ``seed`` (regions, balancers, replicas, links, members; never
    the region of the fault just before) and each start moved by up to +/- 1 s. With ``siblings`` balancers per
    region a balancer's fault picks one of them (one more draw; with one, the draws are as they always were)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    previous = None
    for kind, start, duration in plan:
        # Not the region of the fault before: its recovery may still run, and one fault would mask the other.
        region = rng.choice([r for r in regions if r != previous] or list(regions))
        previous = region
        others = [r for r in regions if r != region]
        target = {"replica_kill": region, "slow_replica": f"{region}-{rng.randint(1, replicas_per_region)}",
                  "replica_500": f"{region}-{rng.randint(1, replicas_per_region)}",
                  "latency_spike": f"{region}-{rng.choice(others)}", "etcd_kill": str(rng.randrange(3)),
                  "leader_kill": "leader", "redis_kill": "redis"}.get(kind, region)
        if kind in ("balancer_kill", "asymmetric", "split_brain") and siblings > 1:
            target = balancer_name(region, rng.randrange(siblings), siblings)
        faults.append(Fault(kind, target, max(0.0, start + rng.uniform(-1, 1)), duration))
    return faults


# ---------------------------------------------------------------------------------------------------- links

def _toxic(cluster: ChaosCluster, link: str, method: str, toxic: str, body: dict | None = None) -> None:
    api = cluster.links.api_url
    url = f"{api}/proxies/{link}/toxics" + (f"/{toxic}" if toxic else "")
    resp = requests.request(method, url, json=body, timeout=5)
    if resp.status_code not in (200, 201, 204, 404):
        raise RuntimeError(f"toxiproxy {method} {url}: HTTP {resp.status_code} {resp.text[:200]}")


def cut(cluster: ChaosCluster, links: list[str]) -> None:
    """Blackhole ``links`` (both streams)."""
    for link in links:
        for stream in ("upstream", "downstream"):
            _toxic(cluster, link, "post", "", {"name": f"cut_{stream}", "type": "timeout", "stream": stream,
                                               "toxicity": 1.0, "attributes": {"timeout": 0}})


def mend(cluster: ChaosCluster, links: list[str]) -> None:
    """Remove the blackholes of ``links`` (held data goes through)."""
    for link in links:
        for stream in ("upstream", "downstream"):
            _toxic(cluster, link, "delete", f"cut_{stream}")


def _to_controllers(cluster: ChaosCluster, region: str) -> list[str]:
    return [f"{region}-to-ctl{i}" for i in range(len(cluster.controller_urls))]


def links_of(cluster: ChaosCluster, fault: Fault) -> list[str]:
    """The links a partition-like fault cuts: one balancer's to and from the controllers (asymmetric: only to), or
    for a partition every link between the region's balancers and the rest (other regions' balancers, the
    controllers, Redis); siblings of the partitioned region still reach each other."""
    t = fault.target
    if fault.kind == "asymmetric":
        return _to_controllers(cluster, t)
    if fault.kind == "split_brain":
        return [*_to_controllers(cluster, t), f"ctl-to-{t}"]
    cut_off = cluster.siblings_of(t)
    others = [b for b, region in cluster.balancers.items() if region != t]
    return [*(f"{b}-to-{x}" for b in cut_off for x in others), *(f"{x}-to-{b}" for b in cut_off for x in others),
            *(link for b in cut_off for link in (*_to_controllers(cluster, b), f"ctl-to-{b}", f"{b}-to-redis"))]


def _spike(cluster: ChaosCluster, pair: str, factor: float) -> None:
    a, b = pair.split("-")
    rtt = cluster.s.rtt(a, b) * factor
    for link in (f"{a}-to-{b}", f"{b}-to-{a}"):
        for stream, half in (("upstream", int(rtt // 2)), ("downstream", int(rtt - rtt // 2))):
            _toxic(cluster, link, "post", f"latency_{stream}", {"attributes": {"latency": half, "jitter": 0}})


def _replica_faults(cluster: ChaosCluster, replica: str, body: dict) -> None:
    requests.put(f"{cluster.replica_urls[replica]}/emulator/faults", json=body, timeout=5).raise_for_status()


# ---------------------------------------------------------------------------------------------------- inject

def _running_now(cluster: ChaosCluster, replica: str) -> int:
    """Requests in the replica's running batch now, from its own metrics (vLLM's ``num_requests_running``)."""
    try:
        text = requests.get(f"{cluster.replica_urls[replica]}/metrics", timeout=1).text
    except requests.RequestException:
        return 0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _busiest_replica(cluster: ChaosCluster, region: str, wait_s: float = 5.0) -> tuple[str, int]:
    """The region's live replica with the most running requests (a kill mid-stream), and how many: looks again
    every 50 ms for up to ``wait_s`` until one streams."""
    alive = sorted(name.split(":", 1)[1] for name in cluster.running
                   if name.startswith(f"replica:{region}-"))
    deadline = time.monotonic() + wait_s
    while True:
        running = {rid: _running_now(cluster, rid) for rid in alive}
        best = max(alive, key=lambda rid: (running[rid], rid)) if alive else f"{region}-1"
        if running.get(best, 0) > 0 or time.monotonic() > deadline:
            return best, running.get(best, 0)
        time.sleep(0.05)


def inject(cluster: ChaosCluster, fault: Fault, now_s: float) -> None:
    """Break what ``fault`` names; records ``started_s`` (``now_s``) and, for kills, which process died."""
    kind = fault.kind
    fault.started_s = now_s
    if kind == "replica_kill":
        replica, running = _busiest_replica(cluster, fault.target)
        fault.notes["replica"], fault.notes["running_at_kill"] = replica, running
        cluster.kill(f"replica:{replica}")
    elif kind == "balancer_kill":
        cluster.kill(f"balancer:{fault.target}")
    elif kind == "leader_kill":
        leader = cluster.leader()
        fault.notes["controller"] = leader
        if leader is not None:
            cluster.kill(f"controller:{leader}")
    elif kind == "etcd_kill":
        cluster.kill(f"etcd:{fault.target}")
    elif kind == "redis_kill":
        cluster.kill("redis")
    elif kind in ("partition", "asymmetric", "split_brain"):
        cut(cluster, links_of(cluster, fault))
    elif kind == "latency_spike":
        _spike(cluster, fault.target, SPIKE)
    elif kind == "slow_replica":
        _replica_faults(cluster, fault.target, {"slowdown": SLOWDOWN})
    elif kind == "replica_500":
        _replica_faults(cluster, fault.target, {"error_status": 500})
    else:
        raise ValueError(f"unknown fault kind {kind!r}")


def heal(cluster: ChaosCluster, fault: Fault, now_s: float, clock) -> None:
    """Undo ``fault`` (restart what was killed, mend what was cut); records ``ended_s`` (``now_s``, when healing
    began) and ``healed_s`` (``clock()`` once the restarted process answers)."""
    kind = fault.kind
    fault.ended_s = now_s
    if kind == "replica_kill":
        cluster.launch(f"replica:{fault.notes['replica']}")
    elif kind == "balancer_kill":
        cluster.launch(f"balancer:{fault.target}")
    elif kind == "leader_kill":
        if fault.notes.get("controller") is not None:
            cluster.launch(f"controller:{fault.notes['controller']}")
    elif kind == "etcd_kill":
        cluster.launch(f"etcd:{fault.target}")
    elif kind == "redis_kill":
        cluster.launch("redis")
        _wait_redis(cluster.redis_port)
    elif kind in ("partition", "asymmetric", "split_brain"):
        mend(cluster, links_of(cluster, fault))
    elif kind == "latency_spike":
        _spike(cluster, fault.target, 1.0)
    elif kind == "slow_replica":
        _replica_faults(cluster, fault.target, {"slowdown": 1.0})
    elif kind == "replica_500":
        _replica_faults(cluster, fault.target, {"error_status": None})
    fault.healed_s = clock()


def run_schedule(cluster: ChaosCluster, faults: list[Fault], clock, stop_s: float,
                 abort: threading.Event | None = None) -> None:
    """Inject and heal ``faults`` at their planned times (``clock()``: s since the load began) until all are
    healed or ``stop_s``; blocking (run it in a thread). Faults still open at ``stop_s`` are healed then. Returns
    at once when ``abort`` is set (the run is being torn down: nothing may be restarted any more)."""
    abort = abort or threading.Event()
    events = sorted([(f.start_s, 0, i) for i, f in enumerate(faults)]
                    + [(f.start_s + f.duration_s, 1, i) for i, f in enumerate(faults)])
    for at, what, i in events:
        while clock() < min(at, stop_s):
            if abort.wait(0.05):
                return
        fault = faults[i]
        if what == 0:
            inject(cluster, fault, clock())
        elif fault.started_s is not None:
            heal(cluster, fault, clock(), clock)
