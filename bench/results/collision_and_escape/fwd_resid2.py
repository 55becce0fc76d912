"""Predicted vs realized TTFT: prefer_peer's forwards (peer cost) and the local picks it priced (local cost)."""
import sys, statistics
from skylb.core.plugins import prefer_peer as pp
peer_pred, local_pred = {}, {}
orig = pp.PreferFasterPeer.cheaper_peer
def patched(self, c, local_s, replica, *, holders_only=False):
    best = orig(self, c, local_s, replica, holders_only=holders_only)
    local_pred[c.request.id] = local_s
    if best is not None:
        held = self.locality.peer_fractions(c.request, c.peers)
        peer_pred[c.request.id] = self.peer_cost_s(c.request, best, held.get(best.region, 0.0), replica)
    return best
pp.PreferFasterPeer.cheaper_peer = patched
from bench.sim.ab import run_cluster
cell, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster, summary, warm = run_cluster((cell, spec, seed))
fw, lo = [], []
for f in cluster.records:
    d = f.origin_decision
    if d is None or f.origin is None or d.dispatched_at is None: continue
    fb = f.first_byte_at.get(f.origin.region)
    if fb is None: continue
    real = fb - d.dispatched_at
    rid = d.request.id
    if rid in peer_pred and d.route == "peer":
        fw.append((real, peer_pred[rid], local_pred[rid]))
    elif rid in local_pred and d.route == "local":
        lo.append((real, local_pred[rid]))
def s(xs): return f"{statistics.mean(xs):+.3f}/{statistics.median(xs):+.3f}" if xs else "-"
print(f"{cell} {spec} s{seed}: forwards {len(fw)} real {s([a for a,b,c in fw])} resid(peer) {s([a-b for a,b,c in fw])} "
      f"| local priced {len(lo)} real {s([a for a,b in lo])} resid(local) {s([a-b for a,b in lo])}")
