"""Scratch experiment (not product code): the prefill cap of ``prefillcap.py`` as a filter in the default profile's
choice instead of an availability rule, lifted when no replica free of a request in prefill is of the fastest pace
class (skylb/core/estimate.py ``pace_slowdowns`` at ``PACE_CLASS_RATIO``), so a fast replica still prefilling is not
skipped for a slow one. Replicas still prefilling stay reachable by the push of a cache hit (added to the busy ones);
with none free of a request in prefill, the request goes on to the peers and the hold rules as with no local room.

Run from the repository root: ``python bench/results/spread_cap/prefillcap_paced.py CELLS SkyLB 0 2``.
"""
import os, sys
sys.path.insert(0, os.getcwd())
from skylb.core.profile import Profile
from skylb.core.estimate import PACE_CLASS_RATIO, pace_classes_apart, pace_slowdowns
_choose = Profile.choose
def choose(self, c):
    if self.name != "skylb" or not c.local:
        return _choose(self, c)
    capped = [r for r in c.local if r.unprefilled]
    if not capped:
        return _choose(self, c)
    model = c.request.model
    pool = c.local
    paces = [m if (m := r.rates.models.get(model)) is not None and m.samples and m.time_per_token_s is not None
             else None for r in pool]
    if pace_classes_apart(paces, PACE_CLASS_RATIO):
        slow = pace_slowdowns(paces)
        if not any(x is not None and x < PACE_CLASS_RATIO for r, x in zip(pool, slow) if not r.unprefilled):
            return _choose(self, c)
    busy = c.busy + capped
    c._cache["busy"] = busy
    c.local = [r for r in c.local if not r.unprefilled]
    return _choose(self, c)
Profile.choose = choose
if __name__ == "__main__":
    from bench.sim import ab
    sys.exit(ab.main())
