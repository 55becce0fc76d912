import sys, os, statistics as st
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'true_held.py')).read().split("MODE = ")[0])
from skylb.core.plugins import estimated_ttft as et2
from skylb.core.estimate import prompt_tokens
rec = {}
orig_pick = et2.EstimatedTTFT.pick
def pick(self, request, candidates):
    ch = orig_pick(self, request, candidates)
    c = CL["c"]; f = c.flights.get(request.id)
    if f is not None:
        toks = f.req.tokens
        eng = c.replicas[ch.id].engine
        true_unc = len(toks) - eng.cached_prefix_tokens(toks)
        rate = ch.rates.overall.prefill_s_per_token or 1/2000
        pred = rate * (ch.backlog_tokens + true_unc)
        rec[request.id] = (bool(ch.unprefilled), pred, ch.backlog_tokens, true_unc, eng.num_waiting, eng.num_running, len(ch.unprefilled))
    return ch
et2.EstimatedTTFT.pick = pick
from bench.sim.ab import run_cluster
cluster, summary, warm = run_cluster((sys.argv[1], sys.argv[2], 0))
groups = {True: [], False: []}
for f in cluster.records:
    d = f.origin_decision
    if d is None or d.route != "local" or d.request.id not in rec or f.origin is None: continue
    fb = f.first_byte_at.get(f.origin.region)
    if fb is None or d.dispatched_at is None or d.dispatched_at < warm: continue
    col, pred, back, unc, nw, nr, nu = rec[d.request.id]
    groups[col].append((fb - d.dispatched_at, pred, back, unc, f.result.queue_s if f.result else 0))
for k, g in groups.items():
    if not g: continue
    print(f"collided={k}: n={len(g)} realized {st.mean(x[0] for x in g):.3f} predicted {st.mean(x[1] for x in g):.3f} "
          f"resid {st.mean(x[0]-x[1] for x in g):+.3f} backlog {st.mean(x[2] for x in g):.0f} true uncached {st.mean(x[3] for x in g):.0f} engine queue {st.mean(x[4] for x in g):.3f}")
