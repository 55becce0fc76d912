"""Estimate check 1 of the robustness matrix for a variant from one seed: each cell's default P90 TTFT and
throughput in ``bench/results/matrix.json`` (means over seeds 0-2) scaled by the variant's ratio to the baseline in
one seed's ``bench.sim.ab`` lines, then judged as the matrix judges them (within 3% of the best other system on P90
and on throughput, P90 within 1.15x the oracle's; bench/sim/matrix_report.py). An estimate, not a matrix run.

Run from the repository root: ``python bench/results/spread_cap/check1_estimate.py BASE.txt VARIANT.txt``.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.getcwd())
from bench.sim.matrix_report import ORACLE_LIMIT, P90_TOLERANCE, THROUGHPUT_TOLERANCE  # noqa: E402

LINE = re.compile(r"^(\S+)\s+\S+\s+s\d+ p90=\s*([\d.]+) .*thr=\s*([\d.]+)")


def lines(path):
    out = {}
    for line in open(path):
        m = LINE.match(line)
        if m:
            out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


base, variant = lines(sys.argv[1]), lines(sys.argv[2])
d = json.load(open("bench/results/matrix.json"))
met, missed = 0, []
for c in d["cells"]:
    name = f"{c['workload']}@{c['load']:g}x"
    p90, thr = c["default_p90"], c["default_tput"]
    best_p90, best_thr, oracle = p90 / c["p90_ratio"], thr / c["tput_ratio"], p90 / c["oracle_ratio"]
    if name in base and name in variant:
        p90 *= variant[name][0] / base[name][0]
        thr *= variant[name][1] / base[name][1]
    ok = (p90 / best_p90 <= 1 + P90_TOLERANCE and thr / best_thr >= 1 - THROUGHPUT_TOLERANCE
          and p90 / oracle <= ORACLE_LIMIT)
    met += ok
    if not ok:
        missed.append(f"{name} (P90 {p90 / best_p90:.2f}x best other, {p90 / oracle:.2f}x oracle; "
                      f"throughput {thr / best_thr:.3f}x)")
print(f"check 1 estimated: met in {met} of {len(d['cells'])} cells; missed: " + "; ".join(missed))
