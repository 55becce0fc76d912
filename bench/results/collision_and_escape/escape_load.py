"""Variant: a push into a holder's deep queue escapes to the peer whose engines hold the shortest queues, priced by
load (requests per replica over the holder's batch limit, at the holder's service time), the miss's prefill twice
(its own and the work it adds) and the round trip."""
import sys, os
from skylb.core.plugins import push_to_holder as ph
from skylb.core.cost import slot_wait_s, batch_limit
from skylb.core.estimate import prompt_tokens
orig = ph.PushToPrefixHolder._cheaper_peer
MARGIN = float(os.environ.get("MARGIN", "2.0"))
def _cheaper_peer(self, c, holder):
    found = orig(self, c, holder)
    if found is not None or self.escape is None or self.estimate is None or not c.request.may_forward:
        return found
    service_s = holder.rates.overall.service_s
    limit = batch_limit(holder, True)
    if service_s is None or not limit:
        return None
    push_s = slot_wait_s(holder, service_s) + self.estimate.local_costs(c.request, [holder])[holder.id]
    peers = c.reachable
    if not peers:
        return None
    held = self.locality.peer_fractions(c.request, peers)
    tokens = prompt_tokens(c.request)
    best, best_s = None, push_s - MARGIN
    for p in sorted(peers, key=lambda p: p.region):
        if p.load_per_replica is None or p.rtt_s is None:
            continue
        load = p.load_per_replica + p.sent_since_probe / max(1, p.replicas)
        wait = max(0.0, load - limit + 1) * service_s / limit
        unc = tokens * (1.0 - held.get(p.region, 0.0))
        extra = self.estimate.wait.prefill_s(unc, holder)
        s = p.rtt_s + wait + 2 * extra
        if s < best_s:
            best, best_s = p, s
    return best
ph.PushToPrefixHolder._cheaper_peer = _cheaper_peer
from bench.sim import ab
sys.exit(ab.main())
