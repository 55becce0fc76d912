"""Where the oracle's lead over the default comes from, per robustness-matrix cell: a stale view, pooling, or the rule.

``.venv/bin/python -m bench.sim.oracle_gap CELLS [--seeds 0] [--option KEY=VALUE ...] [--out PATH]`` (CELLS:
comma-separated matrix cells, e.g. ``tot@0.5x,multi_tenant@1x``; bench/sim/matrix.py) runs, per cell and seed, in
simulated time:

* ``SkyLB``: the default system (per-region balancers, probed view, forwarding; bench/sim/systems.py);
* the oracle's candidates (bench/sim/systems.py ``ORACLE_CANDIDATES``) in the oracle's layout: one scheduler over
  every replica, a fresh view of each (its true waiting and running counts before each placement, at most one
  placement per replica per look) and no network; the matrix's ``Oracle`` is the best of these per figure;
* the same candidates in the ``per_region_fresh`` layout: one balancer per region over that region's replicas
  only, with the oracle's fresh view, the clients' real network and no forwarding.

Reading a row: where a candidate's per-region fresh P90 is near the oracle's, pooling every replica under one
scheduler and the free network are not what the oracle gains; freshness of the view and the candidate's rule are.
Where the default's own rule is far from the best candidate in the same fresh layout, its rule (not its view) is
what loses. Each figure is P90 TTFT, s (mean over seeds), with the throughput beside it. The matrix check 1 asks
the default for at most 1.15x the oracle's P90.

``--option KEY=VALUE`` (repeatable; a Python literal) sets an option of the ``skylb`` policy for the default system
and the ``skylb`` candidate in both layouts (e.g. ``push_to_prefix_holder=False``), to see which of the default's
rules a fresh view favours or not. Writes a Markdown report (commit, date, command, machine) to ``--out`` (default:
print only).
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace

__all__ = ["LAYOUTS", "run_cell", "report", "main"]

#: The layouts compared for each oracle candidate (bench/sim/systems.py ``System.layout``).
LAYOUTS = ("global", "per_region_fresh")


def run_cell(cell: str, seed: int, split: str = "dev", options: dict | None = None
             ) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(layout, policy): (P90 TTFT s, throughput req/s)}`` of ``cell`` at ``seed``: the default system as
    ``("SkyLB", "skylb")``, every oracle candidate in each of :data:`LAYOUTS`; ``options``: the ``skylb`` policy's
    options for every run of that policy (skylb/core/policies/skylb.py ``SkyLBOptions``)."""
    from bench.sim.matrix import TIMES, WORKLOADS, parse_cell, trace_window
    from bench.sim.metrics import summarize
    from bench.sim.regime import engine_params
    from bench.sim.systems import ORACLE_CANDIDATES, SYSTEMS, System, build
    from skylb.config import BalancerConfig
    settings = (BalancerConfig.model_validate(BalancerConfig().model_dump() | {"policies": {"skylb": options}})
                if options else None)
    params = engine_params()
    name, load = parse_cell(cell)
    wl = WORKLOADS[name]
    stop_at, warmup_s = TIMES[wl.kind]
    workload = wl.make(seed, load, trace_window(split, seed), stop_at)
    runs = [("SkyLB", SYSTEMS["SkyLB"])]
    for layout in LAYOUTS:
        runs += [(layout, System(f"{layout}:{p}", f"{p} in the {layout} layout", layout, p))
                 for p in ORACLE_CANDIDATES]
    out = {}
    for layout, system in runs:
        cluster = build(replace(system, candidates=()), workload, dict(wl.counts), seed=seed, stop_at=stop_at,
                        params=params, settings=settings, replica_params=wl.replica_params(params)).run()
        s = summarize(cluster, scenario=cell, system=system.key, layout=layout, warmup_s=warmup_s, seed=seed,
                      wall_s=0.0)
        out[layout, system.policy] = (s.ttft_p90, s.throughput_rps)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report(results: dict[str, list[dict]], *, command: str, seeds: list[int]) -> str:
    """The Markdown report of ``results`` (cell -> one ``run_cell`` answer per seed)."""
    from bench.sim.systems import ORACLE_CANDIDATES
    lines = ["# Where the oracle's lead comes from (simulated)", "",
             f"Commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `{command}`; "
             f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; seeds "
             f"{', '.join(map(str, seeds))} (mean). Method: bench/sim/oracle_gap.py. P90 TTFT s / throughput req/s.",
             "", "| cell | SkyLB (default) | oracle (best candidate) | "
             + " | ".join(f"{p}: global / per-region fresh" for p in ORACLE_CANDIDATES) + " |",
             "|---|---|---|" + "---|" * len(ORACLE_CANDIDATES)]

    def mean(rows: list[dict], key: tuple[str, str]) -> tuple[float, float]:
        return (statistics.fmean(r[key][0] for r in rows), statistics.fmean(r[key][1] for r in rows))

    for cell, rows in results.items():
        sky = mean(rows, ("SkyLB", "skylb"))
        best = min(ORACLE_CANDIDATES, key=lambda p: mean(rows, ("global", p))[0])
        orc = mean(rows, ("global", best))
        cells = [f"{mean(rows, ('global', p))[0]:.2f} / {mean(rows, ('per_region_fresh', p))[0]:.2f}"
                 for p in ORACLE_CANDIDATES]
        lines.append(f"| {cell} | {sky[0]:.2f} / {sky[1]:.2f} | {orc[0]:.2f} ({best}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the cells, print (and with ``--out`` write) the report; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.oracle_gap", description=__doc__.split("\n\n")[0])
    p.add_argument("cells", help="comma-separated matrix cells, e.g. tot@0.5x,multi_tenant@1x")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--split", default="dev", choices=("dev", "val"), help="the trace windows' split (default dev)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the skylb policy (a Python literal) for the default and the skylb candidate")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    args = p.parse_args(argv)
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            p.error(f"--option {item!r}: the value is not a Python literal (True, 0.5, 'serial', ...)")
    if options:
        from pydantic import ValidationError
        from skylb.config import BalancerConfig
        try:
            BalancerConfig.model_validate(BalancerConfig().model_dump() | {"policies": {"skylb": options}})
        except ValidationError as exc:
            p.error(f"--option: {exc.errors()[0]['msg']} ({', '.join(map(str, exc.errors()[0]['loc']))})")
    from bench.sim.matrix import WORKLOADS, parse_cell
    cells = [c for c in args.cells.split(",") if c]
    for cell in cells:
        try:
            if parse_cell(cell)[0] not in WORKLOADS:
                raise ValueError(cell)
        except ValueError:
            p.error(f"not a matrix cell: {cell!r} (e.g. tot@0.5x; workloads: {', '.join(WORKLOADS)})")
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    for cell in cells:
        results[cell] = [run_cell(cell, s, args.split, options) for s in seeds]
        print(f"{cell} done", file=sys.stderr, flush=True)
    command = "python -m bench.sim.oracle_gap " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(results, command=command.strip(), seeds=seeds)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
