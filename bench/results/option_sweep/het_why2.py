"""Scratch: at each local placement on a slow replica, why were the fast local replicas not candidates?"""
import sys, collections
from skylb.core import profile as P
from skylb.core.estimate import prompt_tokens
stats = collections.Counter(); samples = []
orig = P.Profile.choose
def choose(self, c):
    t = orig(self, c)
    rid = getattr(t, "id", None)
    if c.now >= 15 and rid and "-r" in rid and int(rid.rsplit("-r",1)[1]) >= 2 and c.rule and "estimated_ttft" in c.rule:
        fast_local = [r for r in c.local if int(r.id.rsplit("-r",1)[1]) < 2]
        fast_busy = [r for r in c.busy if int(r.id.rsplit("-r",1)[1]) < 2]
        key = (len(fast_local), len(fast_busy))
        stats[key] += 1
        if len(samples) < 15 and key != (2, 0):
            est = self.local
            costs = est.local_costs(c.request, c.local + c.busy)
            samples.append((round(c.now,2), rid, prompt_tokens(c.request), {k: round(v,3) for k,v in costs.items()}, [(r.id, r.in_engine, r.capacity.limit, r.backlog_tokens) for r in c.local + c.busy], [r.id for r in c.busy]))
    return t
P.Profile.choose = choose
from bench.sim.ab import run_cluster
cluster, summary, start = run_cluster((sys.argv[1], sys.argv[2], int(sys.argv[3])))
print(stats)
for s in samples: print(s)
