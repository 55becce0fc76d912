"""Run benchmarks: the simulated SkyLB evaluation (paper §5, Fig. 8-10) on the routing core, in simulated time.

`skylb bench sim --scenario NAME` runs one scenario; `skylb bench all` runs the whole suite and writes the report
(README.md with tables and the paper's targets marked met/missed), results.json and PNG plots to --out
(default bench/results/). Runs are independent simulations, spread over --jobs worker processes; results do not
depend on --jobs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tabulate import tabulate
from tqdm import tqdm

__all__ = ["add_arguments", "main", "run_specs", "render_report"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _scenario_help() -> str:
    from bench.sim.scenarios import SCENARIOS
    return "; ".join(f"{s.name}: {s.title} ({s.figure})" for s in SCENARIOS.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `skylb bench` options: `sim` and `all` (simulated), `baselines`, `overhead` and `live` (real processes)."""
    from bench.sim.scenarios import SCENARIOS
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    sim = sub.add_parser("sim", help="run one simulated scenario",
                         description="Run one simulated scenario. Scenarios: " + _scenario_help())
    sim.add_argument("--scenario", required=True, choices=list(SCENARIOS), metavar="NAME",
                     help="one of: " + ", ".join(SCENARIOS))
    everything = sub.add_parser("all", help="run the whole simulated evaluation and write the report",
                                description="Run every scenario but 'smoke' and write README.md, results.json "
                                            "and the PNG plots.")
    for name, help_text in LIVE_BENCHMARKS.items():
        live = sub.add_parser(name, help=help_text, add_help=False,
                              description=f"{help_text}. Options are those of `python -m bench.{name} --help`.")
        live.set_defaults(passes_options=True, rest=[])  # skylb.cli hands the unknown options over in order
    for p in (sim, everything):
        p.add_argument("--seed", type=int, default=0, help="seed of workloads, start times and probe phases")
        p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
        p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                       help="worker processes (default: min(2, CPUs))")
        p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def run_specs(specs: Sequence, *, jobs: int, progress: bool = True) -> list:
    """Execute RunSpecs (in ``jobs`` processes when > 1) and return their RunSummaries in ``specs`` order."""
    from bench.sim.scenarios import execute
    results: list = [None] * len(specs)
    bar = tqdm(total=len(specs), desc="simulating", unit="run", disable=not progress, file=sys.stderr)
    try:
        if jobs <= 1:
            for i, spec in enumerate(specs):
                bar.set_postfix_str(f"{spec.scenario}/{spec.system}")
                results[i] = execute(spec)
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                # Longest first: the big scenarios do not end up last on one worker.
                order = sorted(range(len(specs)), key=lambda i: -_cost_hint(specs[i]))
                futures = {pool.submit(execute, specs[i]): i for i in order}
                for fut in as_completed(futures):
                    i = futures[fut]
                    results[i] = fut.result()
                    bar.set_postfix_str(f"{specs[i].scenario}/{specs[i].system}")
                    bar.update()
    finally:
        bar.close()
    return results


def _cost_hint(spec) -> float:
    return sum(n for _, n in spec.counts) + (20 if spec.system in ("SkyLB", "SkyLB-CH", "Oracle") else 0)


# ------------------------------------------------------------------------------------------------------- report

def _f(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(rows) -> str:
    headers = ["system", "replicas", "req/s", "tok/s", "TTFT mean", "TTFT p50", "TTFT p90", "E2E p50", "E2E p90",
               "hit rate", "outst. var", "pending", "KV used", "LB queue", "fwd", "remote", "net (s)", "done"]
    body = [[r.system, r.replicas, _f(r.throughput_rps), _f(r.throughput_tps, 0), _f(r.ttft_mean), _f(r.ttft_p50),
             _f(r.ttft_p90), _f(r.e2e_p50, 1), _f(r.e2e_p90, 1), f"{r.hit_rate:.1%}", _f(r.outstanding_var, 1),
             _f(r.pending_mean), f"{r.kv_usage_mean:.0%}", _f(r.queue_mean, 1), f"{r.forwarded_frac:.1%}", f"{r.remote_frac:.1%}",
             _f(r.network_mean), r.completed] for r in rows]
    return tabulate(body, headers=headers, tablefmt="github")


def render_report(results: list, *, seed: int, wall_s: float, jobs: int, plots: dict[str, str],
                  skipped: Sequence[str] = (), command: str = "skylb bench all") -> str:
    """The markdown report: setup, the paper's targets (met / missed, measured, why), one table per scenario."""
    from bench.sim.scenarios import SCENARIOS, evaluate_targets, observations
    from bench.sim.systems import SYSTEMS
    from bench.sim.workloads import __doc__ as workloads_doc
    lines = ["# Simulated SkyLB evaluation", ""]
    lines += [f"Produced by `{command} --seed {seed}` in {wall_s:.0f} s of wall time on {jobs} worker "
              f"process(es) ({os.cpu_count()} CPUs, Python {platform.python_version()}). Every number below is "
              "simulated: the routing decisions are made by `skylb.core.Router` and its policies (the code the live "
              "balancer runs), the replicas are `skylb.emulator.model.EngineModel` (continuous batching, KV "
              "capacity, block prefix cache; L4 / Llama-3.1-8B timings), and time is simulated (bench/sim).", ""]
    lines += ["**Scaling.** To fit the whole suite in under 10 minutes on 2 cores, each closed-loop run sends requests "
              "for 210 simulated seconds and measures over [30 s, 210 s); the Mooncake trace replays its first 210 s "
              "in real time with prompts scaled by 1/8. Requests in flight at the end run to completion (none is "
              "lost). The paper's runs were longer, on real GPUs.", ""]
    lines += ["**Network.** Round trips us-eu 80 ms, us-asia 150 ms, eu-asia 200 ms, 2 ms within a region. Probes "
              "every 100 ms cross the same latencies, so each balancer's view is stale by up to one interval plus "
              "the round trip. The oracle has a free network and a fresh view.", ""]
    lines += ["**Metrics.** req/s and tok/s: completions per second in the window. TTFT / E2E (s): from the "
              "client's send, over requests sent in the window. hit rate: cached / prompt tokens at the engine. "
              "outst. var: variance across replicas of outstanding (waiting + running) requests, averaged over "
              "100 ms samples. pending: mean requests waiting at each replica's engine. KV used: mean fraction of a "
              "replica's KV blocks held by its running requests. LB queue: mean requests "
              "queued at all balancers. fwd: forwarded to a peer balancer. remote: served outside the client's "
              "region. net: network time inside TTFT. done: requests completed in the run.", ""]
    targets = evaluate_targets(results)
    lines += ["## Targets (paper claims) as measured", ""]
    lines += [tabulate([[t.claim, t.scope, t.measured, "met" if t.met else "**missed**", t.why] for t in targets],
                       headers=["target", "scenario", "measured", "result", "why (when missed, from the runs)"],
                       tablefmt="github"), ""]
    notes = observations(results)
    if notes:
        lines += ["### What the runs show (computed from the tables below)", ""]
        lines += [f"- {n}" for n in notes] + [""]
    if skipped:
        lines += [f"Skipped: {', '.join(skipped)} (the Mooncake trace file was not found).", ""]
    lines += ["## Systems", ""]
    lines += [tabulate([[s.key, s.label, s.policy, s.layout] for s in SYSTEMS.values()],
                       headers=["system", "what", "core policy", "layout"], tablefmt="github"), ""]
    lines += ["Details and sources: `bench/sim/systems.py`; workload lengths and their reasons: "
              "`bench/sim/workloads.py`.", ""]
    for name in SCENARIOS:
        rows = [r for r in results if r.scenario == name]
        if not rows:
            continue
        sc = SCENARIOS[name]
        order = {s: i for i, s in enumerate(sc.systems)}
        rows.sort(key=lambda r: (r.replicas, order.get(r.system, 99)))
        lines += [f"## {sc.figure}: {sc.title} (`{name}`)", ""]
        if sc.notes:
            lines += [sc.notes, ""]
        lines += [_table(rows), ""]
        if name == "skewed":
            lines += _replicas_needed_table(rows)
        for key, path in plots.items():
            if key.startswith(name + ":"):
                lines += [f"![{key}]({path})", ""]
    for key, path in plots.items():
        if key.startswith("fig8:"):
            lines += ["## Fig. 8 plot (all workloads)", "", f"![Fig. 8]({path})", ""]
    lines += ["## Workloads", "", "```", (workloads_doc or "").strip(), "```", ""]
    return "\n".join(lines)


def _replicas_needed_table(rows) -> list[str]:
    """Fig. 10 as cost: for each region-local size n, the fewest SkyLB replicas reaching its throughput."""
    from bench.sim.metrics import replicas_needed
    from bench.sim.scenarios import FIG10_TOLERANCE
    sky = {r.replicas: r.throughput_rps for r in rows if r.system == "SkyLB"}
    rl = {r.replicas: r.throughput_rps for r in rows if r.system == "RegionLocal"}
    if not sky or not rl:
        return []
    body = []
    for n in sorted(rl):
        need = replicas_needed(sky, rl[n], tolerance=FIG10_TOLERANCE)
        body.append([n, _f(rl[n]), need if need is not None else f"> {max(sky)}",
                     f"{1 - need / n:.0%}" if need is not None else "n/a"])
    return [f"Replicas needed (SkyLB reaching region-local's throughput within {FIG10_TOLERANCE:.0%}):", "",
            tabulate(body, headers=["region-local replicas", "its req/s", "SkyLB replicas needed", "replicas saved"],
                     tablefmt="github"), ""]


def _write_plots(results: list, out: Path, prefix: str = "") -> dict[str, str]:
    try:
        from bench.plots import plot_fig8, plot_fig9, plot_fig10
    except ModuleNotFoundError as exc:  # matplotlib comes with the bench extra, not the core install
        print(f"skylb bench: no plots ({exc.name} is not installed; `pip install -e '.[bench]'` or `make bench`)",
              file=sys.stderr)
        return {}
    from bench.sim.scenarios import FIG9_SCENARIOS, SCENARIOS
    from bench.sim.systems import FIG8_SYSTEMS, FIG9_SYSTEMS
    plots: dict[str, str] = {}
    present = {r.scenario for r in results}
    fig8 = [(w, t) for w, t in (("arena", "Arena"), ("wildchat", "WildChat"), ("tot", "ToT"),
                                ("mixed_tree", "Mixed Tree"), ("mooncake", "Mooncake")) if w in present]
    if fig8:
        plots["fig8:all"] = plot_fig8(results, fig8, FIG8_SYSTEMS, out / f"{prefix}fig8.png").name
    for sc in FIG9_SCENARIOS:
        if sc in present:
            plots[f"{sc}:fig9"] = plot_fig9(results, sc, FIG9_SYSTEMS, out / f"{prefix}{sc}.png",
                                            title=f"Simulated Fig. 9: {SCENARIOS[sc].title}").name
    if "skewed" in present:
        plots["skewed:fig10"] = plot_fig10(results, "skewed", out / f"{prefix}fig10.png").name
    return plots


#: Live benchmarks on real processes: `skylb bench NAME ARGS` runs `python -m bench.NAME ARGS`.
LIVE_BENCHMARKS = {
    "baselines": "SkyLB beside the SGLang router and HAProxy on the same replicas and workload "
                 "(bench/results/baselines.md)",
    "overhead": "the balancer's own cost: added latency, request rate, SSE relay, decision time, memory",
    "live": "the paper's scenarios scaled down on the local three-region deployment (bench/results/live.md)",
    "calibrate": "the engine model beside the paper's L4 figure and a real llama-server, the same requests on "
                 "both (bench/results/calibration.md)",
}


def main(args: argparse.Namespace) -> int:
    """Run `skylb bench sim|all` (simulated) or a live benchmark; returns the exit status."""
    if args.bench_command in LIVE_BENCHMARKS:
        import importlib
        return int(importlib.import_module(f"bench.{args.bench_command}").main(args.rest) or 0)
    from bench.sim.scenarios import SCENARIOS, SUITE, runs_of, trace_available
    names = [args.scenario] if args.bench_command == "sim" else list(SUITE)
    skipped = [n for n in names if SCENARIOS[n].needs_trace and not trace_available()]
    names = [n for n in names if n not in skipped]
    if skipped:
        print(f"skipping {', '.join(skipped)}: Mooncake trace not found", file=sys.stderr)
    specs = [spec for n in names for spec in runs_of(n, seed=args.seed)]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_specs(specs, jobs=max(1, args.jobs), progress=not args.no_progress)
    wall = time.perf_counter() - t0
    stem = "README" if args.bench_command == "all" else args.scenario
    # A single scenario's plots get its name as a prefix, so they never overwrite the full suite's.
    plots = _write_plots(results, out, prefix="" if stem == "README" else f"{stem}-")
    command = "skylb bench all" if stem == "README" else f"skylb bench sim --scenario {stem}"
    report = render_report(results, seed=args.seed, wall_s=wall, jobs=args.jobs, plots=plots, skipped=skipped,
                           command=command)
    (out / f"{stem}.md").write_text(report)
    (out / f"{'results' if stem == 'README' else stem}.json").write_text(json.dumps(
        {"seed": args.seed, "wall_s": wall, "results": [r.to_dict() for r in results]}, indent=1))
    print(f"{len(results)} runs in {wall:.0f} s; report: {out / (stem + '.md')}")
    return 0
