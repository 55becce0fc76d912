"""Print, per matrix cell given, the oracle's per-figure best candidate and each candidate's P90 TTFT (s) and
throughput (req/s), means over the seeds of ``bench/results/matrix.json``: where the oracle's P90 and its throughput
come from different rules, no one rule reaches both.

Run from the repository root: ``python bench/results/spread_cap/oracle_candidates.py tot@0.5x,tot@1x``.
"""
import collections
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from bench.sim.matrix_report import ORACLE_LIMIT, THROUGHPUT_TOLERANCE  # noqa: E402

cells = sys.argv[1].split(",")
d = json.load(open("bench/results/matrix.json"))
for cell in cells:
    runs = [r for r in d["runs"] if r["system"] == "Oracle" and r["scenario"] == cell]
    sums = collections.defaultdict(lambda: [0.0, 0.0])
    for r in runs:
        for name, c in r["candidates"].items():
            sums[name][0] += c["ttft_p90"] / len(runs)
            sums[name][1] += c["throughput_rps"] / len(runs)
    best = collections.Counter(r["best_of"]["ttft_p90"] for r in runs).most_common(1)[0][0]
    best_thr = collections.Counter(r["best_of"]["throughput_rps"] for r in runs).most_common(1)[0][0]
    print(f"{cell:18} P90 from {best:17} throughput from {best_thr:17} "
          + "  ".join(f"{n} {p:.3f}/{t:.2f}" for n, (p, t) in sorted(sums.items())))

# Would any one candidate (global layout, fresh view, free network: more than a balancer has) meet check 1's P90 and
# throughput lines together? P90 at most 1.15x the oracle's, throughput at least 0.97x the best other system's.
print()
cells_by_name = {f"{c['workload']}@{c['load']:g}x": c for c in d["cells"]}
for cell in cells:
    runs = [r for r in d["runs"] if r["system"] == "Oracle" and r["scenario"] == cell]
    c = cells_by_name[cell]
    best_other_thr = c["default_tput"] / c["tput_ratio"]
    oracle_p90 = sum(r["ttft_p90"] for r in runs) / len(runs)
    ok = []
    for name in runs[0]["candidates"]:
        p90 = sum(r["candidates"][name]["ttft_p90"] for r in runs) / len(runs)
        thr = sum(r["candidates"][name]["throughput_rps"] for r in runs) / len(runs)
        if p90 <= ORACLE_LIMIT * oracle_p90 and thr >= (1 - THROUGHPUT_TOLERANCE) * best_other_thr:
            ok.append(name)
    print(f"{cell:18} oracle P90 {oracle_p90:.3f} (x{ORACLE_LIMIT} {ORACLE_LIMIT * oracle_p90:.3f}), best other throughput "
          f"{best_other_thr:.2f} (x{1 - THROUGHPUT_TOLERANCE:g} {(1 - THROUGHPUT_TOLERANCE) * best_other_thr:.2f}): both met by {', '.join(ok) or 'none'}")
