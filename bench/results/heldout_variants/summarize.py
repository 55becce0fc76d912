"""The summary table of README.md from the raw `bench.sim.ab` lines in this folder.

``python bench/results/heldout_variants/summarize.py`` (from the repository root): per variant, engine order and
scenario, the mean over seeds 0-2 of P90 TTFT (s) and throughput (req/s) of each system, and the default's P90 and
throughput over the best single balancer's (LL or SGL, whichever has the lower P90) and its P90 over the oracle's.
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.sim.ab import parse_line  # noqa: E402

HERE = Path(__file__).resolve().parent
VARIANTS = ("unique", "unique_poisson", "unique_gamma3", "outputs6_time3", "outputs4_time2")
SYSTEMS = ("SkyLB", "SkyLB-CH", "LL", "SGL", "Oracle")

print("| variant | engines | scenario | " + " | ".join(f"{s} P90 s" for s in SYSTEMS)
      + " | SkyLB P90 / best single | SkyLB req/s / best single | SkyLB P90 / oracle |")
print("|---|---|---|" + "---|" * (len(SYSTEMS) + 3))
for variant in VARIANTS:
    for order in ("lpm", "fcfs"):
        rows = [r for r in map(parse_line, open(HERE / f"{order}_{variant}.txt")) if r]
        for scenario in ("mooncake", "mooncake_2x"):
            mean = {s: (statistics.fmean(r["p90"] for r in rows if r["scenario"] == scenario and r["system"] == s),
                        statistics.fmean(r["thr"] for r in rows if r["scenario"] == scenario and r["system"] == s))
                    for s in SYSTEMS}
            single = min(("LL", "SGL"), key=lambda s: mean[s][0])
            sky = mean["SkyLB"]
            print(f"| {variant} | {order} | {scenario} | " + " | ".join(f"{mean[s][0]:.2f}" for s in SYSTEMS)
                  + f" | {sky[0] / mean[single][0]:.2f}x ({single}) | {sky[1] / mean[single][1]:.3f}x"
                  f" | {sky[0] / mean['Oracle'][0]:.2f}x |")
