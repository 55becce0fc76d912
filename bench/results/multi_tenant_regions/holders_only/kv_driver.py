"""One system of bench.sim.kv_routing's deployment (3 regions x 4 vLLM-model replicas, 8192 KV tokens each, the
multi-tenant workload), with its forwards audited as kv_routing audits them.

``PYTHONPATH=. python kv_driver.py SEED SYSTEM LOADS ABROAD`` (e.g. ``0 SkyLB-KV 1.5,2 0.3``), run from a checkout
with holders_only_exact.diff applied (``XP_HO=1`` for forwarding only to holding regions, ``XP_HO_EXACT=1`` to count
a region as holding only by its KV-block summary). Prints, per load, P90 / P50 TTFT (s), throughput (req/s, output
tok/s), hit rate, the KV-bounded ideal, the forwarded share and, of the forwards whose prompt a peer's region held,
how many went to a holding region. ``TAG`` labels the line.
"""
import sys, os
from bench.emulator.model import EngineParams
from bench.sim.matrix import EVEN, ONE_X_UTILISATION, TIMES, saturated_rps
from bench.sim.systems import KV_SYSTEMS, SYSTEMS, build, replica_layout
from bench.sim.workloads_extra import multi_tenant
from bench.sim.metrics import summarize
params = EngineParams(admission="vllm", kv_cache_tokens=8192)
counts = dict(EVEN)
sample = multi_tenant(seed=0, rate_rps=1.0, duration_s=400.0).arrivals[:300]
one_x = ONE_X_UTILISATION * saturated_rps(params, sample) * len(replica_layout(counts))
stop_at, warmup = TIMES["open"]
seed = int(sys.argv[1]); key = sys.argv[2]; abroad = float(sys.argv[4])
for load in [float(x) for x in sys.argv[3].split(",")]:
    wl = multi_tenant(seed=seed, rate_rps=one_x * load, duration_s=stop_at, abroad=abroad)
    system = KV_SYSTEMS.get(key) or SYSTEMS[key]
    cluster = build(system, wl, counts, seed=seed, stop_at=stop_at, params=params)
    cluster.audit_forwards = True
    cluster.run()
    kept = [a for a in cluster.forward_audit if a[0] >= warmup]
    held = sum(a[1] for a in kept); toh = sum(a[1] and a[2] for a in kept)
    s = summarize(cluster, scenario=f"mt@{load}", system=key, layout=system.layout, warmup_s=warmup, seed=seed,
                  wall_s=0)
    print(f"{os.environ.get('TAG', '-')} s{seed} {load}x ab{abroad} {key}: p90 {s.ttft_p90:.2f} p50 {s.ttft_p50:.2f} "
          f"thr {s.throughput_rps:.2f} tps {s.throughput_tps:.0f} hit {s.hit_rate:.3f} ideal {s.ideal_kv_hit_rate:.3f} "
          f"fwd {s.forwarded_frac:.3f} toholder {toh}/{held}={toh/max(held,1):.2f}", flush=True)
