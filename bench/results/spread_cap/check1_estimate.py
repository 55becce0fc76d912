"""Estimate check 1 of the robustness matrix for a variant from one seed: each cell's default P90 TTFT and
throughput in ``bench/results/matrix.json`` (means over seeds 0-2) scaled by the variant's ratio to the baseline in
one seed's ``bench.sim.ab`` lines, then judged as the matrix judges them (within 3% of the best other system on P90
and on throughput, P90 within 1.15x the oracle's; bench/sim/matrix_report.py). An estimate, not a matrix run.

Run from the repository root: ``python bench/results/spread_cap/check1_estimate.py BASE.txt VARIANT.txt``.
"""
import json
import re
import sys

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
    ok = p90 <= 1.03 * best_p90 and thr >= best_thr / 1.03 and p90 <= 1.15 * oracle
    met += ok
    if not ok:
        missed.append(f"{name} (P90 {p90 / best_p90:.2f}x best other, {p90 / oracle:.2f}x oracle; "
                      f"throughput {thr / best_thr:.3f}x)")
print(f"check 1 estimated: met in {met} of {len(d['cells'])} cells; missed: " + "; ".join(missed))
