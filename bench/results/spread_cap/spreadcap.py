"""Scratch experiment (not product code): a per-request spread cap on the default profile, by monkeypatch.

For a request whose prompt is held (``PrefixLocality.held_fractions`` over the local replicas with room and the busy
ones) at least at the locality's threshold, within SC_DELTA of the best holding, by two or more local replicas, only
the local replicas with room and no request of this balancer sent since their latest probe stay candidates (the
busy ones are kept, so the default's push of a cache hit cannot go to a capped holder either); none left: the
request stays queued. SC_LOOSE=1 counts the other replicas within SC_DELTA of the best whatever their holding
(below the threshold too: the form that reaches the oracle on the light trees). SC_KEY=unprefilled keeps the
replicas with no request of this balancer awaiting its first token instead. SC_IDLE=1 also drops the replicas with a
request waiting in the engine at their probe (the paper's rule). SC_OCC gates the cap on the mean batch occupancy
over the region's usable replicas ((running + pending + sent since the probe) / learned admission limit) being below
it (default: no gate).

Run from the repository root: ``SC_DELTA=0.7 SC_OCC=0.5 python bench/results/spread_cap/spreadcap.py CELLS SkyLB 0 2``
(the arguments of ``python -m bench.sim.ab``).
"""
import math
import os
import sys

sys.path.insert(0, os.getcwd())
from skylb.core.profile import Profile  # noqa: E402

DELTA = float(os.environ.get("SC_DELTA", "0.7"))
OCC = float(os.environ.get("SC_OCC", "inf"))
KEY = os.environ.get("SC_KEY", "sent")
IDLE = os.environ.get("SC_IDLE") == "1"
LOOSE = os.environ.get("SC_LOOSE") == "1"
_choose = Profile.choose


def _occupancy(replicas):
    parts = []
    for r in replicas:
        cap = getattr(r, "capacity", None)
        limit = getattr(cap, "limit", None) if cap is not None else None
        if not limit:
            continue
        parts.append(((r.running or 0) + r.pending + r.sent_since_probe) / limit)
    return sum(parts) / len(parts) if parts else 0.0


def choose(self, c):
    if self.name != "skylb" or not c.local:
        return _choose(self, c)
    locality = getattr(self.local, "locality", None)
    if locality is None:
        return _choose(self, c)
    pool = list(c.local) + list(c.busy)
    held = locality.held_fractions(c.request, pool)
    best = max(held, default=0.0)
    if best < locality.threshold:
        return _choose(self, c)
    if sum(1 for h in held if h >= (best - DELTA if LOOSE else max(locality.threshold, best - DELTA))) < 2:
        return _choose(self, c)
    if math.isfinite(OCC) and _occupancy(pool) >= OCC:
        return _choose(self, c)
    free = [r for r in c.local if not (r.unprefilled if KEY == "unprefilled" else r.sent_since_probe)
            and not (IDLE and r.pending)]
    if not free:
        c.rule = "spread_cap"
        return None
    c.local = free
    return _choose(self, c)


Profile.choose = choose

if __name__ == "__main__":
    from bench.sim import ab
    sys.exit(ab.main())
