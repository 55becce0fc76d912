"""Eight regions at scale, simulated: SkyLB against region-local, single global balancers and an oracle on 200
replicas of three GPU classes, under a follow-the-sun day of the real Mooncake trace (bench/sim/eight_regions.py).

Entry point: ``.venv/bin/python -m bench.sim.eight_regions_bench [--quick] [--seeds 0,1,2] [--systems ...] [--no-bisect]
[--jobs N] [--trace PATH] [--out-md PATH] [--out-json PATH]`` (also ``skylb bench eight_regions ...``);
:func:`main` ``(argv) -> int``.

Figures, per system, mean over seeds with [min, max]: P50 / P90 TTFT (requests sent after the warm-up), throughput
(completions per simulated second inside [warm-up, end of day)), the share served outside the client's region, the
share forwarded by a peer balancer, the requests waiting (balancer queue + engine queues) in a region during its
own busy hours (rate >= half its peak) and the wall time of the run. Then the replicas SkyLB needs to match
region-local's P90 TTFT: per seed, a bisection of at most :data:`BISECT_STEPS` SkyLB runs over replicas per region
in (:data:`BISECT_LOW` x 25, 25], each region's classes scaled in proportion (bench/sim/eight_regions.py
``scaled_mix``); a run matches when its P90 TTFT is at most region-local's with 200 replicas on the same seed.
Offered load against capacity: each class's saturation throughput on the day's requests (one replica, a backlog of
300 requests), summed over the fleet.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.replay.report import markdown_table
from bench.sim.eight_regions import (FULL, QUICK, SYSTEMS, DaySetup, build_cluster, fleet, in_peak, scaled_mix,
                                     workload)
from bench.sim.metrics import summarize
from bench.sim.workloads import DEFAULT_TRACE

__all__ = ["run_one", "bisect_replicas", "run_all", "render", "main", "BISECT_STEPS", "BISECT_LOW", "find_trace"]

BISECT_STEPS = 5
#: The bisection looks above this share of the full fleet (assumed too few; never run): 10 of 25 per region.
BISECT_LOW = 0.4
RESULTS = Path(__file__).resolve().parents[1] / "results"
#: Figures of a run kept in the report and JSON (bench/sim/metrics.py RunSummary fields).
FIGURES = ("ttft_p50", "ttft_p90", "e2e_p90", "throughput_rps", "remote_frac", "forwarded_frac", "hit_rate",
           "queue_mean", "pending_mean", "sent", "completed")


def find_trace(path: str | None = None) -> Path:
    """The trace to replay: ``path``, else $SKYLB_TRACE, else the workspace's real Mooncake trace."""
    return Path(path or os.environ.get("SKYLB_TRACE") or DEFAULT_TRACE)


@functools.lru_cache(maxsize=4)
def _workload(setup: DaySetup, seed: int, trace: str):
    return workload(setup, seed=seed, trace=trace)


def _peak_wait(cluster, setup: DaySetup) -> float:
    """Mean over regions of the requests waiting in a region (its balancer's queue, when it has one, plus its
    replicas' engine queues) over the samples taken in that region's busy hours."""
    regions = sorted({r.region for r in cluster.replicas.values()})
    balancers = list(cluster.balancers)
    reps = [r.region for r in cluster.replicas.values()]
    per_region = []
    for region in regions:
        values = [sum(p for p, where in zip(s[2], reps) if where == region)
                  + (s[3][balancers.index(region)] if region in balancers else 0)
                  for s in cluster.samples if s[0] >= setup.warmup_s and in_peak(region, s[0], setup)]
        if values:
            per_region.append(statistics.fmean(values))
    return statistics.fmean(per_region) if per_region else 0.0


def run_one(setup: DaySetup, system: str, seed: int, trace: str, per_region: int | None = None) -> dict:
    """One simulation: ``system`` on ``setup``'s fleet (or ``per_region`` replicas per region in the same mix);
    returns the figures of :data:`FIGURES` plus busy-hour figures, run time (s) and event count."""
    t0, c0 = time.perf_counter(), time.process_time()
    wl = _workload(setup, seed, trace)
    mix = scaled_mix(setup.mix, per_region) if per_region else dict(setup.mix)
    cluster = build_cluster(SYSTEMS[system], wl, fleet(mix), seed=seed, stop_at=setup.day_s).run()
    s = summarize(cluster, scenario=setup.name, system=system, layout=SYSTEMS[system].layout,
                  warmup_s=setup.warmup_s, seed=seed)
    measured = [f for f in cluster.records if f.sent_at >= setup.warmup_s]
    in_busy = [f for f in measured if in_peak(f.region, f.sent_at, setup)]
    out = {k: getattr(s, k) for k in FIGURES}
    out.update(system=system, seed=seed, replicas=len(cluster.replicas), mix=mix,
               forwarded_in_own_peak=sum(f.forwarded for f in in_busy),
               remote_in_own_peak=sum(f.replica.region != f.region for f in in_busy) / max(len(in_busy), 1),
               remote_off_peak=sum(f.replica.region != f.region for f in measured if f not in in_busy)
               / max(len(measured) - len(in_busy), 1),
               peak_wait=_peak_wait(cluster, setup), events=cluster.loop.events, wall_s=time.perf_counter() - t0,
               cpu_s=time.process_time() - c0)
    return out


def bisect_replicas(setup: DaySetup, seed: int, trace: str, target_p90: float, top_p90: float) -> dict:
    """The fewest replicas per region at which SkyLB's P90 TTFT is at most ``target_p90`` (region-local's), by
    bisection over (BISECT_LOW x per_region, per_region] in at most BISECT_STEPS runs; ``top_p90``: SkyLB's P90
    at the full fleet (already run). Returns {"per_region", "replicas", "steps": [(per_region, p90)],
    "resolved"}; per_region None when even the full fleet does not match."""
    if top_p90 > target_p90:
        return {"per_region": None, "replicas": None, "steps": []}
    lo, hi, steps = int(BISECT_LOW * setup.per_region), setup.per_region, []
    while hi - lo > 1 and len(steps) < BISECT_STEPS:
        mid = (lo + hi) // 2
        p90 = run_one(setup, "SkyLB", seed, trace, per_region=mid)["ttft_p90"]
        steps.append((mid, p90))
        lo, hi = (lo, mid) if p90 <= target_p90 else (mid, hi)
    return {"per_region": hi, "replicas": hi * 8, "steps": steps, "resolved": hi - lo <= 1}


def _pool_map(fn, tasks: list[tuple], jobs: int) -> list:
    if jobs <= 1:
        return [fn(*t) for t in tasks]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, *zip(*tasks)))


def run_all(setup: DaySetup, *, systems: list[str], seeds: list[int], trace: str, jobs: int,
            bisect: bool) -> dict:
    """Every (system, seed) run, then per seed the bisection (needs SkyLB and RegionLocal); wall times in s."""
    t0 = time.perf_counter()
    runs = _pool_map(run_one, [(setup, sys_, seed, trace) for seed in seeds for sys_ in systems], jobs)
    scenario_wall = time.perf_counter() - t0
    bisections = []
    if bisect and {"SkyLB", "RegionLocal"} <= set(systems):
        by = {(r["system"], r["seed"]): r for r in runs}
        tasks = [(setup, seed, trace, by[("RegionLocal", seed)]["ttft_p90"], by[("SkyLB", seed)]["ttft_p90"])
                 for seed in seeds]
        bisections = _pool_map(bisect_replicas, tasks, jobs)
        for seed, b in zip(seeds, bisections):
            b["seed"] = seed
    return {"runs": runs, "bisections": bisections, "scenario_wall_s": scenario_wall,
            "total_wall_s": time.perf_counter() - t0}


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.strip()
    return out or "unknown"


def _stat(values: list[float], fmt: str) -> str:
    """``values`` as "mean [min, max]" (just the value for one)."""
    if not values:
        return "-"
    text = fmt.format(statistics.fmean(values))
    return text if len(values) == 1 else f"{text} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def _means(runs: list[dict], system: str, key: str) -> list[float]:
    return [r[key] for r in runs if r["system"] == system]


def load_figures(setup: DaySetup, trace: str) -> dict:
    """Offered load against capacity: class saturation throughputs (req/s per replica, on seed 0's requests),
    fleet capacity, the day's mean offered rate, each region's peak rate (its requests / (0.4375 x day), the curve's
    peak over its mean) and the resulting utilisations."""
    from bench.sim.eight_regions import saturation_rps
    from bench.sim.follow_the_sun import FLOOR
    from bench.sim.gpus import GPU_CLASSES, engine_params
    wl = _workload(setup, 0, trace)
    per_class = {n: saturation_rps(engine_params(g), wl) for n, g in GPU_CLASSES.items()}
    region_cap = sum(per_class[c] * n for c, n in setup.mix)
    offered = len(wl.arrivals) / setup.day_s
    counts: dict[str, int] = {}
    for r in wl.arrivals:
        counts[r.region] = counts.get(r.region, 0) + 1
    mean_share = FLOOR + (1 - FLOOR) * 3 / 8
    peak = max(counts.values()) / (mean_share * setup.day_s)
    return {"per_class_rps": per_class, "region_capacity_rps": region_cap,
            "fleet_capacity_rps": region_cap * len(counts), "offered_rps": offered,
            "mean_utilisation": offered / (region_cap * len(counts)), "peak_region_rps": peak,
            "peak_region_utilisation": peak / region_cap}


def _system_rows(runs: list[dict], systems: list[str]) -> list[list[str]]:
    rows = []
    for name in systems:
        col = functools.partial(_means, runs, name)
        rows.append([name, _stat(col("ttft_p50"), "{:.2f}"), _stat(col("ttft_p90"), "{:.2f}"),
                     _stat(col("e2e_p90"), "{:.1f}"), _stat(col("throughput_rps"), "{:.1f}"),
                     _stat([100 * v for v in col("remote_frac")], "{:.1f}"),
                     _stat([100 * v for v in col("remote_in_own_peak")], "{:.1f}"),
                     _stat([100 * v for v in col("forwarded_frac")], "{:.1f}"),
                     _stat(col("peak_wait"), "{:.1f}"), _stat([100 * v for v in col("hit_rate")], "{:.1f}"),
                     _stat(col("wall_s"), "{:.0f}"), _stat(col("cpu_s"), "{:.0f}")])
    return rows


def acceptance(result: dict) -> list[tuple[str, str, bool | None]]:
    """(claim, measured, met) lines on the means over seeds; met None when a run needed is missing."""
    runs = result["runs"]
    p90 = {s: statistics.fmean(_means(runs, s, "ttft_p90")) for s in {r["system"] for r in runs}}
    out: list[tuple[str, str, bool | None]] = []
    if "SkyLB" in p90 and "RegionLocal" in p90:
        ratio = p90["SkyLB"] / p90["RegionLocal"]
        out.append(("SkyLB P90 TTFT <= 0.5x region-local's", f"{ratio:.2f}x ({p90['SkyLB']:.2f} s vs "
                    f"{p90['RegionLocal']:.2f} s)", ratio <= 0.5))
    singles = [s for s in ("SGL", "LL") if s in p90]
    if "SkyLB" in p90 and singles:
        best = min(singles, key=p90.get)
        ratio = p90["SkyLB"] / p90[best]
        out.append(("SkyLB P90 TTFT <= 0.75x the best global balancer's", f"{ratio:.2f}x ({p90['SkyLB']:.2f} s "
                    f"vs {best} {p90[best]:.2f} s)", ratio <= 0.75))
    needed = [b["replicas"] for b in result["bisections"]]
    if needed:
        full = runs[0]["replicas"]
        known = [n for n in needed if n is not None]
        text = (f"{_stat([float(n) for n in known], '{:.0f}')} of {full} ({', '.join(str(n) for n in needed)} "
                f"by seed)" if known else f"SkyLB does not match region-local even with {full}")
        met = bool(known) and len(known) == len(needed) and statistics.fmean(known) <= 0.75 * full
        out.append(("SkyLB matches region-local's P90 TTFT with >= 25% fewer replicas (paper §5.2)", text, met))
    return out


def _setup_lines(setup: DaySetup, load: dict) -> list[str]:
    from bench.sim.follow_the_sun import FLOOR, PEAK_H
    from bench.sim.geo import REGIONS, rtt_matrix
    from bench.sim.eight_regions import HOME, START_H
    from bench.sim.gpus import GPU_CLASSES, engine_params
    rtt = rtt_matrix()
    lines = ["## Setup", "", f"- Regions (bench/sim/geo.py), round trip = 2 x haversine distance (R = 6371 km) / "
             "(200 km/ms) x 1.5; the single global balancers run in " + HOME + ":", ""]
    lines += [markdown_table(["Region", "City", "Lat", "Lon", "UTC offset (h)", "Round trip to " + HOME + " (ms)"],
                             [[r.name, r.city, f"{r.lat:.2f}", f"{r.lon:.2f}", f"{r.utc_offset_h:+g}",
                               "-" if r.name == HOME else f"{rtt.get((r.name, HOME), rtt.get((HOME, r.name))):.0f}"]
                              for r in REGIONS]), ""]
    lines += [f"- Round trips over the 28 pairs: {min(rtt.values()):.0f} to {max(rtt.values()):.0f} ms "
              f"(mean {statistics.fmean(rtt.values()):.0f}); within a region 2 ms.",
              f"- Replicas: {setup.per_region} per region ({', '.join(f'{n} {c}' for c, n in setup.mix)}), "
              f"{8 * setup.per_region} in all; engine timings by class (bench/sim/gpus.py):", ""]
    lines += [markdown_table(["Class", "Memory GB", "GB/s", "TFLOPS", "Decode base ms", "Prefill ms/token",
                              "KV tokens", "Saturation req/s"],
                             [[g.name, f"{g.memory_gb:g}", f"{g.bandwidth_gbs:g}", f"{g.tflops:g}",
                               f"{engine_params(g).decode_base_ms:.2f}", f"{engine_params(g).prefill_ms_per_token:.3f}",
                               f"{engine_params(g).kv_cache_tokens:,}",
                               f"{load.get('per_class_rps', {}).get(n, float('nan')):.2f}"]
                              for n, g in GPU_CLASSES.items()]), ""]
    lines += [f"- Load (bench/sim/follow_the_sun.py): the Mooncake trace's first {setup.trace_s:g} s, prompts x1/8, "
              f"sessions drawn into regions with equal weights, re-timed per region by rate(h) = {FLOOR} + "
              f"{1 - FLOOR:g} x cos^4(pi (h - {PEAK_H:g}) / 24) of local hour h; 24 h in {setup.day_s:g} simulated s "
              f"from {START_H:.1f} h UTC; figures over requests sent after {setup.warmup_s:g} s.",
              f"- Offered load: {load['offered_rps']:.1f} req/s on average against a fleet capacity of "
              f"{load['fleet_capacity_rps']:.1f} req/s (sum of the classes' saturation throughputs): "
              f"{100 * load['mean_utilisation']:.0f}% utilisation over the day; a region at its peak is sent "
              f"{load['peak_region_rps']:.1f} req/s against its {load['region_capacity_rps']:.1f}: "
              f"{100 * load['peak_region_utilisation']:.0f}%, so region-local must queue in peak hours.", ""]
    return lines


def render(result: dict) -> str:
    """The Markdown report of ``result`` (run_all's output plus "meta", "setup" and "load")."""
    meta, runs = result["meta"], result["runs"]
    setup = FULL if meta["setup"] == FULL.name else QUICK
    systems = list(dict.fromkeys(r["system"] for r in runs))
    lines = [f"# Eight regions at scale ({meta['setup']}, simulated)", "",
             f"Commit {meta['commit']}, {meta['date']}, `{meta['command']}`; {meta['cores']} CPU cores, Python "
             f"{meta['python']}, {meta['jobs']} worker process(es). Seeds {', '.join(map(str, meta['seeds']))}: "
             "each figure is the mean over seeds with [min, max]. Source and model: bench/sim/eight_regions.py, "
             "bench/sim/eight_regions_bench.py.", ""]
    lines += _setup_lines(setup, result["load"])
    lines += ["## Results", "", markdown_table(
        ["System", "TTFT p50 s", "TTFT p90 s", "E2E p90 s", "Throughput req/s", "Served outside region %",
         "... of requests sent in own busy hours %", "Forwarded %", "Waiting per region in its busy hours",
         "Prefix hit %", "Run wall s", "Run CPU s"], _system_rows(runs, systems)), ""]
    lines += [f"One seed of the whole scenario (all {len(systems)} systems, no bisection) took "
              f"{result['scenario_wall_s'] / len(meta['seeds']):.0f} s of wall time per seed with {meta['jobs']} "
              f"process(es) (sum of the runs' own wall times per seed: "
              f"{sum(r['wall_s'] for r in runs) / len(meta['seeds']):.0f} s, CPU times "
              f"{sum(r['cpu_s'] for r in runs) / len(meta['seeds']):.0f} s: the gap is other work sharing the "
              "machine's cores).", ""]
    if result["bisections"]:
        lines += ["## Replicas SkyLB needs to match region-local's P90 TTFT", "",
                  f"Bisection over replicas per region in ({int(BISECT_LOW * setup.per_region)}, "
                  f"{setup.per_region}], at most "
                  f"{BISECT_STEPS} SkyLB runs per seed, the class mix scaled in proportion; target: region-local's "
                  f"P90 with {8 * setup.per_region} replicas on the same seed.", "",
                  markdown_table(["Seed", "Region-local P90 s", "Steps (replicas: SkyLB P90 s)", "Needed"],
                                 [[str(b["seed"]), f"{_means(runs, 'RegionLocal', 'ttft_p90')[i]:.2f}",
                                   ", ".join(f"{8 * n}: {p:.2f}" for n, p in b["steps"]) or "-",
                                   str(b["replicas"]) if b["replicas"] else "more than all"]
                                  for i, b in enumerate(result["bisections"])]), ""]
    lines += ["## Acceptance", "", markdown_table(
        ["Claim", "Measured (mean over seeds)", "Met"],
        [[c, m, {True: "met", False: "MISSED", None: "-"}[ok]] for c, m, ok in acceptance(result)]), ""]
    if result.get("notes"):
        lines += [result["notes"].rstrip(), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim.eight_regions_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="24 replicas, 1,000 requests, a 60 s day (same code path)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--no-bisect", action="store_true", help="skip the replicas-needed bisection")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default $SKYLB_TRACE or the real one)")
    p.add_argument("--out-md", default=None, help="report (default bench/results/eight_regions[_quick].md)")
    p.add_argument("--out-json", default=None, help="JSON (default beside the report)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the scenario and write the report and JSON; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup = QUICK if args.quick else FULL
    trace = find_trace(args.trace)
    if not trace.is_file():
        print(f"trace not found: {trace} (pass --trace or set SKYLB_TRACE)", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    commit = _commit()  # the code that runs, read before the runs (they take minutes)
    result = run_all(setup, systems=args.systems, seeds=seeds, trace=str(trace), jobs=args.jobs,
                     bisect=not args.no_bisect)
    result["load"] = load_figures(setup, str(trace))
    command = "python -m bench.sim.eight_regions_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    result["meta"] = {"setup": setup.name, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                      "command": command.strip(),
                      "cores": os.cpu_count(), "python": platform.python_version(), "jobs": args.jobs,
                      "seeds": seeds, "trace": str(trace)}
    result["acceptance"] = acceptance(result)
    result["notes"] = Path(args.notes).read_text() if args.notes else ""
    stem = "eight_regions" + ("_quick" if args.quick else "")
    md = Path(args.out_md) if args.out_md else RESULTS / f"{stem}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(result))
    Path(args.out_json or md.with_suffix(".json")).write_text(json.dumps(result, indent=1, default=str))
    print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
