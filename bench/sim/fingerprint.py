"""Every routing policy's simulated figures on a fixed set of runs, to show a reshaping left routing untouched.

``python -m bench.sim.fingerprint OUT.json [JOBS]`` runs each system of ``SYSTEMS`` below (every registered policy
at least once, and the default's optional rules) on each cell of ``CELLS`` (robustness-matrix cells,
bench/sim/matrix.py, development split) at seed 0, and writes every run's full RunSummary (bench/sim/metrics.py)
as JSON. Compare two such files leaf by leaf with ``python -m bench.sim.compare_results A.json B.json``: the simulated
figures are deterministic for a seed with ``PYTHONHASHSEED`` fixed (set it, e.g. ``PYTHONHASHSEED=0``), so any
difference is a change of routing. The cells exercise the rules that matter: cache hits pushed into full batches
(multi_tenant), replicas of two speeds (heterogeneous: holding for a faster replica, estimated wait), forwarding
with and without room across regions (conversation_1_8 at 2x) and a closed loop with the queue's look-ahead (tot).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from bench.sim.ab import run_one
from bench.sim.systems import System

__all__ = ["CELLS", "SYSTEMS", "main"]

#: Robustness-matrix cells (workload@load).
CELLS = ("multi_tenant@2x", "heterogeneous@1x", "conversation_1_8@2x", "tot@2x")
#: bench.sim.ab system specs: every SYSTEMS key but the oracle (a best-of over the policies below) and the
#: per-region round robin (the RR policy again), the default with its optional placement, and estimated wait.
SYSTEMS = ("RR", "LL", "CH", "SGL", "SP-O", "SP-P", "EW", "RegionLocal", "SkyLB-CH", "SkyLB", "SkyLB-paper",
           'SkyLB+placement="predicted-ttft"', "SkyLB+push_to_prefix_holder=False")


#: Estimated wait (OllamaRouter) runs in no report's system list, so it is added here.
EXTRA = System("EW", "single balancer (US), least estimated wait (OllamaRouter), blind pushing", "single",
               "estimated-wait")


def _run(spec: tuple[str, str, int]):
    from bench.sim import systems
    systems.SYSTEMS.setdefault(EXTRA.key, EXTRA)
    return run_one(spec)


def main(argv: list[str] | None = None) -> int:
    """Run every (cell, system) at seed 0 and write the summaries to the file named first; returns 0."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if os.environ.get("PYTHONHASHSEED") is None:
        print("set PYTHONHASHSEED (e.g. 0): string hashing orders ties, and the figures must be reproducible",
              file=sys.stderr)
        return 2
    jobs = int(argv[1]) if len(argv) > 1 else 2
    specs = [(cell, system, 0) for cell in CELLS for system in SYSTEMS]
    with ProcessPoolExecutor(jobs) as ex:
        runs = {f"{cell} {system}": {k: v for k, v in dataclasses.asdict(r).items() if k != "wall_s"}
                for (cell, system, _), r in zip(specs, ex.map(_run, specs))}
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump({"runs": runs}, f, indent=1, sort_keys=True)
    print(f"{len(runs)} runs written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
