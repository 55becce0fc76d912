"""Run benchmarks: the simulated SkyLB evaluation (paper §5, Fig. 8-10) on the routing core, in simulated time.

`skylb bench sim --scenario NAME` runs one scenario; `skylb bench all` runs the whole suite and writes the report
(README.md with tables and the paper's targets marked met/missed), results.json and PNG plots to --out
(default bench/results/). Runs are independent simulations, spread over --jobs worker processes; results do not
depend on --jobs. Every run is repeated for each of --seeds (default 0,1,2; --seed N runs one seed): the report
gives each figure as the mean over seeds with [min, max], and the targets are evaluated on the means. --trace
replays another Mooncake-format trace in the trace scenarios; with `sim`, --start-s and --time-compression move
the replayed window.

`skylb bench matrix` runs the robustness matrix (bench/sim/matrix.py: workloads x loads x systems x seeds) through
the same worker processes and writes matrix.md, matrix.json and matrix.png to --out; --quick runs a tiny matrix
(two workloads, two loads, four systems, one seed, 30 simulated seconds) for the tests.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tabulate import tabulate

from bench.reporting.provenance import provenance
from bench.replay.report import markdown_table, with_provenance
from tqdm import tqdm

__all__ = ["add_arguments", "main", "run_specs", "render_report"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _scenario_help() -> str:
    from bench.sim.scenarios import SCENARIOS
    return "; ".join(f"{s.name}: {s.title} ({s.figure})" for s in SCENARIOS.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `skylb bench` options: `sim` and `all` (simulated), `baselines`, `overhead` and `live` (real processes)."""
    from bench.sim.scenarios import DEFAULT_SEEDS, SCENARIOS
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    sim = sub.add_parser("sim", help="run one simulated scenario",
                         description="Run one simulated scenario. Scenarios: " + _scenario_help())
    sim.add_argument("--scenario", required=True, choices=list(SCENARIOS), metavar="NAME",
                     help="one of: " + ", ".join(SCENARIOS))
    sim.add_argument("--start-s", type=float, default=None, metavar="S",
                     help="trace time (s) where a trace scenario's replay starts (default: the scenario's; the "
                          "first minute of a trace is cache-cold)")
    sim.add_argument("--time-compression", type=float, default=None, metavar="C",
                     help="divide trace time by C (2 = twice the request rate; default: the scenario's)")
    everything = sub.add_parser("all", help="run the whole simulated evaluation and write the report",
                                description="Run every scenario but 'smoke' and write README.md, results.json "
                                            "and the PNG plots.")
    _add_matrix(sub)
    for name, help_text in LIVE_BENCHMARKS.items():
        live = sub.add_parser(name, help=help_text, add_help=False,
                              description=f"{help_text}. Options are those of `python -m {live_module(name)} --help`.")
        live.set_defaults(passes_options=True, rest=[])  # skylb.cli hands the unknown options over in order
    for p in (sim, everything):
        seeds = p.add_mutually_exclusive_group()
        seeds.add_argument("--seeds", type=_seed_list, default=DEFAULT_SEEDS, metavar="N,N,...",
                           help="seeds of workloads, region assignment, start times and probe phases; every figure "
                                "is the mean over them with [min, max] (default: "
                                + ",".join(map(str, DEFAULT_SEEDS)) + ")")
        seeds.add_argument("--seed", type=int, help="run this one seed only (same as --seeds N)")
        p.add_argument("--trace", type=Path, default=None, metavar="PATH",
                       help="Mooncake-format trace for the trace scenarios (default: the real one, "
                            f"{_default_trace()})")
        p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
        p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                       help="worker processes (default: min(2, CPUs))")
        p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
        p.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                       help="run nothing: redraw the plots and rewrite the report from the runs saved in PATH "
                            "(a results.json this command wrote)")


def _add_matrix(sub) -> None:
    """The `skylb bench matrix` options (bench/sim/matrix.py)."""
    from bench.sim.matrix import LOADS, MATRIX_SYSTEMS, SPLITS, WORKLOADS
    m = sub.add_parser("matrix", help="run the robustness matrix (workloads x loads x systems x seeds) and write "
                                      "matrix.md, matrix.json and matrix.png",
                       description="The robustness matrix that judges the default routing policy (bench/sim/"
                                   "matrix.py). Workloads: " + ", ".join(f"{w.name} ({w.title})"
                                                                         for w in WORKLOADS.values()))
    m.add_argument("--quick", action="store_true",
                   help="a tiny matrix for the tests: 2 workloads x 2 loads x 4 systems x 1 seed, 30 simulated s "
                        "(options given beside it still apply)")
    m.add_argument("--workloads", type=_name_list(WORKLOADS), default=None, metavar="W,W,...",
                   help="workloads (default: all): " + ", ".join(WORKLOADS))
    m.add_argument("--loads", type=_load_list, default=None, metavar="X,X,...",
                   help="load multipliers for every workload (default: each workload's own; "
                        + ", ".join(f"{x:g}" for x in LOADS) + " in all)")
    m.add_argument("--systems", type=_name_list(MATRIX_SYSTEMS), default=None, metavar="S,S,...",
                   help="systems (default: all): " + ", ".join(MATRIX_SYSTEMS))
    m.add_argument("--split", choices=list(SPLITS), default="dev",
                   help="dev: seeds 0-2, trace windows in the first 40 minutes; val: seeds 3-5, trace windows from "
                        "minute 40; all: both (default dev)")
    m.add_argument("--seeds", type=_seed_list, default=None, metavar="N,N,...",
                   help="seeds (default: the split's)")
    m.add_argument("--counts", type=_counts, default=None, metavar="us=N,eu=N,asia=N",
                   help="replicas per region for every workload instead of its own (the same clients; an "
                        "open-loop workload's 1x stays its own deployment's rate), e.g. us=2,eu=4,asia=6; write "
                        "the report to another --out than the matrix's own")
    m.add_argument("--schedule-policy", choices=("lpm", "fcfs"), default=None,
                   help="the order in which every simulated engine takes its waiting queue instead of the "
                        "calibrated regime's (bench/sim/regime.yaml): lpm, longest prefix match first (SGLang "
                        "v0.4.3's default), or fcfs, first come, first served (vLLM's; SGLang's since v0.4.6); the "
                        "loads stay the regime's; write the report to another --out than the matrix's own")
    m.add_argument("--option", type=_policy_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the default's routing policy (skylb/core/policies/skylb.py), applied wherever "
                        "that policy runs (SkyLB, RegionLocal, the oracle's candidate); VALUE a Python literal "
                        "(100, 0.5, False, 'own'), else a string; repeatable. To judge a candidate default without "
                        "a code change: --systems SkyLB,RegionLocal --option ... --out DIR, then --from-json "
                        "DIR/matrix.json --replace-in bench/results/matrix.json --out DIR2")
    m.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: min(2, CPUs))")
    m.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    m.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    m.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                   help="run nothing: rewrite the report and the heat map from the runs saved in PATH (a "
                        "matrix.json this command wrote)")
    m.add_argument("--replace-in", type=Path, default=None, metavar="PATH",
                   help="with --from-json: the report of the matrix saved in PATH with the runs of the systems in "
                        "--from-json's file replaced by those (same split, seeds and counts), e.g. the default "
                        "rerun alone after a change to it; both commands are recorded")


def _policy_option(text: str) -> tuple[str, object]:
    """An argparse type: KEY=VALUE, VALUE a Python literal when it parses as one, else the string itself."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def _counts(text: str) -> tuple[tuple[str, int], ...]:
    """An argparse type: replicas per region (bench/sim/matrix.py ``parse_counts``)."""
    from bench.sim.matrix import parse_counts
    try:
        return parse_counts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _name_list(known) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names, each one of ``known``."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.split(",") if x)
        unknown = [x for x in names if x not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'empty list'}; known: "
                                             + ", ".join(known))
        return names
    return parse


def _number_list(text: str, cast, kind: str) -> tuple:
    """``text`` split on commas, each item through ``cast``; argparse.ArgumentTypeError naming ``kind`` otherwise."""
    try:
        return tuple(cast(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {text!r}") from None


def _load_list(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> (0.5, 1.0, 2.0); argparse.ArgumentTypeError for anything else or a load <= 0."""
    loads = _number_list(text, float, "numbers")
    if any(x <= 0 for x in loads):
        raise argparse.ArgumentTypeError(f"loads must be > 0, got {text!r}")
    return loads


def _seed_list(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> (0, 1, 2); argparse.ArgumentTypeError for anything else or a repeated seed."""
    seeds = _number_list(text, int, "integers")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seed repeated in {text!r}")
    return seeds


def _default_trace() -> Path:
    from bench.sim.workloads import DEFAULT_TRACE
    return DEFAULT_TRACE


def run_specs(specs: Sequence, *, jobs: int, progress: bool = True, runner=None, cost=None) -> list:
    """Execute RunSpecs (in ``jobs`` processes when > 1) and return their RunSummaries in ``specs`` order.

    ``runner``: a top-level function spec -> RunSummary (default bench/sim/scenarios.py ``execute``; the matrix
    passes bench/sim/matrix.py ``execute_run``); ``cost``: spec -> relative cost, the longest started first
    (default :func:`_cost_hint`). A spec has ``scenario`` and ``system`` (shown on the progress bar)."""
    from bench.sim.scenarios import execute
    execute = runner or execute
    _cost = cost or _cost_hint
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
                order = sorted(range(len(specs)), key=lambda i: -_cost(specs[i]))
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
    """A rough relative cost of a run, to start the long ones first (the oracle runs one simulation per candidate)."""
    from bench.sim.scenarios import SCENARIOS
    from bench.sim.systems import SYSTEMS
    sc = SCENARIOS[spec.scenario]
    per_run = sum(n for _, n in spec.counts) + (20 if spec.system.startswith(("SkyLB", "Oracle")) else 0)
    load = sc.stop_at / 210.0 * (sc.trace.time_compression if sc.trace else 1.0)
    return per_run * load * max(1, len(SYSTEMS[spec.system].candidates))


# ------------------------------------------------------------------------------------------------------- report

def _f(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _cell(r, metric: str, fmt: str = "{:.2f}") -> str:
    """A figure of ``r`` as "mean [min, max]" over its seeds (the mean alone for one seed)."""
    from bench.sim.metrics import spread_text
    value = getattr(r, metric)
    return "n/a" if isinstance(value, float) and math.isnan(value) else spread_text(r, metric, fmt=fmt)


def _table(rows) -> str:
    headers = ["system", "replicas", "req/s", "tok/s", "TTFT mean", "TTFT p50", "TTFT p90", "E2E p50", "E2E p90",
               "hit rate", "ideal hit", "ideal (KV)", "outst. var", "pending", "KV used", "LB queue", "fwd", "remote", "net (s)",
               "done"]
    body = [[r.system, r.replicas, _cell(r, "throughput_rps"), _f(r.throughput_tps, 0), _f(r.ttft_mean),
             _cell(r, "ttft_p50"), _cell(r, "ttft_p90"), _f(r.e2e_p50, 1), _cell(r, "e2e_p90", "{:.1f}"),
             _cell(r, "hit_rate", "{:.1%}"), f"{r.ideal_hit_rate:.1%}", f"{r.ideal_kv_hit_rate:.1%}",
             _f(r.outstanding_var, 1),
             _f(r.pending_mean), f"{r.kv_usage_mean:.0%}", _f(r.queue_mean, 1), f"{r.forwarded_frac:.1%}",
             f"{r.remote_frac:.1%}", _f(r.network_mean), r.completed] for r in rows]
    return markdown_table(headers, body)


def _oracle_table(row) -> list[str]:
    """The oracle's candidate policies, each one's figures (mean over seeds), and which one each kept figure came
    from."""
    if not row.candidates:
        return []
    body = [[name, _f(c["throughput_rps"]), _f(c["ttft_p50"]), _f(c["ttft_p90"]), _f(c["e2e_p90"], 1),
             f"{c['hit_rate']:.1%}"] for name, c in row.candidates.items()]
    kept = "; ".join(f"{m}: {row.best_of[m]}" for m in ("throughput_rps", "ttft_p50", "ttft_p90", "e2e_p90",
                                                       "hit_rate") if m in row.best_of)
    return ["Oracle candidates (global fresh view, free network; mean over seeds). The Oracle row keeps, per seed "
            "and per figure, the best candidate's value, so it bounds each figure separately; kept from (seeds "
            f"per candidate): {kept}.", "",
            markdown_table(["candidate policy", "req/s", "TTFT p50", "TTFT p90", "E2E p90", "hit rate"], body), ""]


def render_report(results: list, *, seeds: Sequence[int], wall_s: float, jobs: int, plots: dict[str, str],
                  capacity: tuple | None = None,
                  skipped: Sequence[str] = (), command: str = "skylb bench all", trace: str | None = None) -> str:
    """The markdown report: setup, the targets (met / missed, measured, why), one table per scenario.

    ``results``: one RunSummary per scenario, system and deployment, the mean over ``seeds`` with its spread
    (bench/sim/scenarios.py ``aggregate_runs``). ``trace``: the trace the trace scenarios replayed (None: the real
    Mooncake trace).
    """
    from bench.sim.scenarios import SCENARIOS, WARM_LEAD_S, WARM_START_S, evaluate_targets, observations
    from bench.sim.systems import SYSTEMS
    from bench.sim.workloads import DEFAULT_TRACE
    from bench.sim.workloads import __doc__ as workloads_doc
    lines = ["# Simulated SkyLB evaluation", ""]
    lines += [f"Produced by `{command}` in {wall_s:.0f} s of wall time on {jobs} worker "
              f"process(es) ({os.cpu_count()} CPUs, Python {platform.python_version()}). Every number below is "
              "simulated: the routing decisions are made by `skylb.core.Router` and its policies (the code the live "
              "balancer runs), the replicas are `bench.emulator.model.EngineModel` (continuous batching, KV "
              "capacity, block prefix cache; L4 / Llama-3.1-8B timings), and time is simulated (bench/sim).", ""]
    lines += [f"**Seeds.** Every run is repeated with seeds {', '.join(map(str, seeds))}; each figure is the mean "
              "over them, shown as mean [min, max] where the spread matters (req/s, TTFT p50/p90, E2E p90, hit rate; "
              "the other columns are means). The targets are evaluated on the means, and their measured text quotes "
              "the spread. A seed changes the closed-loop workloads' draws, which region each trace session comes "
              "from, the clients' start times and the probe phases.", ""]
    lines += ["**Scaling.** To fit the whole suite in minutes on 2 cores, each closed-loop run sends requests "
              "for 210 simulated seconds and measures over [30 s, 210 s). The trace scenarios replay "
              f"`{trace or DEFAULT_TRACE.name}` open loop with prompts scaled by 1/8 for 210 simulated seconds: "
              "from its start at 1x, 2x and 3x time compression (210, 420 and 630 s of trace), and a warm window "
              f"from {WARM_START_S:.0f} s of trace whose first {WARM_LEAD_S:.0f} s fill the caches unmeasured. "
              "Requests in flight at the end run to completion (none is lost). The paper's runs were longer, on "
              "real GPUs.", ""]
    lines += ["**Network.** Round trips us-eu 80 ms, us-asia 150 ms, eu-asia 200 ms, 2 ms within a region. Probes "
              "every 100 ms cross the same latencies, so each balancer's view is stale by up to one interval plus "
              "the round trip. The oracle has a free network and a fresh view.", ""]
    lines += ["**Oracle.** One scheduler with a global fresh view and a free network, run once per candidate "
              "policy (SkyLB's, the paper's rule, SGLang's cache-aware with and without selective pushing, least "
              "load); per seed and per figure it keeps the best candidate's value (highest throughput and hit rate, "
              "lowest of each TTFT / E2E statistic), so it is a bound for each figure separately, not one run "
              "that reaches them all. If any system beats it, the oracle is wrong: a target row checks that for "
              "every scenario.", ""]
    lines += ["**Metrics.** req/s and tok/s: completions per second in the window. TTFT / E2E (s): from the "
              "client's send, over requests sent in the window. hit rate: cached / prompt tokens at the engine. "
              "ideal hit: the same requests through an infinite prefix cache on one replica (every 16-token block "
              "seen in an earlier request of the run is a hit; bench/sim/ideal.py), a limit no policy can pass. "
              "ideal (KV): the same cache bounded by every replica's KV blocks pooled, least recently used evicted: "
              "what the deployment's memory allows with perfect routing (still generous: running requests need "
              "KV too). "
              "outst. var: variance across replicas of outstanding (waiting + running) requests, averaged over "
              "100 ms samples. pending: mean requests waiting at each replica's engine. KV used: mean fraction of a "
              "replica's KV blocks held by its running requests. LB queue: mean requests "
              "queued at all balancers. fwd: forwarded to a peer balancer. remote: served outside the client's "
              "region. net: network time inside TTFT. done: requests completed in the run (mean over seeds).", ""]
    lines += _calibration_section(results, capacity)
    targets = evaluate_targets(results)
    lines += ["## Targets as measured (means over seeds)", ""]
    lines += [tabulate([[t.claim, t.scope, t.measured, "met" if t.met else "**missed**", t.why] for t in targets],
                       headers=["target", "scenario", "measured", "result", "why (when missed, from the runs)"],
                       tablefmt="github"), ""]
    notes = observations(results)
    if notes:
        lines += ["### What the runs show (computed from the tables below)", ""]
        lines += [f"- {n}" for n in notes] + [""]
    if skipped:
        lines += [f"Skipped: {', '.join(skipped)} (the trace file was not found).", ""]
    lines += ["## Systems", ""]
    lines += [tabulate([[s.key, s.label, " / ".join(s.candidates) or s.policy, s.layout] for s in SYSTEMS.values()],
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
        lines += next((_oracle_table(r) for r in rows if r.system == "Oracle"), [])
        if name == "skewed":
            lines += _replicas_needed_table(rows)
        for key, path in plots.items():
            if key.startswith(name + ":"):
                lines += [f"![{key}]({path})", ""]
    for key, path in plots.items():
        if key.startswith("fig8:"):
            lines += ["## Fig. 8 plot (all workloads)", "", f"![Fig. 8]({path})", ""]
    lines += _sweep_section(results, plots)
    lines += ["## Workloads", "", "```", (workloads_doc or "").strip(), "```", ""]
    return "\n".join(lines)


def capacity_for(results) -> tuple | None:
    """The capacity sweep's cell (bench/sim/capacity.py ``first_wait_outstanding``) when Arena or WildChat ran
    (it takes seconds: only beside them), else None."""
    if {"arena", "wildchat"} & {r.scenario for r in results}:
        from bench.sim.capacity import first_wait_outstanding
        return first_wait_outstanding()
    return None


def _calibration_section(results, capacity: tuple | None) -> list[str]:
    """The calibration table (bench/sim/calibration.py) with the regime file's commit and the capacity sweep."""
    from bench.sim.calibration import calibration_markdown, calibration_rows
    from bench.sim.regime import REGIME_FILE, regime_commit
    return ["## Calibration: the simulated regime beside the paper's (§5, §3.3)", "",
            f"Engine and workload parameters: `bench/sim/regime.yaml` as of commit {regime_commit()}, frozen "
            "before the SkyLB runs below. How each paper cell is read: `bench/sim/calibration.py`.", "",
            calibration_markdown(calibration_rows(results, capacity)), ""]


def _sweep_section(results, plots: dict[str, str]) -> list[str]:
    """The load sweep: per workload, SkyLB beside the best single balancer and the gateway at each load."""
    from bench.sim.calibration import sweep_markdown, sweep_rows
    from bench.sim.scenarios import SINGLE_BASELINES, SWEEP_LOADS, SWEEP_WORKLOADS, sweep_name
    lines = []
    for wl in SWEEP_WORKLOADS:
        rows = sweep_rows(results, wl, sorted((1.0, *SWEEP_LOADS)), sweep_name, SINGLE_BASELINES)
        if len(rows) < 2:
            continue
        if not lines:
            lines += ["## Load sweep: where the paper's Fig. 8 targets hold", "",
                      "Clients per region at 0.5x, 1x, 1.5x and 2x the paper's; every system at each load, "
                      "3 seeds (mean [min, max]). Ratios are SkyLB's over the best single balancer's "
                      "(RR, LL, CH, SGL) and the per-region gateway's.", ""]
        lines += [f"### {wl}", "", sweep_markdown(rows), ""]
        if f"sweep:{wl}" in plots:
            lines += [f"![sweep {wl}]({plots[f'sweep:{wl}']})", ""]
    return lines


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
        from bench.sim.plots import plot_fig8, plot_fig9, plot_fig10
    except ModuleNotFoundError as exc:  # matplotlib comes with the bench extra, not the core install
        print(f"skylb bench: no plots ({exc.name} is not installed; `pip install -e '.[bench]'` or `make bench`)",
              file=sys.stderr)
        return {}
    from bench.sim.scenarios import FIG9_SCENARIOS, MOONCAKE_SCENARIOS, SCENARIOS
    from bench.sim.systems import FIG8_SYSTEMS, FIG9_SYSTEMS, MOONCAKE_SYSTEMS
    plots: dict[str, str] = {}
    present = {r.scenario for r in results}
    fig8 = [(w, t) for w, t in (("arena", "Arena"), ("wildchat", "WildChat"), ("tot", "ToT"),
                                ("mixed_tree", "Mixed Tree"), ("mooncake", "Mooncake")) if w in present]
    if fig8:
        plots["fig8:all"] = plot_fig8(results, fig8, FIG8_SYSTEMS, out / f"{prefix}fig8.png").name
    labels = {"mooncake": "1x", "mooncake_2x": "2x", "mooncake_3x": "3x", "mooncake_warm": "warm window"}
    trace = [(s, f"Mooncake {labels.get(s, s)}") for s in MOONCAKE_SCENARIOS if s in present]
    if len(trace) > 1:  # after the last Mooncake table
        plots[f"{trace[-1][0]}:trace"] = plot_fig8(
            results, trace, MOONCAKE_SYSTEMS, out / f"{prefix}mooncake.png",
            title="Simulated Mooncake trace at 1x, 2x, 3x and on a warm window").name
    for sc in FIG9_SCENARIOS:
        if sc in present:
            plots[f"{sc}:fig9"] = plot_fig9(results, sc, FIG9_SYSTEMS, out / f"{prefix}{sc}.png",
                                            title=f"Simulated Fig. 9: {SCENARIOS[sc].title}").name
    if "skewed" in present:
        plots["skewed:fig10"] = plot_fig10(results, "skewed", out / f"{prefix}fig10.png").name
    from bench.sim.plots import plot_sweep
    from bench.sim.scenarios import SWEEP_LOADS, SWEEP_SYSTEMS, SWEEP_WORKLOADS, sweep_name
    loads = sorted((1.0, *SWEEP_LOADS))
    for wl in SWEEP_WORKLOADS:
        if sum(sweep_name(wl, x) in present for x in loads) > 1:
            plots[f"sweep:{wl}"] = plot_sweep(results, wl, loads, sweep_name, SWEEP_SYSTEMS,
                                              out / f"{prefix}sweep_{wl}.png",
                                              title=f"Load sweep: {SCENARIOS[wl].title}").name
    return plots


#: Live benchmarks on real processes: `skylb bench NAME ARGS` runs `python -m MODULE ARGS` (``live_module``).
LIVE_BENCHMARKS = {
    "baselines": "SkyLB beside the SGLang router and HAProxy, each tuned as operators deploy it, on the same "
                 "replicas and workload, in 5 paired runs (bench/results/baselines.md)",
    "overhead": "the balancer's own cost: added latency, request rate, SSE relay, decision time, memory",
    "live": "the paper's scenarios scaled down on the local three-region deployment (bench/results/live.md)",
    "peers": "SkyLB's balancer per region beside one SGLang router or HAProxy in us for every region's replicas, "
             "and beside a HAProxy per region, with the round trips between regions (bench/results/peers.md)",
    "calibrate": "the engine model beside the paper's L4 figure and a real llama-server, the same requests on "
                 "both (bench/results/calibration.md)",
    "failover": "detection, failover, DNS and recovery times when a region's balancer dies, with real processes "
                "(bench/results/failover.md)",
    "scale_out": "one region served by 1, 2 and 4 balancers (siblings) in front of fast emulated replicas: sustained "
                 "plain and streamed request rates, latency and CPU per request, interleaved rounds",
    "soak": "many concurrent streams for minutes with replicas killed and restarted: requests lost and duplicated, "
            "memory and trie size over time (bench/results/soak.md)",
    "chaos": "the three-region deployment (etcd, Redis, BIND) under load while a seeded schedule of kills, "
             "partitions, a split brain and slow or failing replicas runs: lost, duplicated, detection and recovery "
             "per fault (bench/results/chaos.md)",
    "eight_regions": "simulated: 8 regions, 200 replicas of three GPU classes, a follow-the-sun day of the Mooncake "
                     "trace (bench/results/eight_regions.md)",
    "coordination": "the cost of coordination with 200 replicas and 8 peers: decision time, peer status size, probe "
                    "traffic (bench/results/coordination.md)",
    "probe_cost": "what probing costs an idle balancer: CPU per replica, per second and per probe, at two probe "
                  "intervals (bench/results/probe_cost.md)",
    "hop_cost": "what one balancer hop costs per request: CPU of one static balancer relaying streamed and whole "
                "answers at two emulated time scales, per request and per SSE event (bench/results/hop_cost.md)",
    "kv_live": "routing by the prefix trie vs by the engines' KV-cache events, beside the SGLang router and "
               "HAProxy: emulated vLLM replicas publishing events, the multi-tenant shared-prefix workload, paired "
               "runs (bench/results/kv_live.md)",
    "kv_regions": "exact cache locality across three regions: emulated vLLM replicas publishing KV-cache events, "
                  "tenants' requests from several regions; forwards to the region holding the prompt's prefix, by "
                  "the replicas' own events, with and without routing by them (bench/results/kv_regions.md)",
    "concurrency": "fixed concurrency as inference-perf runs it (16 clients, 4 replicas of batch 4): requests waiting "
                   "behind a full batch, TTFT p99 and throughput beside HAProxy leastconn (bench/results/concurrency.md)",
    "load_generators": "the README's recipe for the field's load generators, run with AIPerf (installed apart: "
                       "--aiperf PATH) against a static balancer of two emulated vLLM replicas: AIPerf's errors and "
                       "the balancer's statuses (bench/results/load_generators.md)",
    "status_page": "a screenshot of the controller's status page on the local three-region deployment under load, "
                   "in headless Chromium (docs/status-page.png)",
}


#: The module of each live benchmark that is not ``bench.live.NAME``.
_LIVE_ELSEWHERE = {"live": "bench.live.regions", "chaos": "bench.chaos.run",
                   "eight_regions": "bench.sim.eight_regions_bench", "coordination": "bench.micro.coordination"}


def live_module(name: str) -> str:
    """The module that live benchmark ``name`` (a key of LIVE_BENCHMARKS) runs: ``bench.live.NAME`` unless
    _LIVE_ELSEWHERE names another."""
    return _LIVE_ELSEWHERE.get(name, f"bench.live.{name}")


def _run_live(name: str, argv: list[str]) -> int:
    """Run live benchmark ``name``: the first Ctrl-C or SIGTERM ends it and every process it started is stopped,
    whatever signals arrive meanwhile (bench/launch/interrupts.py); then 130, without a traceback."""
    import importlib

    from bench.launch import interrupts

    module = importlib.import_module(live_module(name))
    try:
        interrupts.stop_on_signals()
        return int(module.main(argv) or 0)
    except KeyboardInterrupt:
        interrupts.stopping()
        print(f"skylb bench {name}: interrupted; the processes it started are stopped", file=sys.stderr)
        return 130


def main(args: argparse.Namespace) -> int:
    """Run `skylb bench sim|all` (simulated) or a live benchmark; returns the exit status (130 when interrupted)."""
    if args.bench_command in LIVE_BENCHMARKS:
        return _run_live(args.bench_command, args.rest)
    if args.bench_command == "matrix":
        return _run_matrix(args)
    from bench.sim.scenarios import SCENARIOS, SUITE, aggregate_runs, runs_of, trace_available
    seeds = (args.seed,) if args.seed is not None else tuple(args.seeds)
    trace = str(args.trace) if args.trace is not None else None
    start_s, compression = getattr(args, "start_s", None), getattr(args, "time_compression", None)
    names = [args.scenario] if args.bench_command == "sim" else list(SUITE)
    if args.bench_command == "sim" and not SCENARIOS[args.scenario].needs_trace and (
            trace is not None or start_s is not None or compression is not None):
        print(f"skylb bench sim: scenario {args.scenario!r} is not a trace replay; --trace, --start-s and "
              "--time-compression apply to: " + ", ".join(n for n, s in SCENARIOS.items() if s.needs_trace),
              file=sys.stderr)
        return 2
    if compression is not None and compression <= 0:
        print("skylb bench sim: --time-compression must be > 0", file=sys.stderr)
        return 2
    skipped = [n for n in names if SCENARIOS[n].needs_trace and not trace_available(trace)]
    names = [n for n in names if n not in skipped]
    if skipped:
        print(f"skipping {', '.join(skipped)}: trace {trace or _default_trace()} not found", file=sys.stderr)
    specs = [spec for n in names for seed in seeds
             for spec in (runs_of(n, seed=seed, trace=trace, start_s=start_s, time_compression=compression)
                          if SCENARIOS[n].needs_trace else runs_of(n, seed=seed))]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = "README" if args.bench_command == "all" else args.scenario
    json_path = out / f"{'results' if stem == 'README' else stem}.json"
    if getattr(args, "from_json", None) is not None:
        return _render_saved(args.from_json, out, stem, skipped=skipped, trace=trace)
    prov = provenance()  # at the start: the code that ran, even if the checkout changes during the run
    t0 = time.perf_counter()
    runs = run_specs(specs, jobs=max(1, args.jobs), progress=not args.no_progress)
    wall = time.perf_counter() - t0
    command = "skylb bench all" if stem == "README" else f"skylb bench sim --scenario {stem}"
    command += f" --seeds {','.join(map(str, seeds))}"
    for flag, value in (("--trace", trace), ("--start-s", start_s), ("--time-compression", compression)):
        if value is not None:
            command += f" {flag} {value:g}" if isinstance(value, float) else f" {flag} {value}"
    prov["command"] = command
    # The runs are saved before anything is drawn: a report can be redrawn from them (--from-json).
    json_path.write_text(json.dumps(
        {"seeds": list(seeds), "wall_s": wall, "jobs": args.jobs, "command": command, "provenance": prov,
         "results": [r.to_dict() for r in aggregate_runs(runs)], "runs": [r.to_dict() for r in runs]}, indent=1))
    _render_saved(json_path, out, stem, skipped=skipped, trace=trace)
    print(f"{len(runs)} runs in {wall:.0f} s; report: {out / (stem + '.md')}")
    return 0


def _run_matrix(args: argparse.Namespace) -> int:
    """`skylb bench matrix`: run the matrix's simulations in --jobs worker processes, save them with their provenance
    (matrix.json, before anything is drawn) and write the report (bench/sim/matrix_report.py). Returns 0, or 2 when
    a trace workload is asked for and the trace is missing."""
    from bench.sim.matrix import MATRIX_SYSTEMS, QUICK, TIMES, WORKLOADS, execute_run, runs_for, split_seeds
    from bench.sim.matrix_report import write_report
    from bench.sim.scenarios import trace_available
    if args.replace_in is not None and args.from_json is None:
        print("skylb bench matrix: --replace-in needs --from-json (the rerun's matrix.json)", file=sys.stderr)
        return 2
    if args.from_json is not None:
        try:
            saved = json.loads(args.from_json.read_text())
            if args.replace_in is not None:
                from bench.sim.matrix_report import replace_systems
                saved = replace_systems(json.loads(args.replace_in.read_text()), saved)
        except (OSError, ValueError, KeyError) as exc:  # a missing file, bad JSON, or two matrices that differ
            print(f"skylb bench matrix: cannot read or combine the saved runs: {exc!r}", file=sys.stderr)
            return 2
        print(f"report: {write_report(saved, args.out)}")
        return 0
    quick = QUICK if args.quick else {}
    workloads = args.workloads or quick.get("workloads") or tuple(WORKLOADS)
    systems = args.systems or quick.get("systems") or MATRIX_SYSTEMS
    seeds = args.seeds or split_seeds(args.split)[:1 if args.quick else None]
    loads = args.loads or quick.get("loads")
    missing = [w for w in workloads if WORKLOADS[w].kind == "trace" and not trace_available()]
    if missing:
        print(f"skylb bench matrix: {', '.join(missing)} need the trace {_default_trace()}, which is missing",
              file=sys.stderr)
        return 2
    from skylb.core.policies import PolicyError
    options = dict(args.option)
    try:
        specs = runs_for(workloads, systems, seeds, split=args.split, loads=loads, quick=args.quick,
                         counts=args.counts, schedule_policy=args.schedule_policy, options=options)
    except PolicyError as exc:
        print(f"skylb bench matrix: --option: {exc}", file=sys.stderr)
        return 2
    command = "skylb bench matrix" + (" --quick" if args.quick else "") + "".join(
        f" --{flag} {','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)}"
        for flag, value in (("workloads", args.workloads), ("loads", args.loads), ("systems", args.systems),
                            ("seeds", args.seeds)) if value) + f" --split {args.split}" + (
        " --counts " + ",".join(f"{r}={n}" for r, n in args.counts) if args.counts else "") + (
        f" --schedule-policy {args.schedule_policy}" if args.schedule_policy else "") + "".join(
        f" --option {k}={v!r}" for k, v in sorted(options.items()))
    prov = provenance(command)  # at the start: the code that ran, even if the checkout changes during the run
    t0 = time.perf_counter()
    runs = run_specs(specs, jobs=max(1, args.jobs), progress=not args.no_progress, runner=execute_run,
                     cost=lambda s: s.cost)
    saved = {"command": command, "provenance": prov, "split": args.split, "seeds": list(seeds),
             "systems": list(systems), "quick": args.quick,
             "counts": dict(args.counts) if args.counts else None, "schedule_policy": args.schedule_policy,
             "options": options or None,
             "times": {k: TIMES["quick" if args.quick else k] for k in ("closed", "open", "trace")},
             "wall_s": time.perf_counter() - t0, "jobs": args.jobs, "runs": [r.to_dict() for r in runs]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(json.dumps(saved, indent=1))
    md = write_report(saved, args.out)
    print(f"{len(runs)} runs in {saved['wall_s']:.0f} s; report: {md}")
    return 0


def _render_saved(path: Path, out: Path, stem: str, *, skipped: Sequence[str], trace: str | None) -> int:
    """Draw the plots and write the report ``out/stem.md`` from the runs saved in ``path`` (their provenance, seeds
    and wall time as recorded). Returns 0."""
    from bench.sim.metrics import RunSummary
    from bench.sim.scenarios import aggregate_runs
    saved = json.loads(Path(path).read_text())
    runs = [RunSummary(**r) for r in saved["runs"]]
    results = aggregate_runs(runs)
    if "capacity" not in saved:  # measured once, kept with the runs (the README's glance quotes it from there)
        saved["capacity"] = capacity_for(results)
        Path(path).write_text(json.dumps(saved, indent=1))
    capacity = tuple(saved["capacity"]) if saved["capacity"] else None
    # A single scenario's plots get its name as a prefix, so they never overwrite the full suite's.
    plots = _write_plots(results, out, prefix="" if stem == "README" else f"{stem}-")
    report = render_report(results, seeds=tuple(saved["seeds"]), wall_s=saved["wall_s"],
                           jobs=saved.get("jobs", 1), plots=plots, skipped=skipped, capacity=capacity,
                           command=saved["command"], trace=trace)
    prov = saved.get("provenance") or {"commit": "not recorded", "date": "not recorded",
                                       "command": saved["command"], "machine": {}}
    (out / f"{stem}.md").write_text(with_provenance(report, prov))
    return 0
    return 0
