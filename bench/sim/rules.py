"""Which plugin of the routing profile placed each request, and how those requests fared (simulated).

``python -m bench.sim.rules CELLS SYSTEM [SEEDS] [--by rule|region] [--jobs N] [--out-md PATH]``: comma-separated scenarios or
robustness-matrix cells (as ``bench.sim.ab`` takes them, with its ``SPLIT``, ``COUNTS`` and ``RTT_SCALE``; ``matrix``
for every cell of the robustness matrix, bench/sim/matrix.py), one system spec of bench/sim/systems.py (``SkyLB``,
``SkyLB+home_new_prefixes=False``...), seeds (default 0). For each run, the requests sent in the measurement window
grouped by the rule of their decision (``Decision.rule``: the plugin's module name, skylb/core/profile.py
``plugin_name``), ``a -> b`` for a request forwarded by rule ``a`` and placed at the peer by rule ``b``: how many,
their share, mean / P50 / P90 TTFT (s), how many of the run's slowest tenth (TTFT at or above its P90) they are, and
their prefix hit rate (cached prompt tokens / prompt tokens, the engines' counters), and where they waited before
their prefill began: in balancers' queues (the decisions' ``queued_s``, origin and peer summed) and in the engine's
own waiting queue (``FinishedRequest.queue_s``), mean s. It says which rules act on a workload and which of them
make its tail, the question to answer before changing one. ``--by region`` groups the same requests by the client's
region and the region of the replica that served them (``us -> eu``) instead: whether a region's requests wait
longer than its peers' and where (a region whose engines hold long waiting queues while its balancer's queue is
empty is overloaded in a way forwarding by queue age does not see). With ``--out-md`` the same
tables go to a report with its provenance (commit, date, command, machine), after a summary of every run: the rule
chains that make most of its slowest tenth.

:func:`rule_table` ``(cluster, window_start_s, by="rule") -> list[dict]`` is the same for a finished cluster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

from bench.replay.report import markdown_table, percentile

__all__ = ["rule_table", "main"]

_HEADERS = ["rule", "requests", "share", "mean TTFT s", "P50 s", "P90 s", "in slowest 10%", "hit rate",
            "balancer queue s", "engine queue s"]
_REGION_HEADERS = ["client region -> serving region", *_HEADERS[1:]]


def _chain(flight) -> str:
    """The rule that sent ``flight`` out of its client's region, then the peer's (or "-" without a decision)."""
    first = flight.origin_decision
    name = (first.rule or "-") if first is not None else "-"
    if flight.peer_decision is not None:
        name += " -> " + (flight.peer_decision.rule or "-")
    return name


def _regions(flight) -> str:
    """The client's region, then the region of the replica that served ``flight``."""
    return f"{flight.region} -> {flight.replica.region if flight.replica is not None else '-'}"


def _balancer_queue_s(flight) -> float:
    """Seconds ``flight`` waited in balancers' queues (the origin's and, forwarded, the peer's)."""
    return sum(d.queued_s for d in (flight.origin_decision, flight.peer_decision) if d is not None)


def rule_table(cluster, window_start_s: float, by: str = "rule") -> list[dict]:
    """One row per rule chain (``by="rule"``) or per client region -> serving region (``by="region"``; module
    docstring) over the requests sent in [``window_start_s``, the cluster's ``stop_at``), most requests first:
    {rule, requests, share, mean_s, p50_s, p90_s, in_slowest_tenth, hit_rate, balancer_queue_s, engine_queue_s}
    (``rule`` holds the group's name either way). ValueError for another ``by``."""
    if by not in ("rule", "region"):
        raise ValueError(f"group by 'rule' or 'region', not {by!r}")
    key = _chain if by == "rule" else _regions
    sent = [f for f in cluster.records if window_start_s <= f.sent_at < cluster.stop_at and f.result is not None]
    if not sent:
        return []
    # The run's P90 as bench/sim/metrics.py reads it (its ``ttft_p90``): linear between the closest ranks.
    slow = percentile([f.first_token_at - f.sent_at for f in sent], 90)
    groups = defaultdict(list)
    for f in sent:
        groups[key(f)].append(f)
    rows = []
    for name, flights in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = sorted(f.first_token_at - f.sent_at for f in flights)
        prompt = sum(f.result.prompt_tokens for f in flights)
        rows.append({"rule": name, "requests": len(flights), "share": len(flights) / len(sent),
                     "mean_s": statistics.fmean(times), "p50_s": percentile(times, 50),
                     "p90_s": percentile(times, 90),
                     "in_slowest_tenth": sum(t >= slow for t in times),
                     "hit_rate": sum(f.result.cached_tokens for f in flights) / prompt if prompt else 0.0,
                     "balancer_queue_s": statistics.fmean(map(_balancer_queue_s, flights)),
                     "engine_queue_s": statistics.fmean(f.result.queue_s for f in flights)})
    return rows


def _run(args: tuple[str, str, int, str]) -> tuple[str, int, dict, list[dict]]:
    """One run (cell, system spec, seed, grouping): (cell, seed, its headline figures, its table)."""
    from bench.sim.ab import run_cluster
    cell, spec, seed, by = args
    cluster, summary, start = run_cluster((cell, spec, seed))
    head = {"p90_s": summary.ttft_p90, "rps": summary.throughput_rps, "hit_rate": summary.hit_rate,
            "forwarded": summary.forwarded_frac}
    return cell, seed, head, rule_table(cluster, start, by)


def _table(rows: list[dict], by: str = "rule") -> str:
    return markdown_table(_HEADERS if by == "rule" else _REGION_HEADERS,
                          [[r["rule"], r["requests"], f"{r['share']:.1%}", f"{r['mean_s']:.3f}", f"{r['p50_s']:.3f}",
                            f"{r['p90_s']:.3f}", r["in_slowest_tenth"], f"{r['hit_rate']:.1%}",
                            f"{r['balancer_queue_s']:.3f}", f"{r['engine_queue_s']:.3f}"] for r in rows])


def _title(cell: str, spec: str, seed: int, head: dict) -> str:
    return (f"{cell} {spec} seed {seed}: P90 TTFT {head['p90_s']:.3f} s, {head['rps']:.2f} req/s, hit rate "
            f"{head['hit_rate']:.1%}, forwarded {head['forwarded']:.1%}")


def _tail(rows: list[dict]) -> str:
    """The groups (rule chains or regions) making the slowest tenth, most first, as "group n% (share of the
    tenth)"."""
    total = sum(r["in_slowest_tenth"] for r in rows) or 1
    top = sorted((r for r in rows if r["in_slowest_tenth"]), key=lambda r: -r["in_slowest_tenth"])[:3]
    return ", ".join(f"{r['rule']} {r['in_slowest_tenth'] / total:.0%}" for r in top)


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.rules", description=__doc__.split("\n\n")[0])
    p.add_argument("cells", help="comma-separated scenarios or matrix cells (workload@load), or 'matrix'")
    p.add_argument("system", help="a system spec of bench/sim/systems.py, e.g. SkyLB")
    p.add_argument("seeds", nargs="?", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--by", choices=("rule", "region"), default="rule",
                   help="group by the rule chain that placed each request (default), or by the client's region and "
                        "the serving replica's region")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--out-md", default=None, help="write the report here (with its provenance) instead of stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print (or write) each run's table; returns the exit status (2: usage)."""
    args = build_parser().parse_args(argv)
    if args.cells == "matrix":
        from bench.sim.matrix import WORKLOADS, cell_name
        cells = [cell_name(w, load) for w, wl in WORKLOADS.items() for load in wl.loads]
    else:
        cells = args.cells.split(",")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"seeds are comma-separated integers, not {args.seeds!r}", file=sys.stderr)
        return 2
    specs = [(cell, args.system, seed, args.by) for cell in cells for seed in seeds]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            runs = list(ex.map(_run, specs))
    else:
        runs = [_run(s) for s in specs]
    if args.out_md is None:
        for cell, seed, head, rows in runs:
            print(f"\n{_title(cell, args.system, seed, head)}\n\n{_table(rows, args.by)}")
        return 0
    from bench.reporting.provenance import provenance, provenance_line
    if args.by == "rule":
        title, grouped = "Placements by rule", ("the routing profile's plugin that placed them (`Decision.rule`; "
                                                "`a -> b`: forwarded by `a`, placed at the peer by `b`)")
    else:
        title, grouped = "Requests by region", "the client's region and the serving replica's region (`us -> eu`)"
    lines = [f"# {title}: {args.system}, simulated", "", provenance_line(provenance()), "",
             f"Every number is simulated (bench/sim). Per run, the requests sent in the measurement window by "
             f"{grouped}, with the mean seconds they waited in balancers' queues and in the engines' own waiting "
             f"queues; method: bench/sim/rules.py.", "", "## What makes each run's slowest tenth", "",
             markdown_table(["run", "P90 TTFT s", "req/s", "forwarded", f"slowest tenth by {args.by}"],
                            [[f"{cell} s{seed}", f"{h['p90_s']:.2f}", f"{h['rps']:.2f}", f"{h['forwarded']:.1%}",
                              _tail(rows)] for cell, seed, h, rows in runs]), "", "## Every run", ""]
    for cell, seed, head, rows in runs:
        lines += [f"### {_title(cell, args.system, seed, head)}", "", _table(rows, args.by), ""]
    with open(args.out_md, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
