#!/bin/bash

CELLS=$(cat bench/results/option_sweep/cells)
for v in "$@"; do
  name=$(echo "$v" | tr -c 'A-Za-z0-9_.=\n' '_')
  .venv/bin/python bench/results/option_sweep/abx.py $CELLS "SkyLB+$v;RegionLocal+$v" 0,1,2 2 > bench/results/option_sweep/v-$name.jsonl 2>bench/results/option_sweep/v-$name.err
  echo "== $v"; .venv/bin/python bench/results/option_sweep/check1_exact.py bench/results/matrix.json bench/results/option_sweep/v-$name.jsonl
done
