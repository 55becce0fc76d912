"""Variant: while every candidate has room (nothing waiting in its engine, KV below half), the local pick drops the
replicas still prefilling one of this balancer's requests when one that is not is no slower by its own holdings."""
import sys, os
from skylb.core.plugins import estimated_ttft as et
from skylb.core.estimate import prompt_tokens
orig_pick = et.EstimatedTTFT.pick
STALL = os.environ.get("STALL") == "1"
def pick(self, request, candidates):
    if len(candidates) > 1 and any(c.unprefilled for c in candidates) and any(not c.unprefilled for c in candidates) \
            and not any(c.pending or (c.kv_usage or 0.0) >= self.holdings_kv_below for c in candidates):
        tokens = prompt_tokens(request)
        held = self.locality.held_fractions(request, candidates)
        costs = self.wait.ttft_among_s(candidates, [tokens * (1.0 - f) for f in held])
        busy = min((s for c, s in zip(candidates, costs) if c.unprefilled), default=float("inf"))
        free = min((s for c, s in zip(candidates, costs) if not c.unprefilled), default=float("inf"))
        if free <= busy:
            candidates = [c for c in candidates if not c.unprefilled]
    return orig_pick(self, request, candidates)
et.EstimatedTTFT.pick = pick
from bench.sim import ab
sys.exit(ab.main())
