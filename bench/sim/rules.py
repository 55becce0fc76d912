"""Which plugin of the routing profile placed each request, and how those requests fared (simulated).

``python -m bench.sim.rules CELLS SYSTEM [SEEDS]``: comma-separated scenarios or robustness-matrix cells (as
``bench.sim.ab`` takes them, with its ``SPLIT``, ``COUNTS`` and ``RTT_SCALE``), one system spec of
bench/sim/systems.py (``SkyLB``, ``SkyLB+home_new_prefixes=False``...), seeds (default 0). For each run, the requests
sent in the measurement window grouped by the rule of their decision (``Decision.rule``: the plugin's module name,
skylb/core/profile.py ``plugin_name``), ``a -> b`` for a request forwarded by rule ``a`` and placed at the peer by
rule ``b``: how many, their share, mean / P50 / P90 TTFT (s), how many of the run's slowest tenth (TTFT at or above
its P90) they are, and their prefix hit rate (cached prompt tokens / prompt tokens, the engines' counters). It says
which rules act on a workload and which of them make its tail, the question to answer before changing one.
:func:`rule_table` ``(cluster, window_start_s) -> list[dict]`` is the same for a finished cluster.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

from bench.replay.report import markdown_table

__all__ = ["rule_table", "main"]


def _chain(flight) -> str:
    """The rule that sent ``flight`` out of its client's region, then the peer's (or "-" without a decision)."""
    first = flight.origin_decision
    name = (first.rule or "-") if first is not None else "-"
    if flight.peer_decision is not None:
        name += " -> " + (flight.peer_decision.rule or "-")
    return name


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of sorted ``values``, nearest rank (as bench/sim/metrics.py reads P90)."""
    return values[min(len(values) - 1, int(q * len(values)))]


def rule_table(cluster, window_start_s: float) -> list[dict]:
    """One row per rule chain (module docstring) over the requests sent in [``window_start_s``, the cluster's
    ``stop_at``), most requests first: {rule, requests, share, mean_s, p50_s, p90_s, in_slowest_tenth, hit_rate}."""
    sent = [f for f in cluster.records if window_start_s <= f.sent_at < cluster.stop_at and f.result is not None]
    if not sent:
        return []
    ttft = sorted(f.first_token_at - f.sent_at for f in sent)
    slow = _pct(ttft, 0.9)
    groups = defaultdict(list)
    for f in sent:
        groups[_chain(f)].append(f)
    rows = []
    for name, flights in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = sorted(f.first_token_at - f.sent_at for f in flights)
        prompt = sum(f.result.prompt_tokens for f in flights)
        rows.append({"rule": name, "requests": len(flights), "share": len(flights) / len(sent),
                     "mean_s": statistics.fmean(times), "p50_s": _pct(times, 0.5), "p90_s": _pct(times, 0.9),
                     "in_slowest_tenth": sum(t >= slow for t in times),
                     "hit_rate": sum(f.result.cached_tokens for f in flights) / prompt if prompt else 0.0})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print each run's table; returns the exit status (2: usage)."""
    from bench.sim.ab import run_cluster
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    seeds = [int(s) for s in argv[2].split(",")] if len(argv) == 3 else [0]
    for cell in argv[0].split(","):
        for seed in seeds:
            cluster, summary, start = run_cluster((cell, argv[1], seed))
            print(f"\n{cell} {argv[1]} seed {seed}: P90 TTFT {summary.ttft_p90:.3f} s, {summary.throughput_rps:.2f} "
                  f"req/s, hit rate {summary.hit_rate:.1%}, forwarded {summary.forwarded_frac:.1%}\n")
            rows = rule_table(cluster, start)
            print(markdown_table(["rule", "requests", "share", "mean TTFT s", "P50 s", "P90 s", "in slowest 10%",
                                  "hit rate"],
                                 [[r["rule"], r["requests"], f"{r['share']:.1%}", f"{r['mean_s']:.3f}",
                                   f"{r['p50_s']:.3f}", f"{r['p90_s']:.3f}", r["in_slowest_tenth"],
                                   f"{r['hit_rate']:.1%}"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
