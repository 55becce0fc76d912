"""Variant: the push's escape prices every peer with room, not only those holding the prefix."""
import sys, os
from skylb.core.plugins import push_to_holder as ph
from skylb.core.cost import slot_wait_s
def _cheaper_peer(self, c, holder):
    if self.escape is None or self.estimate is None or not c.peers or not c.request.may_forward:
        return None
    service_s = holder.rates.overall.service_s
    if service_s is None:
        return None
    push_s = slot_wait_s(holder, service_s) + self.estimate.local_costs(c.request, [holder])[holder.id]
    return self.escape.cheaper_peer(c, push_s, holder, holders_only=os.environ.get("HOLDERS") == "1")
ph.PushToPrefixHolder._cheaper_peer = _cheaper_peer
from bench.sim import ab
sys.exit(ab.main())
