"""A/B runs of simulated systems with policy options, for choosing defaults: one line per (scenario, system, seed).

``python -m bench.sim.ab SCENARIOS SYSTEMS SEEDS [JOBS]``: comma-separated scenario names (bench/sim/scenarios.py),
systems separated by ';', each a key of bench/sim/systems.py SYSTEMS optionally followed by ``+option=value`` (an
option of the system's policy, a Python literal) or ``+cfg.setting=value`` (a balancer setting, skylb/config.py),
e.g. ``'SkyLB;SkyLB+placement="predicted-ttft"'``. ``TRACE=path`` replays another Mooncake-format trace in the
trace scenarios. A scenario may also be a robustness-matrix cell ("multi_tenant@2x"; ``SPLIT=val`` for the
validation split's trace windows; ``COUNTS=us=2,eu=4,asia=6`` for other replicas per region, bench/sim/matrix.py
``parse_counts``). ``RTT_SCALE=3`` multiplies every round trip between regions (bench/sim/cluster.py
``DEFAULT_RTT_MS``). ``SCHEDULE=fcfs`` (or ``lpm``) runs every engine's waiting queue in that order instead of the
calibrated regime's (``EngineParams.schedule_policy``; as ``skylb bench matrix --schedule-policy``). Each line gives
P90 and P50 TTFT (s), throughput (req/s), prefix hit rate, mean requests queued at the balancers, mean pending
requests per replica, forwarded share and the run's wall time (s).

``python -m bench.sim.ab --table FILE...``: a Markdown table of such lines (each optionally prefixed by a label
word, e.g. ``VAL``), one row per (label, scenario, system): mean [min, max] over the seeds of P90 TTFT, throughput,
hit rate and forwarded share.
"""

from __future__ import annotations

import ast
import os
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

__all__ = ["run_one", "run_cluster", "parse_line", "table", "main"]

LINE = re.compile(r"^(?P<label>(?:[A-Z]+ )*)(?P<scenario>\S+)\s+(?P<system>\S+)\s+s(?P<seed>\d+) p90=\s*(?P<p90>[\d.]+) "
                  r"p50=\s*(?P<p50>[\d.]+) thr=\s*(?P<thr>[\d.]+) hit=\s*(?P<hit>[\d.]+)% .*fwd=\s*(?P<fwd>[\d.]+)%")


def run_one(args: tuple[str, str, int]):
    """Run (scenario, system spec, seed) to completion; returns its bench.sim.metrics.RunSummary. A scenario named
    like a robustness-matrix cell ("multi_tenant@2x", bench/sim/matrix.py) runs that cell: its workload, load,
    replicas and times, trace windows of the split in ``SPLIT`` (dev or val, default dev)."""
    return run_cluster(args)[1]


def run_cluster(args: tuple[str, str, int]):
    """``run_one``, returning (the finished bench.sim.cluster.Cluster, its RunSummary, the measurement window's
    start s): the cluster's ``records`` hold every request's flight (its decisions, times and result)."""
    from bench.sim.metrics import summarize
    from bench.sim.regime import engine_params
    from bench.sim.systems import SYSTEMS, build
    from skylb.config import BalancerConfig
    sc_name, spec, seed = args
    key, *opts = spec.split("+")
    system = SYSTEMS[key]
    options = {k: ast.literal_eval(v) for k, v in (x.split("=", 1) for x in opts)}
    top = {k[4:]: options.pop(k) for k in list(options) if k.startswith("cfg.")}
    base = (BalancerConfig.model_validate(BalancerConfig().model_dump() | top | {"policies": {system.policy: options}})
            if options or top else None)
    params = engine_params()
    if os.environ.get("SCHEDULE"):  # EngineParams refuses an unknown order with a ValueError naming it
        params = replace(params, schedule_policy=os.environ["SCHEDULE"])
    if "@" in sc_name:
        from bench.sim.matrix import TIMES, WORKLOADS, deployed, parse_cell, parse_counts, trace_window
        name, load = parse_cell(sc_name)
        wl = deployed(WORKLOADS[name], parse_counts(os.environ["COUNTS"]) if os.environ.get("COUNTS") else None)
        stop_at, warmup_s = TIMES[wl.kind]
        workload = wl.make(seed, load, trace_window(os.environ.get("SPLIT", "dev"), seed), stop_at)
        counts, extra = dict(wl.counts), {"replica_params": wl.replica_params(params)}
    else:
        from bench.sim.scenarios import SCENARIOS
        sc = SCENARIOS[sc_name]
        workload, stop_at, warmup_s = sc.make_workload(seed, trace=os.environ.get("TRACE")), sc.stop_at, sc.warmup_s
        counts, extra = dict(sc.deployments[0]), {}
    if os.environ.get("RTT_SCALE"):  # every round trip between regions x this (within a region: unchanged)
        from bench.sim.cluster import farther
        extra["network"] = farther(float(os.environ["RTT_SCALE"]))
    t0 = time.perf_counter()
    cluster = build(system, workload, counts, seed=seed, stop_at=stop_at, params=params, settings=base, **extra).run()
    return cluster, summarize(cluster, scenario=sc_name, system=spec, layout=system.layout, warmup_s=warmup_s,
                              seed=seed, wall_s=time.perf_counter() - t0), warmup_s


def parse_line(line: str) -> dict | None:
    """One output line as {label, scenario, system, seed, p90, p50, thr, hit, fwd}, or None for another line."""
    m = LINE.match(line.strip())
    if m is None:
        return None
    d = m.groupdict()
    return {"label": d["label"].strip(), "scenario": d["scenario"], "system": d["system"], "seed": int(d["seed"]),
            **{k: float(d[k]) for k in ("p90", "p50", "thr", "hit", "fwd")}}


def table(lines: list[str]) -> str:
    """The Markdown table of ``lines`` (module docstring)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for line in lines:
        row = parse_line(line)
        if row is not None:
            groups.setdefault((row["label"], row["scenario"], row["system"]), []).append(row)

    def spread(rows: list[dict], key: str, fmt: str) -> str:
        values = [r[key] for r in rows]
        return f"{fmt.format(statistics.fmean(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"

    out = ["| split | scenario | system | seeds | P90 TTFT s | throughput req/s | hit rate % | forwarded % |",
           "|---|---|---|---|---|---|---|---|"]
    for (label, scenario, system), rows in groups.items():
        seeds = ",".join(str(r["seed"]) for r in rows)
        out.append(f"| {label or '-'} | {scenario} | {system} | {seeds} | {spread(rows, 'p90', '{:.2f}')} | "
                   f"{spread(rows, 'thr', '{:.2f}')} | {spread(rows, 'hit', '{:.1f}')} | "
                   f"{spread(rows, 'fwd', '{:.1f}')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the A/B (or print the table of ``--table`` files); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--table":
        lines = [line for path in argv[1:] for line in open(path, encoding="utf-8")]
        print(table(lines))
        return 0
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    scenarios, systems, seeds = argv[0].split(","), argv[1].split(";"), [int(s) for s in argv[2].split(",")]
    jobs = int(argv[3]) if len(argv) > 3 else 2
    specs = [(sc, s, seed) for sc in scenarios for s in systems for seed in seeds]
    with ProcessPoolExecutor(jobs) as ex:
        for (sc, s, seed), r in zip(specs, ex.map(run_one, specs)):
            print(f"{sc:12s} {s:44s} s{seed} p90={r.ttft_p90:6.2f} p50={r.ttft_p50:5.2f} "
                  f"thr={r.throughput_rps:6.2f} hit={r.hit_rate * 100:5.1f}% q={r.queue_mean:5.2f} "
                  f"pend={r.pending_mean:4.2f} fwd={r.forwarded_frac * 100:4.1f}% wall={r.wall_s:4.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
