"""Diagnostic: the default with each candidate priced by what its engine really holds (sim-only knowledge)."""
import sys, os
from bench.sim import cluster as cl
from skylb.core.plugins import estimated_ttft as et
CL = {}
orig_init = cl.Cluster.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k); CL["c"] = self
cl.Cluster.__init__ = init
MODE = os.environ.get("MODE", "true")
orig_held = et.EstimatedTTFT._held
def held(self, request, candidates, fractions):
    c = CL["c"]
    f = c.flights.get(request.id)
    if f is None:
        return orig_held(self, request, candidates, fractions)
    toks = f.req.tokens
    out = [c.replicas[x.id].engine.cached_prefix_tokens(toks) / max(1, len(toks)) for x in candidates]
    if MODE == "max":  # true, but never less than the trie's belief
        out = [max(a, b) for a, b in zip(out, fractions)]
    return out
et.EstimatedTTFT._held = held
if os.environ.get("PARTS"):
    from bench.sim import ttft_parts
    sys.exit(ttft_parts.main())
from bench.sim import ab
sys.exit(ab.main())
