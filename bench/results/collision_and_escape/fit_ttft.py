import sys, os, statistics as st
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'true_held.py')).read().split("MODE = ")[0])
from skylb.core.plugins import estimated_ttft as et2
import numpy as np
rec = {}
orig_pick = et2.EstimatedTTFT.pick
def pick(self, request, candidates):
    ch = orig_pick(self, request, candidates)
    c = CL["c"]; f = c.flights.get(request.id)
    if f is not None:
        toks = f.req.tokens; eng = c.replicas[ch.id].engine
        true_unc = len(toks) - eng.cached_prefix_tokens(toks)
        itl = ch.rates.overall.itl_s
        rec[request.id] = (ch.backlog_tokens + true_unc, ch.running or 0, ch.outstanding, itl or 0.0, eng.num_running)
    return ch
et2.EstimatedTTFT.pick = pick
from bench.sim.ab import run_cluster
cluster, summary, warm = run_cluster((sys.argv[1], sys.argv[2], 0))
X, y = [], []
for f in cluster.records:
    d = f.origin_decision
    if d is None or d.route != "local" or d.request.id not in rec or f.origin is None: continue
    fb = f.first_byte_at.get(f.origin.region)
    if fb is None or d.dispatched_at is None or d.dispatched_at < warm: continue
    X.append(rec[d.request.id]); y.append(fb - d.dispatched_at)
X = np.array(X); y = np.array(y)
def fit(cols, names):
    A = np.column_stack([np.ones(len(y))] + [X[:, i] for i in cols])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    pred = A @ coef; r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    print(" + ".join(f"{c:.5f}*{n}" for c, n in zip(coef, ["1"] + names)), f"R2={r2:.3f}")
fit([0], ["tokens"]); fit([0, 2], ["tokens", "outstanding"]); fit([0, 3], ["tokens", "itl"]); fit([0, 4], ["tokens", "true_running"])
print("corr(outstanding, itl)", np.corrcoef(X[:,2], X[:,3])[0,1], "mean itl", X[:,3].mean(), "mean out", X[:,2].mean())
