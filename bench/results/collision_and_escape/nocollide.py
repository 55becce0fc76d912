"""Variant: the local pick prefers replicas with none of this balancer's requests still waiting for a first token."""
import sys, os
from skylb.core.plugins import estimated_ttft as et
orig_pick = et.EstimatedTTFT.pick
MODE = os.environ.get("NC", "strict")
def pick(self, request, candidates):
    if len(candidates) > 1:
        free = [c for c in candidates if not c.unprefilled]
        if free and len(free) < len(candidates):
            candidates = free
    return orig_pick(self, request, candidates)
et.EstimatedTTFT.pick = pick
from bench.sim import ab
sys.exit(ab.main())
