"""Scratch: heterogeneous cell, per request: served where (local/abroad, fast/slow), rule, TTFT."""
import sys, statistics
from collections import defaultdict
from bench.sim.ab import run_cluster
from bench.replay.report import percentile
cell, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster, summary, start = run_cluster((cell, spec, seed))
sent = [f for f in cluster.records if start <= f.sent_at < cluster.stop_at and f.result is not None]
tt = [f.first_token_at - f.sent_at for f in sent]
p90 = percentile(tt, 90)
g = defaultdict(list)
for f in sent:
    r = f.replica
    i = int(r.id.rsplit("-r", 1)[1]); slow = i >= 2
    where = ("home" if r.region == f.region else "abroad") + ("/slow" if slow else "/fast")
    rule = f.origin_decision.rule if f.origin_decision else "-"
    g[(where, rule)].append(f.first_token_at - f.sent_at)
print(f"{cell} {spec} s{seed} p90={p90:.3f} n={len(sent)}")
for k, v in sorted(g.items(), key=lambda kv: -len(kv[1])):
    v.sort()
    print(f"  {k[0]:12s} {k[1]:20s} n={len(v):4d} mean={statistics.fmean(v):.3f} p50={percentile(v,50):.3f} p90={percentile(v,90):.3f} slow10={sum(t>=p90 for t in v)}")
