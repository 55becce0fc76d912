import sys, os
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'true_held.py')).read().split("if os.environ.get(\"PARTS\")")[0])
from skylb.core.plugins import estimated_ttft as et2
from skylb.core.plugins.scoring import loads_imbalanced
from skylb.core.estimate import prompt_tokens
shown = [0]
orig_pick = et2.EstimatedTTFT.pick
def pick(self, request, candidates):
    ch = orig_pick(self, request, candidates)
    if ch.unprefilled and any(not c.unprefilled for c in candidates) and shown[0] < 6 and CL["c"].loop.now > 30:
        shown[0] += 1
        stalls = []
        costs, fr = self._costs(request, candidates, stalls)
        held = self._held(request, candidates, fr)
        imb = loads_imbalanced(candidates, self.abs_threshold, self.rel_threshold)
        print(f"t={CL['c'].loop.now:.2f} req {request.id} tokens {prompt_tokens(request)} chose {ch.id} imbalanced={imb}")
        for c, cost, st, f, h in zip(candidates, costs, stalls, fr, held):
            print(f"   {c.id} backlog {c.backlog_tokens:4d} unpre {len(c.unprefilled)} pend {c.pending} run {c.running} out {c.outstanding} "
                  f"trie_frac {f:.2f} true_frac {h:.2f} cost {cost:.3f} +stall {st:.3f} rate {c.rates.overall.prefill_s_per_token}")
    return ch
et2.EstimatedTTFT.pick = pick
from bench.sim.ab import run_cluster
run_cluster((sys.argv[1], sys.argv[2], 0))
