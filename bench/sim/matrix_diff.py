"""One system's robustness-matrix figures in two runs, cell by cell: what a change of the default did.

``python -m bench.sim.matrix_diff BEFORE.json AFTER.json [--system SkyLB] [--seeds 3,4]``: two ``matrix.json`` files
written by ``skylb bench matrix`` (bench/sim/matrix.py), e.g. the committed one and a run of a changed checkout;
``--seeds`` keeps those seeds' runs only (the seeds both files ran). Prints a
Markdown table, one row per cell both hold: the mean over the seeds of P90 TTFT (s), throughput (req/s) and prefix
hit rate (%) before and after, and the after/before ratios; then the geometric means of the ratios and how many
cells moved by more than 3% (P90) or 1% (throughput). Cells whose figures are equal to the last digit are those the
change did not reach.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

__all__ = ["cell_means", "diff_rows", "render", "main"]


def cell_means(path: Path, system: str, seeds: set[int] | None = None) -> dict[str, tuple[float, float, float, int]]:
    """Cell -> (mean P90 TTFT s, mean throughput req/s, mean hit rate 0-1, seeds) of ``system``'s per-seed runs in
    the matrix.json at ``path`` (the per-seed rows, not the report's means), of ``seeds`` only when given."""
    runs: dict[str, list[dict]] = {}
    for run in json.loads(Path(path).read_text())["runs"]:
        if run["system"] == system and isinstance(run.get("seed"), int) and (seeds is None or run["seed"] in seeds):
            runs.setdefault(run["scenario"], []).append(run)
    return {cell: (statistics.fmean(r["ttft_p90"] for r in rs), statistics.fmean(r["throughput_rps"] for r in rs),
                   statistics.fmean(r["hit_rate"] for r in rs), len(rs)) for cell, rs in runs.items()}


def _order(cell: str) -> tuple[str, float]:
    workload, load = cell.rsplit("@", 1)
    return workload, float(load.rstrip("x"))


def diff_rows(before: dict, after: dict) -> list[tuple[str, tuple, tuple]]:
    """(cell, before figures, after figures) for the cells both runs hold, by workload then load."""
    return [(cell, before[cell], after[cell]) for cell in sorted(set(before) & set(after), key=_order)]


def render(rows: list[tuple[str, tuple, tuple]]) -> str:
    """The Markdown table and its summary line (module docstring)."""
    lines = ["| cell | P90 TTFT s before -> after | ratio | req/s before -> after | ratio | hit % before -> after |",
             "|---|---|---:|---|---:|---|"]
    p90s, thrs = [], []
    for cell, (p0, t0, h0, _), (p1, t1, h1, _) in rows:
        p90s.append(p1 / p0)
        thrs.append(t1 / t0)
        lines.append(f"| {cell} | {p0:.2f} -> {p1:.2f} | {p1 / p0:.3f} | {t0:.2f} -> {t1:.2f} | {t1 / t0:.3f} | "
                     f"{100 * h0:.1f} -> {100 * h1:.1f} |")

    def geo(xs):
        return math.exp(statistics.fmean(math.log(x) for x in xs))

    lines += ["", f"Geometric mean over {len(rows)} cells: P90 TTFT {geo(p90s):.3f}, throughput {geo(thrs):.3f}; "
                  f"P90 lower by more than 3% in {sum(r < 0.97 for r in p90s)}, higher in "
                  f"{sum(r > 1.03 for r in p90s)}; throughput lower by more than 1% in {sum(r < 0.99 for r in thrs)}, "
                  f"higher in {sum(r > 1.01 for r in thrs)}; unchanged (same figures) in "
                  f"{sum(b == a for _, b, a in rows)}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); 2 when the files share no cell of the system."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim.matrix_diff", description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--system", default="SkyLB", help="the system compared (default: %(default)s)")
    parser.add_argument("--seeds", type=lambda text: {int(x) for x in text.split(",")}, default=None,
                        help="comma-separated seeds to keep (default: every seed of each file)")
    args = parser.parse_args(argv)
    rows = diff_rows(cell_means(args.before, args.system, args.seeds), cell_means(args.after, args.system, args.seeds))
    if not rows:
        print(f"no cell of {args.system} in both files", file=sys.stderr)
        return 2
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
