#!/bin/bash
# usage: NAME PATCHFILE (env vars for the patch set by the caller)

CELLS=$(cat bench/results/option_sweep/cells); name=$1; export PATCH=$2
.venv/bin/python bench/results/option_sweep/abx.py $CELLS "SkyLB;RegionLocal" 0,1,2 2 > bench/results/option_sweep/p-$name.jsonl 2>/dev/null
echo "== DEV $name"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix.json bench/results/option_sweep/p-$name.jsonl
SPLIT=val .venv/bin/python bench/results/option_sweep/abx.py $CELLS "SkyLB;RegionLocal" 3,4 2 > bench/results/option_sweep/pval-$name.jsonl 2>/dev/null
echo "== VAL $name"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix-val/matrix.json bench/results/option_sweep/pval-$name.jsonl
SCHEDULE=fcfs .venv/bin/python bench/results/option_sweep/abx.py $CELLS "SkyLB;RegionLocal" 0,1,2 2 > bench/results/option_sweep/pfcfs-$name.jsonl 2>/dev/null
echo "== FCFS $name"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix-fcfs/matrix.json bench/results/option_sweep/pfcfs-$name.jsonl
