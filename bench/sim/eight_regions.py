"""Eight regions at scale: 200 replicas of three GPU classes and a follow-the-sun day of the real Mooncake trace.

Source: SkyLB paper §2.2 (regions peak at different hours, so region-local deployments are provisioned for their own
peaks), §3.1 (one balancer per region against one global balancer) and §5.2 (Fig. 10: SkyLB needs fewer replicas
than a region-local deployment for the same service). Pieces:

* Regions, round trips: bench/sim/geo.py (8 AWS regions, haversine distance, rtt = 2 d / 200 km/ms x 1.5).
* Replicas: bench/sim/gpus.py (L4, A10, A100 engine timings from bandwidth, FLOPS and memory). :data:`FULL` puts
  the same mix in every region, 12 L4 + 8 A10 + 5 A100 = 25, so 200 replicas: a region-local deployment
  provisioned equally for equal regional peaks. Scaled fleets (:func:`scaled_mix`) keep that mix per region.
* Load: bench/sim/follow_the_sun.py (the trace's hour re-timed into one day per region, peak at 14:00 local).
* Systems (:data:`SYSTEMS`): SkyLB, SkyLB-CH, region-local (SkyLB's policy, no forwarding), SGL and LL (one
  balancer in :data:`HOME` in front of all replicas; clients elsewhere cross the network to it and back), and an
  oracle (one scheduler running SkyLB's policy with a fresh view of every replica and a free network). Each is the
  same configuration of the routing core as in bench/sim/systems.py, only placed on these regions.

Units: simulated seconds; round trips in ms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from bench.emulator.model import EngineModel, EngineParams
from bench.sim.cluster import BalancerSetup, Cluster, Network
from bench.sim.follow_the_sun import follow_the_sun, rate, local_hour, start_utc_h
from bench.sim.geo import REGIONS, rtt_matrix
from bench.sim.gpus import GPU_CLASSES, engine_params
from bench.sim.systems import SYSTEMS as BASE_SYSTEMS, System, settings_for
from bench.sim.workloads import Workload

__all__ = ["DaySetup", "FULL", "QUICK", "HOME", "SYSTEMS", "scaled_mix", "fleet", "build_cluster", "workload",
           "saturation_rps", "in_peak", "START_H", "REGION_NAMES"]

#: Where the single global balancers (SGL, LL) run: the first region of the paper's single-balancer baselines, US.
HOME = "us-east-1"
REGION_NAMES = tuple(r.name for r in REGIONS)
#: The UTC hour where the simulated day starts (bench/sim/follow_the_sun.py ``start_utc_h``).
START_H = start_utc_h(REGIONS)


@dataclass(frozen=True)
class DaySetup:
    """One variant of the scenario.

    ``mix``: replicas per region by GPU class; ``trace_s``: seconds of the trace (from its start) that make the
    day's requests; ``day_s``: the simulated day; ``warmup_s``: requests sent before it are not measured.
    """

    name: str
    mix: tuple[tuple[str, int], ...]
    trace_s: float
    day_s: float
    warmup_s: float

    @property
    def per_region(self) -> int:
        """Replicas per region."""
        return sum(n for _, n in self.mix)


#: 200 replicas; the whole trace (12,031 requests) in an 80 s day: 150 requests/s on average.
FULL = DaySetup("eight-regions", (("L4", 12), ("A10", 8), ("A100", 5)), trace_s=3600.0, day_s=80.0,
                warmup_s=4.0)
#: 24 replicas (one of each class per region); the trace's first 300 s (918 requests) in a 60 s day.
QUICK = DaySetup("eight-regions-quick", (("L4", 1), ("A10", 1), ("A100", 1)), trace_s=300.0, day_s=60.0,
                 warmup_s=3.0)

SYSTEMS: dict[str, System] = {s.key: s for s in (
    BASE_SYSTEMS["SkyLB"],
    BASE_SYSTEMS["SkyLB-CH"],
    BASE_SYSTEMS["RegionLocal"],
    replace(BASE_SYSTEMS["SGL"], home=HOME, label=f"single balancer ({HOME}), SGLang cache_aware, blind pushing"),
    replace(BASE_SYSTEMS["LL"], home=HOME, label=f"single balancer ({HOME}), least load, blind pushing"),
    System("Oracle", "one scheduler, SkyLB's policy, fresh view of every replica, zero network latency",
           "global", "skylb"),
)}


def scaled_mix(mix: tuple[tuple[str, int], ...], per_region: int) -> dict[str, int]:
    """``per_region`` replicas split over the classes of ``mix`` in its proportions (largest remainder)."""
    total = sum(n for _, n in mix)
    exact = [(cls, per_region * n / total) for cls, n in mix]
    counts = {cls: int(x) for cls, x in exact}
    left = per_region - sum(counts.values())
    for cls, x in sorted(exact, key=lambda p: p[1] - int(p[1]), reverse=True)[:left]:
        counts[cls] += 1
    return counts


def fleet(mix: Mapping[str, int], regions=REGION_NAMES) -> dict[str, tuple[str, str]]:
    """Replica id -> (region, GPU class): ``mix`` (class -> count) in every region; ids like "us-east-1-a10-3"."""
    return {f"{region}-{cls.lower()}-{i}": (region, cls) for region in regions for cls, n in mix.items()
            for i in range(n)}


def workload(setup: DaySetup, *, seed: int, trace: str | Path) -> Workload:
    """The follow-the-sun day of ``setup`` (bench/sim/follow_the_sun.py)."""
    return follow_the_sun(seed=seed, trace=trace, trace_s=setup.trace_s, day_s=setup.day_s)


def build_cluster(system: System, wl: Workload, replicas: Mapping[str, tuple[str, str]], *, seed: int,
                  stop_at: float) -> Cluster:
    """The Cluster of ``system`` over ``replicas`` (id -> (region, GPU class)), each replica's engine built from
    its class (bench/sim/gpus.py); layouts as bench/sim/systems.py ``build``."""
    where = {rid: region for rid, (region, _) in replicas.items()}
    settings = settings_for(system.policy)
    network = Network(rtt_ms=rtt_matrix())
    if system.layout == "single":
        setups = [BalancerSetup(system.home, tuple(where), settings)]
        entry = {r: system.home for r in REGION_NAMES}
    elif system.layout == "per_region":
        setups = [BalancerSetup(region, tuple(rid for rid, reg in where.items() if reg == region), settings,
                                forwarding=system.forwarding) for region in REGION_NAMES]
        entry = {r: r for r in REGION_NAMES}
    elif system.layout == "global":
        setups = [BalancerSetup("global", tuple(where), settings_for(
            system.policy, stale_after_intervals=float("inf"), max_dispatch_per_probe=1), fresh_view=True)]
        entry = {r: "global" for r in REGION_NAMES}
        network = Network(scale=0.0)
    else:
        raise ValueError(f"unknown layout {system.layout!r}")
    cluster = Cluster(workload=wl, replicas=where, balancers=setups, entry=entry, network=network, seed=seed,
                      stop_at=stop_at, probe_interval_s=settings.probe_interval_ms / 1000)
    params = {name: engine_params(gpu) for name, gpu in GPU_CLASSES.items()}
    for rid, (_, cls) in replicas.items():
        cluster.replicas[rid].engine = EngineModel(params[cls])  # before run(): nothing has touched it yet
    return cluster


def saturation_rps(params: EngineParams, wl: Workload, *, n: int = 300) -> float:
    """Requests/s one replica of ``params`` completes with a backlog: the first ``n`` requests one region sends
    (``wl``'s first region, in send order, so later turns of a session find its prefix cached) all submitted at
    time 0, run until the last finishes (the drain at the end included, so slightly low)."""
    engine = EngineModel(params)
    region = wl.arrivals[0].region
    reqs = [r for r in wl.arrivals if r.region == region][:n]
    for r in reqs:
        engine.submit(r.id, r.tokens, r.output_tokens, ignore_eos=True, now=0.0)
    now = 0.0
    while (step := engine.start_step(now)) is not None:
        engine.complete_step(step)
        now = step.end
    return len(reqs) / now if now > 0 else float("nan")


def in_peak(region: str, t_s: float, setup: DaySetup, *, level: float = 0.5) -> bool:
    """True when ``region``'s rate at simulated time ``t_s`` is at least ``level`` of its peak (its busy hours)."""
    r = next(x for x in REGIONS if x.name == region)
    return rate(local_hour(r, t_s, setup.day_s, START_H)) >= level
