"""Check 1 of the matrix for a variant, exactly: the default's and RegionLocal's 3-seed means from bench.sim.ab lines
(both systems run with the variant's options, RegionLocal being the default's policy without forwarding), every other
system's from the matrix JSON. Usage: check1_exact.py MATRIX.json LINES... (lines of 'SkyLB...' and 'RegionLocal...')."""
import json, re, sys, statistics
from collections import defaultdict
sys.path.insert(0, ".")
from bench.sim.matrix_report import ORACLE_LIMIT, P90_TOLERANCE, THROUGHPUT_TOLERANCE
LINE = re.compile(r"^(\S+)\s+(\S+)\s+s(\d+) p90=\s*([\d.]+) .*thr=\s*([\d.]+)")
d = json.load(open(sys.argv[1]))
rows = defaultdict(dict)
for r in d["results"]:
    rows[r["scenario"]][r["system"]] = (r["ttft_p90"], r["throughput_rps"])
var = defaultdict(lambda: defaultdict(list))
for path in sys.argv[2:]:
    for line in open(path):
        if line.startswith("{"):
            j = json.loads(line); var[j["cell"]][j["system"]].append((j["p90"], j["thr"]))
met, missed, geo_p, geo_t, n = 0, [], 0.0, 0.0, 0
import math
for cell, systems in rows.items():
    s = dict(systems)
    for system, runs in var.get(cell, {}).items():
        old = s[system]
        new = (statistics.fmean(p for p, _ in runs), statistics.fmean(t for _, t in runs))
        if system == "SkyLB":
            geo_p += math.log(new[0] / old[0]); geo_t += math.log(new[1] / old[1]); n += 1
        s[system] = new
    sky = s["SkyLB"]; others = [v for k, v in s.items() if k not in ("SkyLB", "Oracle")]
    bp = min(p for p, _ in others); bt = max(t for _, t in others); orc = s["Oracle"][0]
    ok = sky[0] / bp <= 1 + P90_TOLERANCE and sky[1] / bt >= 1 - THROUGHPUT_TOLERANCE and sky[0] / orc <= ORACLE_LIMIT
    met += ok
    if not ok:
        missed.append(f"{cell}({sky[0]/bp:.2f},{sky[1]/bt:.3f},{sky[0]/orc:.2f})")
print(f"check 1: {met} of {len(rows)}; SkyLB P90 geomean {math.exp(geo_p/max(n,1)):.3f} thr {math.exp(geo_t/max(n,1)):.4f} over {n} cells")
print("missed:", " ".join(sorted(missed)))
