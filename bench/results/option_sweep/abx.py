"""Scratch: bench.sim.ab at full precision: abx.py CELLS 'SYS1;SYS2' SEEDS JOBS > out.jsonl (PATCH=module.py first)."""
import json, os, sys, runpy
sys.path.insert(0, os.getcwd())
if os.environ.get("PATCH"):
    runpy.run_path(os.environ["PATCH"], run_name="patch")
from concurrent.futures import ProcessPoolExecutor
from bench.sim.ab import run_one
cells, systems, seeds = sys.argv[1].split(","), sys.argv[2].split(";"), [int(s) for s in sys.argv[3].split(",")]
specs = [(c, s, seed) for c in cells for s in systems for seed in seeds]
with ProcessPoolExecutor(int(sys.argv[4]) if len(sys.argv) > 4 else 2) as ex:
    for (c, s, seed), r in zip(specs, ex.map(run_one, specs)):
        print(json.dumps({"cell": c, "system": s.split("+")[0], "spec": s, "seed": seed, "p90": r.ttft_p90,
                          "thr": r.throughput_rps, "hit": r.hit_rate, "fwd": r.forwarded_frac}), flush=True)
