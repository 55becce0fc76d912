#!/bin/bash
# The runs of ab-lines.txt: from a checkout of 8cf7a2c with saturation.diff applied (CHECKOUT), the 150 tenants at 3x
# and 2x, seeds 0-2, one line per (variant, cell, seed); each variant is the diff's switches (XP_PW, XP_BP).
cd "${CHECKOUT:-.}"
run() { env "$@" python -m bench.sim.ab multi_tenant@3x,multi_tenant@2x 'SkyLB' 0,1,2 1 | sed "s/^/$LABEL /"; }
for spec in "base:" "pw-mean:XP_PW=1" "pw-min:XP_PW=min" "bp0:XP_BP=0" "bp0.5:XP_BP=0.5" "bp1:XP_BP=1" \
            "pw-bp0.25:XP_PW=1 XP_BP=0.25" "pw-bp0.5:XP_PW=1 XP_BP=0.5" "pw-bp1:XP_PW=1 XP_BP=1"; do
  LABEL=${spec%%:*}; E=${spec#*:}
  LABEL=$LABEL run X=1 $E
done
