"""Does the simulated world look like the paper's? The calibration table, and the load sweep around it.

Source: SkyLB paper §5.1 (Fig. 8 text: prefix hit rates, outstanding-request variance, P90 TTFT) and §3.3 (the
capacity of one L4). Each cell the paper gives for its deployment is set beside the simulated figure of the same
system in the calibrated regime (bench/sim/regime.yaml). A cell counts as matched when every simulated value lies in
the paper's range, or within :data:`TOLERANCE` of it (``[lo x 0.75, hi x 1.25]``); a cell outside says why, from
the runs. Only then are SkyLB's targets read (bench/sim/scenarios.py ``evaluate_targets``).

How the paper's cells are read:

* hit rates "RR 10.78-16.57%, LL 28.29-31.13%, GKE Gateway 18.08-24.30%, SkyLB 36.96-46.55%": one range over
  ChatBot Arena and WildChat together; each dataset's simulated value is checked against it.
* "replicas experience high variance in outstanding request counts, ranging from 2.33-5.08x for SGL and
  2.54-4.92x for CH": read as the baseline's variance of outstanding requests across replicas divided by SkyLB's.
* "The P90 latency, largely determined by queuing delays, can reach several seconds": read as the worst
  single-balancer baseline's P90 TTFT per dataset lying in [2 s, 9 s] ("several": more than two, fewer than ten).
* "the max number of outstanding requests can range from 20 to 50" (§3.3): the outstanding count at which requests
  first wait on one simulated replica (bench/sim/capacity.py), when that sweep has run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.replay.report import markdown_table
from bench.sim.metrics import RunSummary

__all__ = ["TOLERANCE", "Cell", "CELLS", "CalibrationRow", "calibration_rows", "calibration_markdown",
           "sweep_rows", "sweep_markdown"]

#: A simulated value within this fraction outside the paper's range still matches (declared before any run).
TOLERANCE = 0.25
#: The datasets whose cells the paper gives (Fig. 8a/b).
DATASETS = ("arena", "wildchat")


@dataclass(frozen=True)
class Cell:
    """One figure the paper states: ``lo``-``hi`` in ``unit``; ``values(rows)`` gives (label, simulated value) per
    dataset from ``rows`` (scenario -> system -> RunSummary), skipping what did not run."""

    name: str
    lo: float
    hi: float
    unit: str
    values: Callable[[dict[str, dict[str, RunSummary]]], list[tuple[str, float]]]
    why: Callable[[dict[str, dict[str, RunSummary]]], str]


def _hit(system: str) -> Callable:
    return lambda rows: [(d, rows[d][system].hit_rate) for d in DATASETS if system in rows.get(d, {})]


def _hit_why(system: str) -> Callable:
    def why(rows):
        parts = []
        for d in DATASETS:
            r = rows.get(d, {}).get(system)
            if r is not None:
                parts.append(f"{d}: ideal hit {r.ideal_hit_rate:.0%} (KV-bounded {r.ideal_kv_hit_rate:.0%}), "
                             f"KV used {r.kv_usage_mean:.0%}, pending per replica {r.pending_mean:.2f}")
        return "; ".join(parts)
    return why


def _var_ratio(system: str) -> Callable:
    return lambda rows: [(d, rows[d][system].outstanding_var / rows[d]["SkyLB"].outstanding_var)
                         for d in DATASETS if system in rows.get(d, {}) and "SkyLB" in rows.get(d, {})
                         and rows[d]["SkyLB"].outstanding_var > 0]


def _var_why(system: str) -> Callable:
    def why(rows):
        return "; ".join(f"{d}: variance {system} {rows[d][system].outstanding_var:.2f} vs SkyLB "
                         f"{rows[d]['SkyLB'].outstanding_var:.2f}, pending per replica {system} "
                         f"{rows[d][system].pending_mean:.2f}, queued at SkyLB's balancers "
                         f"{rows[d]['SkyLB'].queue_mean:.1f}"
                         for d in DATASETS if system in rows.get(d, {}) and "SkyLB" in rows.get(d, {}))
    return why


_BASELINES = ("RR", "LL", "CH", "SGL", "GKE")


def _worst_p90(rows):
    out = []
    for d in DATASETS:
        base = [rows[d][b] for b in _BASELINES if b in rows.get(d, {})]
        if base:
            out.append((f"{d} ({max(base, key=lambda r: r.ttft_p90).system})", max(r.ttft_p90 for r in base)))
    return out


def _p90_why(rows):
    parts = []
    for d in DATASETS:
        base = [rows[d][b] for b in _BASELINES if b in rows.get(d, {})]
        if base:
            w = max(base, key=lambda r: r.ttft_p90)
            parts.append(f"{d}: {w.system} pending per replica {w.pending_mean:.2f}, KV used {w.kv_usage_mean:.0%}, "
                         f"network in TTFT {w.network_mean:.2f} s")
    return "; ".join(parts)


#: The paper's cells (module docstring), in the report's order.
CELLS: tuple[Cell, ...] = (
    Cell("prefix hit rate, RR", 0.1078, 0.1657, "%", _hit("RR"), _hit_why("RR")),
    Cell("prefix hit rate, LL", 0.2829, 0.3113, "%", _hit("LL"), _hit_why("LL")),
    Cell("prefix hit rate, per-region gateway (GKE)", 0.1808, 0.2430, "%", _hit("GKE"), _hit_why("GKE")),
    Cell("prefix hit rate, SkyLB", 0.3696, 0.4655, "%", _hit("SkyLB"), _hit_why("SkyLB")),
    Cell("outstanding variance, SGL / SkyLB", 2.33, 5.08, "x", _var_ratio("SGL"), _var_why("SGL")),
    Cell("outstanding variance, CH / SkyLB", 2.54, 4.92, "x", _var_ratio("CH"), _var_why("CH")),
    Cell("P90 TTFT of the worst single balancer ('several seconds')", 2.0, 9.0, "s", _worst_p90, _p90_why),
)


@dataclass(frozen=True)
class CalibrationRow:
    """One cell beside the simulation: ``verdict`` is "in range", "within 25%", "outside" or "not run"."""

    cell: str
    paper: str
    simulated: str
    verdict: str
    why: str = ""


def _fmt(value: float, unit: str) -> str:
    return f"{value:.1%}" if unit == "%" else f"{value:.2f}{' s' if unit == 's' else 'x' if unit == 'x' else ''}"


def _verdict(values: Sequence[float], lo: float, hi: float) -> str:
    if not values:
        return "not run"
    if all(lo <= v <= hi for v in values):
        return "in range"
    if all(lo * (1 - TOLERANCE) <= v <= hi * (1 + TOLERANCE) for v in values):
        return "within 25%"
    return "outside"


def calibration_rows(results: Sequence[RunSummary],
                     capacity: tuple[list[tuple[str, float]], str] | None = None) -> list[CalibrationRow]:
    """The calibration table of ``results`` (means over seeds); ``capacity``: ([(dataset, outstanding count at
    first wait)], how it was measured) from bench/sim/capacity.py ``first_wait_outstanding``, or None when the
    sweep did not run."""
    rows: dict[str, dict[str, RunSummary]] = {}
    for r in results:
        if r.scenario in DATASETS:
            rows.setdefault(r.scenario, {})[r.system] = r
    out = []
    for cell in CELLS:
        values = cell.values(rows)
        verdict = _verdict([v for _, v in values], cell.lo, cell.hi)
        paper = f"{_fmt(cell.lo, cell.unit)} - {_fmt(cell.hi, cell.unit)}"
        sim = ", ".join(f"{label} {_fmt(v, cell.unit)}" for label, v in values) or "-"
        out.append(CalibrationRow(cell.name, paper, sim, verdict, cell.why(rows) if verdict == "outside" else ""))
    if capacity is not None:
        values, how = capacity
        verdict = _verdict([v for _, v in values], 20, 50)
        out.append(CalibrationRow("outstanding requests one L4 holds (§3.3)", "20 - 50",
                                  ", ".join(f"{label} {v:.0f}" for label, v in values), verdict, how))
    else:
        out.append(CalibrationRow("outstanding requests one L4 holds (§3.3)", "20 - 50", "-", "not run",
                                  "the capacity sweep (bench/sim/capacity.py) did not run"))
    return out


def calibration_markdown(rows: Sequence[CalibrationRow]) -> str:
    """The calibration table as Markdown, with a count of cells matched."""
    matched = sum(r.verdict in ("in range", "within 25%") for r in rows)
    table = markdown_table(["paper cell", "paper", "simulated", "verdict", "why (when outside)"],
                           [[r.cell, r.paper, r.simulated, f"**{r.verdict}**" if r.verdict == "outside"
                             else r.verdict, r.why] for r in rows])
    return f"{table}\n\n{matched} of {len(rows)} cells matched (in the paper's range or within 25% of it)."


def sweep_rows(results: Sequence[RunSummary], workload: str, loads: Sequence[float],
               name_of: Callable[[str, float], str], baselines: Sequence[str]) -> list[dict]:
    """Per load of the sweep: SkyLB's throughput and P90 TTFT beside the best single balancer's (by throughput,
    and by P90) and the per-region gateway's. Returns one dict per load that ran: ``load``, ``sky``,
    ``best_tput`` / ``best_p90`` (RunSummary), ``gke`` (or None), ``tput_ratio``, ``p90_ratio``, ``gke_ratio``."""
    out = []
    for load in loads:
        rows = {r.system: r for r in results if r.scenario == name_of(workload, load)}
        singles = [rows[b] for b in baselines if b in rows]
        if "SkyLB" not in rows or not singles:
            continue
        sky = rows["SkyLB"]
        best_t = max(singles, key=lambda r: r.throughput_rps)
        best_p = min(singles, key=lambda r: r.ttft_p90)
        gke = rows.get("GKE")
        out.append({"load": load, "sky": sky, "best_tput": best_t, "best_p90": best_p, "gke": gke,
                    "tput_ratio": sky.throughput_rps / best_t.throughput_rps,
                    "p90_ratio": sky.ttft_p90 / best_p.ttft_p90,
                    "gke_ratio": sky.throughput_rps / gke.throughput_rps if gke else None})
    return out


def _spread(r: RunSummary, metric: str, fmt: str) -> str:
    lo_hi = r.spread.get(metric)
    value = fmt.format(getattr(r, metric))
    return f"{value} [{fmt.format(lo_hi[0])}, {fmt.format(lo_hi[1])}]" if lo_hi else value


def sweep_markdown(rows: Sequence[dict]) -> str:
    """The sweep of one workload as Markdown: per load, SkyLB beside the best single balancer, with spreads over
    seeds, and whether the paper's Fig. 8 targets (>= 1.12x throughput, <= 0.25x P90 TTFT, >= 1.43x the gateway's
    throughput) hold there."""
    table = []
    for row in rows:
        sky, bt, bp, gke = row["sky"], row["best_tput"], row["best_p90"], row["gke"]
        table.append([f"{row['load']:g}x", _spread(sky, "throughput_rps", "{:.2f}"),
                      f"{bt.system} {_spread(bt, 'throughput_rps', '{:.2f}')}",
                      f"{row['tput_ratio']:.2f}x" + (" (met)" if row["tput_ratio"] >= 1.12 else ""),
                      _spread(sky, "ttft_p90", "{:.2f}"), f"{bp.system} {_spread(bp, 'ttft_p90', '{:.2f}')}",
                      f"{row['p90_ratio']:.2f}x" + (" (met)" if row["p90_ratio"] <= 0.25 else ""),
                      "-" if gke is None else f"{row['gke_ratio']:.2f}x" + (" (met)" if row["gke_ratio"] >= 1.43
                                                                           else "")])
    return markdown_table(["load", "SkyLB req/s", "best single req/s", "ratio (>= 1.12x)", "SkyLB P90 TTFT s",
                           "best single P90 s", "ratio (<= 0.25x)", "vs GKE req/s (>= 1.43x)"], table)
