"""slot_wait_check.py with the engines scheduling their waiting queues first come, first served.

``python bench/results/regions_wait/fcfs_check.py CELL SEED`` from the repository root (``PYTHONPATH=.``): the same
check with the calibrated regime's engines (bench/sim/regime.yaml: SGLang v0.4.3 admission, whose
``schedule_policy`` is "lpm", longest prefix match first) switched to ``schedule_policy="fcfs"`` (SGLang's default
since v0.4.6; bench/emulator/model.py ``EngineParams``). Routing and workload unchanged.
"""

import dataclasses
import runpy
from pathlib import Path

import bench.sim.regime as regime

_regime_params = regime.engine_params
regime.engine_params = lambda *a, **k: dataclasses.replace(_regime_params(*a, **k), schedule_policy="fcfs")
runpy.run_path(str(Path(__file__).with_name("slot_wait_check.py")), run_name="__main__")
