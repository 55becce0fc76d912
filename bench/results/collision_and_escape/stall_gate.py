"""Variant: the generation-stall term only while some candidate's engine has a request waiting (or KV at
holdings_kv_below): with every engine admitting at once, a prompt's prefill delays no one's first token."""
import sys, os
from skylb.core.plugins import estimated_ttft as et
orig_pick = et.EstimatedTTFT.pick
def pick(self, request, candidates):
    if self.stall_weight and not any(c.pending or (c.kv_usage or 0.0) >= self.holdings_kv_below for c in candidates):
        w = self.stall_weight
        self.stall_weight = 0.0
        try:
            return orig_pick(self, request, candidates)
        finally:
            self.stall_weight = w
    return orig_pick(self, request, candidates)
et.EstimatedTTFT.pick = pick
from bench.sim import ab
sys.exit(ab.main())
