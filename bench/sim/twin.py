"""The live multi-region benchmark (bench/live/regions.py) replayed in the simulator, so both rankings can be set side by side.

Same workload (the very requests bench/replay/run.py sends: sessions, prompts, output lengths, start times, think
times), same replicas per region and batch size (``EngineParams(max_num_seqs=...)``, the emulator's model and
speeds), same round trips between regions, and the live balancer's defaults (bench/sim/systems.py). Each live
system maps to a simulated one:

* ``skylb`` -> SkyLB, ``skylb-ch`` -> SkyLB-CH, ``region-local`` -> RegionLocal (bench/sim/systems.py).
* ``round-robin`` and ``least-load`` -> one balancer per region pushing blindly to its own replicas. Live, a blind
  balancer always finds a healthy local replica, so it never forwards; GKE (per-region round robin) is that
  system for round robin, and ``LL-region`` below for least load.

Figures are computed the way bench/live/harness.py ``summarize`` computes the live ones: throughput = completed requests /
time of the last completion (the replay's wall time), TTFT and E2E percentiles in ms over every request, prefix hit
= cached / prompt tokens at the engines, forwarded = requests placed by a peer balancer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.replay.report import percentile
from bench.sim.cluster import Network
from bench.sim.systems import SYSTEMS, System, build
from bench.sim.workloads import replayed
from bench.replay.workload import Request
from bench.emulator.model import EngineParams

__all__ = ["TWIN_SYSTEMS", "simulate"]

#: live system name -> the simulated system that stands for it.
TWIN_SYSTEMS: dict[str, System] = {
    "skylb": SYSTEMS["SkyLB"],
    "skylb-ch": SYSTEMS["SkyLB-CH"],
    "round-robin": SYSTEMS["GKE"],
    "least-load": System("LL-region", "per-region balancer, least load, blind pushing, no spill-over", "per_region",
                         "least-load"),
    "region-local": SYSTEMS["RegionLocal"],
}
#: Round trip within a region (client -> balancer -> replica on one machine's loopback), ms.
LOCAL_RTT_MS = 0.5


def simulate(requests: Sequence[Request], *, systems: Sequence[str], replicas_per_region: Mapping[str, int],
             max_num_seqs: int, time_scale: float, rtt_ms: Mapping[str, float], seed: int = 0,
             stop_at: float = 3600.0) -> dict[str, dict[str, Any]]:
    """Simulate each of ``systems`` (keys of :data:`TWIN_SYSTEMS`) on ``requests``; returns name -> figures.

    ``rtt_ms``: round trips keyed "a-b" as in the config's ``latency.rtt_ms``. Figures: ``{"sim_system",
    "completed", "throughput_rps", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "e2e_p90_ms", "prefix_hit_rate",
    "forwarded_frac", "region_ttft_p90_ms": {region: ms}}``. Raises KeyError for an unknown system name and
    RuntimeError if a request never completes (it cannot: the workload is finite and ``stop_at`` far away).
    """
    pairs = {tuple(key.split("-", 1)): ms for key, ms in rtt_ms.items()}
    network = Network(rtt_ms=pairs, local_rtt_ms=LOCAL_RTT_MS)
    params = EngineParams(max_num_seqs=max_num_seqs, time_scale=time_scale)
    out = {}
    for name in systems:
        system = TWIN_SYSTEMS[name]
        workload = replayed(requests, name="live-twin")
        cluster = build(system, workload, dict(replicas_per_region), seed=seed, stop_at=stop_at, network=network,
                        params=params).run()
        out[name] = _figures(cluster.records, system.key)
    return out


def _figures(records, sim_system: str) -> dict[str, Any]:
    ttft = [1000 * (f.first_token_at - f.sent_at) for f in records]
    e2e = [1000 * (f.done_at - f.sent_at) for f in records]
    prompt = sum(f.result.prompt_tokens for f in records)
    cached = sum(f.result.cached_tokens for f in records)
    end = max((f.done_at for f in records), default=0.0)
    by_region: dict[str, list[float]] = {}
    for f, t in zip(records, ttft):
        by_region.setdefault(f.region, []).append(t)
    n = len(records)
    return {
        "sim_system": sim_system, "completed": n, "throughput_rps": n / end if end else None,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
        "e2e_p50_ms": percentile(e2e, 50), "e2e_p90_ms": percentile(e2e, 90),
        "prefix_hit_rate": cached / prompt if prompt else None,
        "forwarded_frac": sum(f.forwarded for f in records) / n if n else None,
        "region_ttft_p90_ms": {r: percentile(v, 90) for r, v in by_region.items()},
    }
