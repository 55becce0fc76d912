"""A/B runs of simulated systems with policy options, for choosing defaults: one line per (scenario, system, seed).

``python -m bench.sim.ab SCENARIOS SYSTEMS SEEDS [JOBS]``: comma-separated scenario names (bench/sim/scenarios.py),
systems separated by ';', each a key of bench/sim/systems.py SYSTEMS optionally followed by ``+option=value`` (an
option of the system's policy) or ``+cfg.setting=value`` (a balancer setting, skylb/config.py), e.g.
``'SkyLB;SkyLB+placement="predicted-ttft"'``. ``TRACE=path`` replays another Mooncake-format trace in the trace
scenarios. Prints P90/P50 TTFT (s), throughput (req/s), prefix hit rate, mean balancer queue, mean pending per
replica, forwarded share and the run's wall time (s).
"""

import sys, os, time, ast
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from bench.sim.scenarios import SCENARIOS
from bench.sim.systems import SYSTEMS, build
from bench.sim.regime import engine_params
from bench.sim.metrics import summarize
from skylb.config import BalancerConfig

def one(args):
    sc_name, sysname, seed = args
    key, *opts = sysname.split("+")
    system = SYSTEMS[key]
    sc = SCENARIOS[sc_name]
    wl = sc.make_workload(seed, trace=os.environ.get("TRACE"))
    o = {k: ast.literal_eval(v) for k, v in (x.split("=") for x in opts)}
    top = {k[4:]: o.pop(k) for k in list(o) if k.startswith("cfg.")}
    base = BalancerConfig.model_validate(BalancerConfig().model_dump() | top | {"policies": {system.policy: o}}) if (o or top) else None
    t = time.perf_counter()
    cl = build(system, wl, dict(sc.deployments[0]), seed=seed, stop_at=sc.stop_at, params=engine_params(), settings=base).run()
    return summarize(cl, scenario=sc_name, system=sysname, layout=system.layout, warmup_s=sc.warmup_s, seed=seed, wall_s=time.perf_counter() - t)

def main():
    scs, systems, seeds = sys.argv[1].split(","), sys.argv[2].split(";"), [int(s) for s in sys.argv[3].split(",")]
    jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    specs = [(sc, s, seed) for sc in scs for s in systems for seed in seeds]
    with ProcessPoolExecutor(jobs) as ex:
        for (sc, s, seed), r in zip(specs, ex.map(one, specs)):
            print(f"{sc:12s} {s:44s} s{seed} p90={r.ttft_p90:6.2f} p50={r.ttft_p50:5.2f} "
                  f"thr={r.throughput_rps:6.2f} hit={r.hit_rate*100:5.1f}% q={r.queue_mean:5.2f} pend={r.pending_mean:4.2f} "
                  f"fwd={r.forwarded_frac*100:4.1f}% wall={r.wall_s:4.1f}", flush=True)

if __name__ == "__main__":
    main()
