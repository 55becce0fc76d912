#!/bin/bash

CELLS=$(cat bench/results/option_sweep/cells)
for v in "$@"; do
  if [ "$v" = base ]; then spec="SkyLB;RegionLocal"; else spec="SkyLB+$v;RegionLocal+$v"; fi
  name=$(echo "$v" | tr -c 'A-Za-z0-9_.=\n' '_')
  SPLIT=val .venv/bin/python bench/results/option_sweep/abx.py $CELLS "$spec" 3,4 2 > bench/results/option_sweep/val-$name.jsonl 2>/dev/null
  echo "== VAL $v"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix-val/matrix.json bench/results/option_sweep/val-$name.jsonl
  SCHEDULE=fcfs .venv/bin/python bench/results/option_sweep/abx.py $CELLS "$spec" 0,1,2 2 > bench/results/option_sweep/fcfs-$name.jsonl 2>/dev/null
  echo "== FCFS $v"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix-fcfs/matrix.json bench/results/option_sweep/fcfs-$name.jsonl
done
