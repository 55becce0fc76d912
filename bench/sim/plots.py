"""PNG plots of the simulated evaluation, mirroring the SkyLB paper's Fig. 8, 9 and 10 (matplotlib, Agg backend).

* Fig. 8: service throughput (req/s) per system per workload; TTFT and E2E latency box plots (box p25-p75, red
  median, whiskers p10-p90, triangle = mean; TTFT log-scaled), as in the paper. The same layout for the Mooncake
  scenarios (1x, 2x, 3x, warm).
* Fig. 9: BP / SP-O / SP-P throughput and latency.
* Fig. 10: throughput vs replicas, SkyLB vs region-local, with the region-local 12-replica level dashed.
* The robustness matrix (bench/sim/matrix.py): a heat map of the default policy's P90 TTFT over the best other
  system's, workloads x loads, on a diverging scale centred on 1.0.

Each function takes RunSummary records (bench.sim.metrics; means over seeds, whose [min, max] become the
throughput bars' error bars; the box plots show the means of each percentile) and writes one PNG, returning its
path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from bench.sim.metrics import RunSummary  # noqa: E402

__all__ = ["plot_fig8", "plot_fig9", "plot_fig10", "plot_sweep", "plot_matrix"]

#: One colour per system, stable across figures.
COLORS = {
    "GKE": "#8c8c8c", "RR": "#1f77b4", "LL": "#ff7f0e", "CH": "#2ca02c", "SGL": "#9467bd", "SkyLB-CH": "#e377c2",
    "SkyLB": "#d62728", "SkyLB-paper": "#ff9896", "Oracle": "#17becf", "RegionLocal": "#8c564b", "BP": "#9467bd", "SP-O": "#bcbd22",
    "SP-P": "#d62728",
}


def _box_stats(r: RunSummary, metric: str) -> dict:
    """matplotlib ``bxp`` statistics from a run's percentiles (whiskers at p10 / p90, as in the paper)."""
    g = lambda k: getattr(r, f"{metric}_{k}")  # noqa: E731
    return {"label": r.system, "whislo": g("p10"), "q1": g("p25"), "med": g("p50"), "q3": g("p75"),
            "whishi": g("p90"), "mean": g("mean"), "fliers": []}


def _bars(ax, rows: Sequence[RunSummary], title: str, ylabel: str = "throughput (req/s)") -> None:
    xs = range(len(rows))
    # Error bars: min and max over seeds (a run of one seed has none).
    # Clamped at 0: the oracle's figure is the best candidate's per seed, so its mean may lie outside the spread of
    # any one candidate's values, and float rounding can leave a mean a hair below its min.
    err = [[max(0.0, r.throughput_rps - r.spread.get("throughput_rps", [r.throughput_rps] * 2)[0]) for r in rows],
           [max(0.0, r.spread.get("throughput_rps", [r.throughput_rps] * 2)[1] - r.throughput_rps) for r in rows]]
    ax.bar(xs, [r.throughput_rps for r in rows], color=[COLORS.get(r.system, "#333") for r in rows], yerr=err,
           capsize=2, error_kw={"elinewidth": 0.8})
    ax.set_xticks(list(xs), [r.system for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    top = max((r.throughput_rps for r in rows), default=1.0)
    ax.set_ylim(0, top * 1.15)
    for x, r in zip(xs, rows):
        ax.text(x, r.throughput_rps, f"{r.throughput_rps:.1f}", ha="center", va="bottom", fontsize=7)


def _boxes(ax, rows: Sequence[RunSummary], metric: str, title: str, *, log: bool) -> None:
    stats = [_box_stats(r, metric) for r in rows]
    bp = ax.bxp(stats, showmeans=True, showfliers=False, patch_artist=True,
                medianprops={"color": "red"},
                meanprops={"marker": "v", "markerfacecolor": "black", "markeredgecolor": "black", "markersize": 5})
    for patch, r in zip(bp["boxes"], rows):
        patch.set_facecolor(COLORS.get(r.system, "#333"))
        patch.set_alpha(0.6)
    ax.set_xticks(range(1, len(rows) + 1), [r.system for r in rows], rotation=45, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log")
        # plain numbers (0.2, 0.5, 1, 2) instead of 2x10^-1: seconds read at a glance
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(f"{metric.upper()} (s)", fontsize=9)
    ax.grid(axis="y", alpha=0.3, which="both")


def _ordered(results: Sequence[RunSummary], scenario: str, systems: Sequence[str]) -> list[RunSummary]:
    rows = {r.system: r for r in results if r.scenario == scenario}
    return [rows[s] for s in systems if s in rows]


def plot_fig8(results: Sequence[RunSummary], workloads: Sequence[tuple[str, str]], systems: Sequence[str],
              out: Path, title: str = "Simulated Fig. 8") -> Path:
    """Fig. 8: one column per (scenario, title) in ``workloads``; rows: throughput, TTFT (log), E2E."""
    workloads = [(w, t) for w, t in workloads if _ordered(results, w, systems)]
    n = max(len(workloads), 1)
    fig, axes = plt.subplots(3, n, figsize=(3.6 * n, 10), squeeze=False)
    for col, (wl, label) in enumerate(workloads):
        rows = _ordered(results, wl, systems)
        _bars(axes[0][col], rows, f"({chr(97 + col)}) {label}")
        _boxes(axes[1][col], rows, "ttft", f"({chr(97 + n + col)}) TTFT, {label}", log=True)
        _boxes(axes[2][col], rows, "e2e", f"({chr(97 + 2 * n + col)}) E2E, {label}", log=False)
    fig.suptitle(f"{title}: throughput, TTFT and end-to-end latency "
                 "(box p25-p75, red median, whiskers p10-p90, triangle mean)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_fig9(results: Sequence[RunSummary], scenario: str, systems: Sequence[str], out: Path,
              title: str = "") -> Path:
    """Fig. 9: throughput, TTFT (log) and E2E of BP / SP-O / SP-P in ``scenario``."""
    rows = _ordered(results, scenario, systems)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    _bars(axes[0], rows, "(a) throughput")
    _boxes(axes[1], rows, "ttft", "(b) TTFT", log=True)
    _boxes(axes[2], rows, "e2e", "(c) E2E latency", log=False)
    fig.suptitle(title or f"Simulated Fig. 9 ({scenario})", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_fig10(results: Sequence[RunSummary], scenario: str, out: Path) -> Path:
    """Fig. 10: throughput vs total replicas, SkyLB vs region-local, with the region-local 12-replica level."""
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = {}
    for system, marker in (("RegionLocal", "s"), ("SkyLB", "o")):
        pts = sorted((r.replicas, r.throughput_rps) for r in results if r.scenario == scenario and r.system == system)
        if pts:
            curves[system] = dict(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=COLORS[system],
                    label="Region-local" if system == "RegionLocal" else system)
    if 12 in curves.get("RegionLocal", {}):
        level = curves["RegionLocal"][12]
        ax.axhline(level, ls="--", color="#555", lw=1)
        ax.text(min(curves["RegionLocal"]), level, " region-local @ 12",
                va="bottom", fontsize=8, color="#555")
    ax.set_xlabel("replicas (spread evenly over us / eu / asia)")
    ax.set_ylabel("throughput (req/s)")
    ax.set_title("Simulated Fig. 10: regionally skewed load (120/40/40 clients)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_sweep(results: Sequence[RunSummary], workload: str, loads: Sequence[float], name_of, systems: Sequence[str],
               path: Path, *, title: str) -> Path:
    """The load sweep of one workload: throughput (req/s, error bars [min, max] over seeds) and P90 TTFT (s, log
    scale) against clients per region relative to the paper's, one line per system. ``name_of(workload, load)``
    names the scenario of each load."""
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for system in systems:
        xs, ys, lo, hi, p90 = [], [], [], [], []
        for load in loads:
            r = next((r for r in results if r.scenario == name_of(workload, load) and r.system == system), None)
            if r is None:
                continue
            xs.append(load)
            ys.append(r.throughput_rps)
            spread = r.spread.get("throughput_rps", [r.throughput_rps, r.throughput_rps])
            lo.append(max(0.0, r.throughput_rps - spread[0]))
            hi.append(max(0.0, spread[1] - r.throughput_rps))
            p90.append(r.ttft_p90)
        if not xs:
            continue
        color = COLORS.get(system)
        ax_t.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=system, color=color)
        ax_p.plot(xs, p90, marker="o", label=system, color=color)
    ax_t.set_xlabel("clients per region (x the paper's)")
    ax_t.set_ylabel("throughput (req/s)")
    ax_p.set_xlabel("clients per region (x the paper's)")
    ax_p.set_ylabel("P90 TTFT (s)")
    ax_p.set_yscale("log")
    ax_t.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_matrix(values: dict[tuple[str, float], float], workloads: Sequence[str], loads: Sequence[float], path: Path,
                *, title: str, label: str = "P90 TTFT ratio (< 1: the default is ahead)", limit: float = 4.0) -> Path:
    """A heat map of ``values`` ((workload, load) -> ratio): one row per workload, one column per load (x the
    workload's 1x). Colours are diverging and centred on 1.0 on a log scale (blue below, red above), saturating at
    1 / ``limit`` and ``limit``, so 0.9 and 1.1 look as far from 1 as each other; every cell prints its value; a cell
    that did not run is grey and marked "-"."""
    grid = [[values.get((w, x), float("nan")) for x in loads] for w in workloads]
    span = math.log2(limit)
    norm = TwoSlopeNorm(vmin=-span, vcenter=0.0, vmax=span)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
    logs = [[math.log2(v) if v == v and v > 0 else float("nan") for v in row] for row in grid]
    fig, ax = plt.subplots(figsize=(1.3 * len(loads) + 3.4, 0.5 * len(workloads) + 1.6))
    image = ax.imshow(logs, cmap=cmap, norm=norm, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            dark = v == v and v > 0 and abs(math.log2(v)) > 0.6 * span
            ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(loads)), [f"{x:g}x" for x in loads])
    ax.set_yticks(range(len(workloads)), list(workloads))
    ax.set_xlabel("offered load (x the workload's 1x)")
    ticks = [t for t in (0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0) if 1 / limit <= t <= limit]
    bar = fig.colorbar(image, ax=ax, label=label, ticks=[math.log2(t) for t in ticks])
    bar.ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
