import sys
from skylb.core import profile as P
from skylb.core.estimate import pace_slowdowns
seen = set()
orig = P.Profile.choose
def choose(self, c):
    t = orig(self, c)
    for mark in (20, 40, 80):
        if c.now >= mark and (mark, c.local[0].id.split("-")[0] if c.local else None) not in seen and c.local and len(c.local) + len(c.busy) == 4:
            seen.add((mark, c.local[0].id.split("-")[0]))
            reps = sorted(c.local + c.busy, key=lambda r: r.id)
            print(mark, [(r.id, r.rates.overall.prefill_s_per_token and round(r.rates.overall.prefill_s_per_token*1e3, 3),
                          r.rates.overall.decode_s_per_token and round(r.rates.overall.decode_s_per_token*1e3,1),
                          r.rates.overall.itl_s and round(r.rates.overall.itl_s*1e3,1),
                          round(r.rates.overall.time_per_token_s*1e3,2) if r.rates.overall.time_per_token_s else None,
                          r.rates.overall.samples) for r in reps])
            print("   slowdowns", pace_slowdowns([r.rates.overall for r in reps]))
    return t
P.Profile.choose = choose
from bench.sim.ab import run_cluster
run_cluster((sys.argv[1], sys.argv[2], int(sys.argv[3])))
