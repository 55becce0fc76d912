"""The robustness matrix with the simulated engines scheduling first come, first served.

``PYTHONPATH=. .venv/bin/python bench/results/matrix-fcfs/run_fcfs.py OUT_DIR [SEEDS]`` from the repository root
(SEEDS defaults to "0"): ``skylb bench matrix --split dev`` with the calibrated regime's engines
(bench/sim/regime.yaml: SGLang v0.4.3 admission, whose ``schedule_policy`` is "lpm", longest prefix match first)
switched to ``schedule_policy="fcfs"`` (SGLang's default since v0.4.6, and vLLM's; bench/emulator/model.py
``EngineParams``). Routing, workloads, loads and systems unchanged. Both modules that import ``engine_params`` are
patched before the matrix runs; the worker processes inherit the patch by fork.
"""

import dataclasses
import sys
from pathlib import Path

import bench.sim.matrix as matrix
import bench.sim.regime as regime

_regime_params = regime.engine_params


def _fcfs_params(*args, **kwargs):
    return dataclasses.replace(_regime_params(*args, **kwargs), schedule_policy="fcfs")


regime.engine_params = _fcfs_params
matrix.engine_params = _fcfs_params

MARK = ("**Engines scheduling first come, first served**, not the calibrated regime's longest prefix match: produced "
        "by `PYTHONPATH=. python bench/results/matrix-fcfs/run_fcfs.py` (the command below is what it ran inside). "
        "Reading: bench/results/matrix-fcfs/README.md.\n\n")


def mark(report: Path) -> None:
    """Put MARK under the report's title, once, so the file never reads as the regime's own matrix."""
    text = report.read_text()
    if MARK not in text:
        title, rest = text.split("\n\n", 1)
        report.write_text(f"{title}\n\n{MARK}{rest}")


if __name__ == "__main__":
    from skylb.cli import main

    out = sys.argv[1]
    seeds = sys.argv[2] if len(sys.argv) > 2 else "0"
    main(["bench", "matrix", "--seeds", seeds, "--split", "dev", "--jobs", "2", "--no-progress", "--out", out])
    mark(Path(out) / "matrix.md")
