"""Variant: the push of a cache hit goes only into a holder whose engine queue is shallower than FRAC x its batch;
when every holder's is deeper, the request is held in this balancer's queue (not sent elsewhere to be recomputed)."""
import sys, os
from skylb.core.plugins import push_to_holder as ph
from skylb.core.profile import HOLD
from skylb.core.plugins.scoring import least_loaded, loads_imbalanced
FRAC = float(os.environ.get("FRAC", "0.25"))
HOLDIT = os.environ.get("HOLDIT", "1") == "1"
def shallow(replica):
    if replica.slots is not None or replica.max_concurrency is not None or replica.running is None:
        return False
    limit = replica.capacity.limit
    waiting = max(replica.running + replica.pending + replica.sent_since_probe, replica.outstanding) - limit
    return waiting < max(1.0, FRAC * limit)
def decide(self, c, picked):
    deepest = self.locality.deepest(c.request)
    if deepest is not None:
        if not deepest.targets or deepest.ratio < self.locality.threshold:
            return None
        if any(r.id in deepest.targets for r in c.local):
            return None
    busy = c.busy
    if not busy:
        return None
    everyone = [*c.local, *busy]
    m = self.locality.match_among(c.request, {r.id for r in everyone})
    if not m.targets or m.ratio < self.locality.threshold or any(r.id in m.targets for r in c.local):
        return None
    deep = [r for r in busy if r.id in m.targets and ph.queue_shorter_than_batch(r)]
    if not deep:
        return None
    holders = [r for r in deep if shallow(r)]
    if loads_imbalanced(everyone, self.abs_threshold, self.rel_threshold):
        return None
    if not holders:
        peer = self._cheaper_peer(c, least_loaded(deep, self.turns.next()))
        return peer or (HOLD if HOLDIT else least_loaded(deep, self.turns.next()))
    holder = least_loaded(holders, self.turns.next())
    return self._cheaper_peer(c, holder) or holder
ph.PushToPrefixHolder.decide = decide
from bench.sim import ab
sys.exit(ab.main())
