"""The robustness matrix's verdicts and report: per cell the default's ratios to the best other system and to the
oracle, the acceptance checks, bench/results/matrix.md, matrix.json and the heat map matrix.png.

Every figure is computed from the runs (bench/sim/matrix.py, one RunSummary per run; per cell and system the mean
over seeds with [min, max], bench/sim/metrics.py ``aggregate``). Per cell, on the means:

* the default's (``SkyLB``) P90 TTFT over the best OTHER system's (the lowest P90 among every system but the default
  and the oracle), its throughput (req/s) over the best other's (the highest), and its P90 over the oracle's;
* check 1: the default first or within 3% of the best other on P90 (ratio <= 1.03) and on throughput
  (ratio >= 0.97), and its P90 within 1.15x the oracle's;
* check 2, only where the best single balancer (RR, LL, CH, SGL; the lowest P90 among them) has a P90 of 2 s or
  more: the default's P90 <= 0.5x that one's and its throughput >= 1.12x the best single balancer's (the highest);
* check 3, over all cells: for every single balancer, the mean over cells of the default's P90 over that balancer's
  is below 1.

A check that does not apply (no oracle run, no single balancer at 2 s) is "n/a", never met. Check 2's clauses are
also judged on the oracle's own figures (``oracle_check2``), and check 1's on every rule run alone
(``check1_rules``: each system and each of the oracle's candidate rules, with the oracle's fresh view and free
network, must meet the P90 and the throughput lines at once on its own figures, where the oracle takes each figure
from its best candidate), to tell how far each check is attainable by placement at all in each cell.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.replay.report import markdown_table, with_provenance
from bench.sim.matrix import DEFAULT, SINGLES, WORKLOADS, parse_cell
from bench.sim.metrics import RunSummary, spread_text

__all__ = ["CellVerdict", "verdicts", "mean_single_ratios", "first_loaded", "render_markdown", "write_report",
           "P90_TOLERANCE", "THROUGHPUT_TOLERANCE", "ORACLE_LIMIT", "LOADED_P90_S", "LOADED_P90_RATIO",
           "LOADED_THROUGHPUT_RATIO"]

#: Check 1: "first or within 3%" of the best other system, and within 1.15x the oracle's P90.
P90_TOLERANCE = THROUGHPUT_TOLERANCE = 0.03
ORACLE_LIMIT = 1.15
#: Check 2: where the best single balancer's P90 TTFT is at least 2 s: <= 0.5x its P90, >= 1.12x its throughput.
LOADED_P90_S, LOADED_P90_RATIO, LOADED_THROUGHPUT_RATIO = 2.0, 0.5, 1.12
#: How an oracle candidate is named among ``CellVerdict.check1_rules`` (systems go by their own names).
ORACLE_RULE = "Oracle/"


@dataclass
class CellVerdict:
    """One cell (workload x load): the default's ratios (means over seeds) and its checks (None: not applicable).

    ``best_p90`` / ``best_tput``: the best other system on P90 (lowest) and on throughput (highest);
    ``single_p90`` / ``single_tput``: the same among the single balancers. ``oracle_check2``: check 2's clauses on
    the oracle's P90 and throughput instead of the default's (None: check 2 does not apply or no oracle ran);
    ``oracle_single_p90_ratio`` / ``oracle_single_tput_ratio``: the oracle's P90 and throughput over the best single
    balancer's where check 2 applies. ``oracle_check1``: the oracle's candidate rules whose own figures (means over
    seeds) meet check 1 in this cell, sorted (None: no oracle candidates ran). ``check1_rules``: every rule whose own
    figures meet check 1 here: the systems by name (the default included) and the oracle's candidates as
    "Oracle/<policy>" (None: no oracle ran).
    """

    workload: str
    load: float
    default_p90: float
    default_tput: float
    best_p90: str
    p90_ratio: float
    best_tput: str
    tput_ratio: float
    oracle_ratio: float | None
    single_p90: str | None
    single_p90_s: float | None
    single_p90_ratio: float | None
    single_tput: str | None
    single_tput_ratio: float | None
    check1: bool
    check1_parts: dict[str, bool | None] = field(default_factory=dict)
    check2: bool | None = None
    oracle_check2: bool | None = None
    oracle_single_p90_ratio: float | None = None
    oracle_single_tput_ratio: float | None = None
    oracle_check1: list[str] | None = None
    check1_rules: list[str] | None = None

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return dict(self.__dict__)


def _verdict(workload: str, load: float, rows: dict[str, RunSummary]) -> CellVerdict | None:
    """The verdict of one cell, or None without the default or any other system."""
    sky = rows.get(DEFAULT)
    others = [r for s, r in rows.items() if s not in (DEFAULT, "Oracle")]
    if sky is None or not others:
        return None
    best_p = min(others, key=lambda r: r.ttft_p90)
    best_t = max(others, key=lambda r: r.throughput_rps)
    p90_ratio, tput_ratio = sky.ttft_p90 / best_p.ttft_p90, sky.throughput_rps / best_t.throughput_rps
    orc = rows.get("Oracle")
    oracle_ratio = sky.ttft_p90 / orc.ttft_p90 if orc else None
    parts = {"p90": p90_ratio <= 1 + P90_TOLERANCE, "throughput": tput_ratio >= 1 - THROUGHPUT_TOLERANCE,
             "oracle": None if oracle_ratio is None else oracle_ratio <= ORACLE_LIMIT}
    singles = [rows[s] for s in SINGLES if s in rows]
    sp = min(singles, key=lambda r: r.ttft_p90) if singles else None
    st = max(singles, key=lambda r: r.throughput_rps) if singles else None
    sp_ratio = sky.ttft_p90 / sp.ttft_p90 if sp else None
    st_ratio = sky.throughput_rps / st.throughput_rps if st else None
    check2 = oracle_check2 = orc_p90_ratio = orc_tput_ratio = None
    if sp is not None and sp.ttft_p90 >= LOADED_P90_S:
        check2 = sp_ratio <= LOADED_P90_RATIO and st_ratio >= LOADED_THROUGHPUT_RATIO
        if orc is not None:
            orc_p90_ratio, orc_tput_ratio = orc.ttft_p90 / sp.ttft_p90, orc.throughput_rps / st.throughput_rps
            oracle_check2 = orc_p90_ratio <= LOADED_P90_RATIO and orc_tput_ratio >= LOADED_THROUGHPUT_RATIO
    oracle_check1 = check1_rules = None
    if orc is not None:
        def alone(p90: float, tput: float) -> bool:
            return (p90 <= (1 + P90_TOLERANCE) * best_p.ttft_p90 and p90 <= ORACLE_LIMIT * orc.ttft_p90
                    and tput >= (1 - THROUGHPUT_TOLERANCE) * best_t.throughput_rps)
        oracle_check1 = sorted(n for n, c in orc.candidates.items() if alone(c["ttft_p90"], c["throughput_rps"]))
        check1_rules = [s for s, r in rows.items() if s != "Oracle" and alone(r.ttft_p90, r.throughput_rps)]
        check1_rules = sorted(check1_rules) + [ORACLE_RULE + n for n in oracle_check1]
        oracle_check1 = oracle_check1 if orc.candidates else None
    return CellVerdict(workload, load, sky.ttft_p90, sky.throughput_rps, best_p.system, p90_ratio, best_t.system,
                       tput_ratio, oracle_ratio, sp.system if sp else None, sp.ttft_p90 if sp else None, sp_ratio,
                       st.system if st else None, st_ratio,
                       all(v for v in parts.values() if v is not None), parts, check2, oracle_check2,
                       orc_p90_ratio, orc_tput_ratio, oracle_check1, check1_rules)


def verdicts(results: Sequence[RunSummary]) -> list[CellVerdict]:
    """One verdict per cell of ``results`` (aggregated over seeds; ``scenario`` = "workload@loadx"), ordered by
    workload (bench/sim/matrix.py ``WORKLOADS`` order) then load."""
    cells: dict[tuple[str, float], dict[str, RunSummary]] = {}
    for r in results:
        cells.setdefault(parse_cell(r.scenario), {})[r.system] = r
    order = {w: i for i, w in enumerate(WORKLOADS)}
    out = [_verdict(w, x, rows) for (w, x), rows in sorted(cells.items(), key=lambda kv: (order.get(kv[0][0], 99),
                                                                                          kv[0][1]))]
    return [v for v in out if v is not None]


def mean_single_ratios(results: Sequence[RunSummary]) -> dict[str, float]:
    """Check 3's figures: per single balancer, the mean over the cells where both ran of the default's P90 over its
    P90."""
    by = {(r.scenario, r.system): r for r in results}
    out = {}
    for s in SINGLES:
        ratios = [by[(c, DEFAULT)].ttft_p90 / r.ttft_p90 for (c, name), r in by.items()
                  if name == s and (c, DEFAULT) in by]
        if ratios:
            out[s] = sum(ratios) / len(ratios)
    return out


def first_loaded(cells: Sequence[CellVerdict]) -> dict[str, float | None]:
    """Per workload, the lowest load at which the best single balancer's P90 TTFT is >= 2 s (None: at no load run)."""
    out: dict[str, float | None] = {}
    for v in cells:
        out.setdefault(v.workload, None)
        if out[v.workload] is None and v.single_p90_s is not None and v.single_p90_s >= LOADED_P90_S:
            out[v.workload] = v.load
    return out


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _checks_section(cells: Sequence[CellVerdict], singles: dict[str, float]) -> list[str]:
    """Each check's count of met / missed / n/a cells and the cells that missed."""
    lines = ["## Acceptance checks (means over seeds)", ""]
    for n, name, values in (
            (1, f"default first or within {P90_TOLERANCE:.0%} of the best other system on P90 TTFT and on "
                f"throughput, and P90 within {ORACLE_LIMIT:g}x the oracle's", [v.check1 for v in cells]),
            (2, f"where the best single balancer's P90 >= {LOADED_P90_S:g} s: default P90 <= {LOADED_P90_RATIO:g}x "
                f"its and throughput >= {LOADED_THROUGHPUT_RATIO:g}x", [v.check2 for v in cells])):
        met = sum(x is True for x in values)
        missed = [f"{v.workload}@{v.load:g}x" for v, x in zip(cells, values) if x is False]
        na = sum(x is None for x in values)
        lines.append(f"- Check {n} ({name}): met in {met} of {met + len(missed)} cells"
                     + (f", {na} n/a" if na else "") + (f"; missed in {', '.join(missed)}" if missed else "") + ".")
    ruled = [v for v in cells if v.check1_rules is not None]
    if ruled:
        none = [f"{v.workload}@{v.load:g}x" for v in ruled if not v.check1_rules]
        lines.append(f"- Check 1 by one rule alone (every system, and each of the oracle's candidate rules with the "
                     f"oracle's fresh view and free network, judged on its own figures): met by at least one rule in "
                     f"{len(ruled) - len(none)} of {len(ruled)} cells (by the oracle's candidates in "
                     f"{sum(bool(v.oracle_check1) for v in ruled)}, the default in {sum(v.check1 for v in ruled)}); "
                     f"by none in {len(none)}" + (f" ({', '.join(none)})" if none else "")
                     + ". The oracle takes its P90 and its throughput from whichever candidate is best at each; in "
                     "the cells met by none, no rule run here reaches both lines at once.")
        missed = [v for v in ruled if not v.check1]
        by = [(v, [r for r in v.check1_rules if not r.startswith(ORACLE_RULE)]) for v in missed]
        deployable = [f"{v.workload}@{v.load:g}x ({', '.join(systems)})" for v, systems in by if systems]
        oracle_only = [f"{v.workload}@{v.load:g}x" for v, systems in by if v.check1_rules and not systems]
        lines.append(f"- Of the default's {len(missed)} missed cells, another system (a balancer that can be "
                     f"deployed) meets check 1 alone in {len(deployable)}"
                     + (f": {', '.join(deployable)}" if deployable else "")
                     + f"; only an oracle candidate (its fresh global view and free network) in {len(oracle_only)}"
                     + (f": {', '.join(oracle_only)}" if oracle_only else "") + ".")
    judged = [v for v in cells if v.oracle_check2 is not None]
    if judged:
        met = [f"{v.workload}@{v.load:g}x" for v in judged if v.oracle_check2]
        p90s = [v.oracle_single_p90_ratio for v in judged]
        tputs = [v.oracle_single_tput_ratio for v in judged]
        short = sum(x < LOADED_THROUGHPUT_RATIO for x in tputs)
        lines.append(f"- The oracle's own figures meet check 2 in {len(met)} of those {len(judged)} cells"
                     + (f" ({', '.join(met)})" if met else "") + ": how far placement alone can reach it. Over the "
                     f"best single balancer's, its P90 is {min(p90s):.2f}-{max(p90s):.2f}x and its throughput "
                     f"{min(tputs):.2f}-{max(tputs):.2f}x (below {LOADED_THROUGHPUT_RATIO:g}x in {short} of the "
                     f"{len(judged)}).")
    ok = bool(singles) and all(x < 1.0 for x in singles.values())
    lines.append("- Check 3 (mean over cells of the default's P90 over each single balancer's, below 1 for every "
                 "one): " + ", ".join(f"{s} {x:.2f}x" for s, x in singles.items()) + f": {_mark(ok)}."
                 if singles else "- Check 3: n/a (no single balancer ran).")
    return lines + [""]


def _cells_table(cells: Sequence[CellVerdict]) -> str:
    """One row per cell: the default's P90 and throughput ratios, the oracle ratio, the best single, the checks."""
    body = [[v.workload, f"{v.load:g}x", f"{v.default_p90:.2f}", f"{v.best_p90} {_x(v.p90_ratio)}",
             f"{v.default_tput:.2f}", f"{v.best_tput} {_x(v.tput_ratio)}", _x(v.oracle_ratio),
             f"{v.single_p90} {v.single_p90_s:.2f}" if v.single_p90 else "n/a",
             _mark(v.check1) + ("" if v.check1 else " (" + ", ".join(k for k, ok in v.check1_parts.items()
                                                                      if ok is False) + ")"),
             _mark(v.check2)] for v in cells]
    return markdown_table(["workload", "load", "default P90 s", "P90 ratio to the best other", "default req/s",
                           "req/s ratio to the best other", "P90 / oracle", "best single P90 s", "check 1",
                           "check 2"], body)


def _detail(results: Sequence[RunSummary], cells: Sequence[CellVerdict], systems: Sequence[str]) -> list[str]:
    """Per cell, every system's P90 and mean TTFT, throughput, hit rate and forwarded fraction (mean [min, max]).
    The mean beside the P90 shows a tail the P90 does not: a region's clients waiting seconds while most requests
    do not (bench/results/asymmetric_regions.md)."""
    by = {(r.scenario, r.system): r for r in results}
    lines = ["## Every cell, every system (mean [min, max] over seeds)", ""]
    for v in cells:
        name = f"{v.workload}@{v.load:g}x"
        rows = [by[(name, s)] for s in systems if (name, s) in by]
        lines += [f"### {name}", "", markdown_table(
            ["system", "P90 TTFT s", "mean TTFT s", "req/s", "prefix hit rate", "forwarded"],
            [[r.system, spread_text(r, "ttft_p90"), spread_text(r, "ttft_mean"), spread_text(r, "throughput_rps"),
              spread_text(r, "hit_rate", "{:.1%}"), spread_text(r, "forwarded_frac", "{:.1%}")] for r in rows]), ""]
    return lines


def render_markdown(saved: dict, results: Sequence[RunSummary], *, plot: str | None) -> str:
    """The report from ``saved`` (matrix.json's header: command, seeds, split, times, 1x rates) and the aggregated
    ``results``; ``plot``: the heat map's file name (None when matplotlib is missing)."""
    from bench.sim import matrix, workloads_extra
    cells = verdicts(results)
    systems = saved["systems"]
    lines = [f"# Robustness matrix: the default routing policy ({DEFAULT}) across workloads and loads", "",
             f"Produced by `{saved['command']}` in {saved['wall_s']:.0f} s of wall time on {saved['jobs']} worker "
             f"process(es) ({os.cpu_count()} CPUs, Python {platform.python_version()}); {len(saved['runs'])} runs. "
             "Every number is simulated (bench/sim: the routing core the live balancer runs, the engine model of "
             "bench/emulator/model.py, simulated time); what each workload, load and system is: "
             "bench/sim/matrix.py.", "",
             f"**Seeds and split.** Split `{saved['split']}`, seeds {', '.join(map(str, saved['seeds']))}; each "
             "figure is the mean over the seeds, with [min, max] in the tables at the end. Trace windows: dev from "
             "the trace's start (inside its first 40 minutes), val from minute 40.", "",
             "**Time.** Simulated seconds during which requests are sent, and from when they are measured: "
             + "; ".join(f"{kind} {stop:g} s from {warm:g} s" for kind, (stop, warm) in saved["times"].items())
             + ".", "",
             f"**Systems.** {', '.join(systems)}. Best other: every system but the default and the oracle; single "
             f"balancers: {', '.join(SINGLES)}.", ""]
    if saved.get("counts"):
        lines += [f"**Replicas per region.** {', '.join(f'{r} {n}' for r, n in saved['counts'].items())} for every "
                  "workload (`--counts`), instead of each workload's own (bench/sim/matrix.py); the clients are "
                  "the workload's, and an open-loop workload's 1x is its own deployment's rate.", ""]
    if saved.get("schedule_policy"):
        order = {"lpm": "longest prefix match first", "fcfs": "first come, first served"}[saved["schedule_policy"]]
        lines += [f"**Engine scheduling.** Every simulated engine takes its waiting queue {order} "
                  f"(`--schedule-policy {saved['schedule_policy']}`), instead of the calibrated regime's order "
                  "(bench/sim/regime.yaml); the loads are the regime's.", ""]
    if saved.get("options"):
        given = ", ".join(f"`{k}={v!r}`" for k, v in sorted(saved["options"].items()))
        lines += [f"**Policy options.** The default's routing policy ran with {given} (`--option`), wherever it "
                  "ran in the runs of that command; the other runs are as the command line of each says.", ""]
    lines += _checks_section(cells, mean_single_ratios(results))
    if plot:
        lines += ["## Heat map", "", f"![default P90 over the best other system's]({plot})", ""]
    lines += ["## Cells", "", _cells_table(cells), ""]
    loaded = first_loaded(cells)
    lines += ["## Where single balancers queue for seconds", "", markdown_table(
        ["workload", "what 1x is", "first load with the best single balancer's P90 >= 2 s"],
        [[w, saved["one_x"].get(w, WORKLOADS[w].one_x), "not reached" if x is None else f"{x:g}x"]
         for w, x in loaded.items()]), ""]
    lines += _detail(results, cells, systems)
    lines += ["## Definitions", "", "```", (matrix.__doc__ or "").strip(), "```", ""]
    lines += ["## The generated workloads", "", "```", (workloads_extra.__doc__ or "").strip(), "```", ""]
    return "\n".join(lines)


def _one_x(workloads: Sequence[str]) -> dict[str, str]:
    """What 1x is for each workload, with the computed rate of the generated open-loop ones."""
    from bench.sim.matrix import one_x_rps
    return {w: WORKLOADS[w].one_x + (f": {one_x_rps(w):.2f} req/s" if WORKLOADS[w].kind == "open" else "")
            for w in workloads}


def replace_systems(saved: dict, rerun: dict) -> dict:
    """``saved`` (a matrix.json's content) with the runs of every system in ``rerun`` (another one's) replaced by
    ``rerun``'s: its provenance becomes the rerun's (the code of the newest runs) and its command records both.

    Raises:
        ValueError: the two differ in split, seeds, replicas per region, engine scheduling or simulated time
            (``--quick``), or ``rerun`` has no runs.
    """
    for key in ("split", "seeds", "counts", "schedule_policy", "quick", "times"):
        if saved.get(key) != rerun.get(key):
            raise ValueError(f"the rerun's {key} ({rerun.get(key)}) is not the saved matrix's ({saved.get(key)})")
    systems = {r["system"] for r in rerun["runs"]}
    if not systems:
        raise ValueError("the rerun has no runs")
    prov = rerun["provenance"]
    when = f"{rerun['wall_s']:.0f} s, {prov.get('date', '')[:10]}, at {str(prov.get('commit', ''))[:7]}"
    merged = {k: v for k, v in saved.items() if k not in ("results", "cells", "checks", "first_loaded")}
    merged.update(runs=[r for r in saved["runs"] if r["system"] not in systems] + rerun["runs"],
                  systems=list(dict.fromkeys([*saved.get("systems", []), *sorted(systems)])),
                  provenance=prov, wall_s=saved["wall_s"] + rerun["wall_s"],
                  command=f"{rerun['command']} ({when}); earlier, replaced for {', '.join(sorted(systems))}: "
                          f"{saved['command']}")
    if rerun.get("options"):  # the default's policy options of the rerun (``--option``); the rest kept its runs
        merged["options"] = rerun["options"]
    return merged


def write_report(saved: dict, out: Path) -> Path:
    """Write ``out``/matrix.json (``saved`` with the aggregated results, the verdicts and the checks), the heat map
    matrix.png (when matplotlib is installed) and matrix.md; returns the Markdown's path. ``saved``: provenance,
    command, seeds, split, systems, times (workload kind -> [stop_at, warmup_s]), wall_s, jobs and ``runs``
    (RunSummary dicts)."""
    from bench.sim.scenarios import aggregate_runs
    runs = [RunSummary(**r) for r in saved["runs"]]
    results = aggregate_runs(runs)
    cells = verdicts(results)
    singles = mean_single_ratios(results)
    workloads = list(dict.fromkeys(v.workload for v in cells))
    if "one_x" not in saved:
        saved["one_x"] = _one_x(workloads)
    saved.update(results=[r.to_dict() for r in results], cells=[v.to_dict() for v in cells],
                 checks={"check1_met": sum(v.check1 for v in cells), "check2_met": sum(v.check2 is True for v in cells),
                         "check2_applicable": sum(v.check2 is not None for v in cells),
                         "check3_mean_ratio": singles, "check3_met": bool(singles) and all(
                             x < 1 for x in singles.values())},
                 first_loaded=first_loaded(cells))
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(saved, indent=1))
    plot = None
    try:
        from bench.sim.plots import plot_matrix
    except ModuleNotFoundError as exc:  # matplotlib comes with the bench extra
        print(f"skylb bench matrix: no heat map ({exc.name} is not installed; `pip install -e '.[bench]'`)")
    else:
        if not cells:  # one system only (--systems SkyLB): no ratio to another system to draw
            print("skylb bench matrix: no heat map (it needs the default and at least one other system)")
        else:
            loads = sorted({v.load for v in cells})
            plot = plot_matrix({(v.workload, v.load): v.p90_ratio for v in cells}, workloads, loads,
                               out / "matrix.png", title=f"{DEFAULT}'s P90 TTFT over the best other system's "
                               f"(split {saved['split']}, seeds {','.join(map(str, saved['seeds']))})").name
    md = out / "matrix.md"
    md.write_text(with_provenance(render_markdown(saved, results, plot=plot), saved["provenance"]))
    return md
