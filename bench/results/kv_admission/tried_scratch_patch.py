"""Scratch: drop local candidates where SGLang would refuse the request for want of KV tokens: uncached prompt +
min(max_tokens, 4096) (SGLang's reservation for a new request) above free KV (capacity x (1 - usage)) less the
balancer's prefill backlog there. XP_KVROOM2=1; XP_OUT=0 leaves the output reservation out. Max tokens read from
the simulated request (the product's Request does not carry them)."""
import os
from skylb.core import router as R
from skylb.core.estimate import prompt_tokens
from bench.sim import cluster as C
MODE = os.environ.get("XP_KVROOM2", "")
WITH_OUT = os.environ.get("XP_OUT", "1") == "1"
OUT: dict[str, int] = {}
orig_receive = C.SimBalancer.receive
def receive(self, flight, from_region):
    OUT[flight.req.id] = flight.req.max_tokens or flight.req.output_tokens
    return orig_receive(self, flight, from_region)
C.SimBalancer.receive = receive
orig = R.Router._local_candidates
def fits(self, r, request):
    cap, usage = r.kv_capacity_tokens, r.kv_usage
    if cap is None or usage is None:
        return True
    need = self.policy.uncached_tokens(request, r.id) + (min(OUT.get(request.id, 0), 4096) if WITH_OUT else 0)
    if need > cap * 0.9 or max((r.running or 0) + len(r.dispatch_times), r.outstanding) == 0:
        return True
    return need <= cap * (1.0 - usage) - r.backlog_tokens
def patched(self, request, now):
    local, free, serving = orig(self, request, now)
    if MODE:
        keep = [r for r in local if fits(self, r, request)]
        if keep or os.environ.get("XP_STRICT") == "1":
            local = keep
            free = [r for r in free if fits(self, r, request)]
    return local, free, serving
R.Router._local_candidates = patched
