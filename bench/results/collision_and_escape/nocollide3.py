"""Variant: while every candidate has room (nothing waiting in its engine, KV below holdings_kv_below), the local
pick drops the replicas still prefilling one of this balancer's requests when another, prefilling none, holds at
least the locality's threshold of the prompt by its own holdings."""
import sys, os
from skylb.core.plugins import estimated_ttft as et
orig_pick = et.EstimatedTTFT.pick
GATE = os.environ.get("GATE", "1") == "1"
def pick(self, request, candidates):
    if len(candidates) > 1 and any(c.unprefilled for c in candidates) \
            and (not GATE or not any(c.pending or (c.kv_usage or 0.0) >= self.holdings_kv_below for c in candidates)):
        held = self.locality.held_fractions(request, candidates)
        t = self.locality.threshold
        free = [c for c, f in zip(candidates, held) if not c.unprefilled and f >= t]
        if free:
            candidates = free
    return orig_pick(self, request, candidates)
et.EstimatedTTFT.pick = pick
from bench.sim import ab
sys.exit(ab.main())
