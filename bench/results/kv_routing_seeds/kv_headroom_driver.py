"""Driver of the kv_headroom.diff runs (bench/results/kv_routing.md).

``python bench/results/kv_routing_seeds/kv_headroom_driver.py SEED SYSTEM LOADS`` (e.g. ``0 SkyLB-KV 1,1.5``), with
the diff applied and XP_KVPLACE=1 for the variant; prints P90 TTFT, output tok/s, hit rate, the KV-bounded ideal,
effective replicas per tenant and running requests per region.
"""
import sys, os
from bench.emulator.model import EngineParams
from bench.sim.matrix import EVEN, ONE_X_UTILISATION, TIMES, saturated_rps
from bench.sim.systems import KV_SYSTEMS, SYSTEMS, build, replica_layout
from bench.sim.workloads_extra import multi_tenant
from bench.sim.ttft_parts import spread
from bench.sim.metrics import summarize
params = EngineParams(admission="vllm", kv_cache_tokens=8192)
counts = dict(EVEN)
sample = multi_tenant(seed=0, rate_rps=1.0, duration_s=400.0).arrivals[:300]
one_x = ONE_X_UTILISATION * saturated_rps(params, sample) * len(replica_layout(counts))
stop_at, warmup = TIMES["open"]
seed = int(sys.argv[1]); key = sys.argv[2]
for load in [float(x) for x in sys.argv[3].split(",")]:
    wl = multi_tenant(seed=seed, rate_rps=one_x * load, duration_s=stop_at)
    system = KV_SYSTEMS.get(key) or SYSTEMS[key]
    cluster = build(system, wl, counts, seed=seed, stop_at=stop_at, params=params).run()
    s = summarize(cluster, scenario=f"mt@{load}", system=key, layout=system.layout, warmup_s=warmup, seed=seed,
                  wall_s=0)
    g = spread(cluster, warmup, stop_at)
    print(f"{os.environ.get('TAG', '')} s{seed} {load}x {key}: p90 {s.ttft_p90:.2f} tps {s.throughput_tps:.0f} "
          f"hit {s.hit_rate:.3f} ideal {s.ideal_kv_hit_rate:.3f} eff {g['groups']['effective']:.2f} run",
          {r: round(e['running'], 1) for r, e in g['engines'].items()})
