"""A prefix a sibling's replica holds goes to that sibling (a first Rule of the default profile).

Balancers of one region (siblings) each own some of its replicas, and a session's turns may reach any of them. A
request whose prompt prefix a sibling shared in its status (skylb/core/held_prefixes.py: it placed that prefix on
one of its own replicas lately), at least the locality's threshold and deeper than any of this balancer's replicas
holds it (replica trie, or the block index), is forwarded to that sibling when the sibling has room and either no
local replica has room or the sibling's cost beats the cheapest local replica's: its status's wait, the round trip
(local), the requests forwarded there since and the prefill of the part of the prompt it does not hold
(prefer_peer.py ``peer_cost_s``), against the local estimate with the whole unmatched prompt to prefill
(estimated_ttft.py). No margin, unlike a forward to another region: the round trip is a region's own, and a prefix
prefilled again here is also a second copy of it in the region's caches. The sibling routes the request to the
holding replica by its own trie; a forwarded request is never forwarded again (one hop).

With no sibling (one balancer per region, every peer another region's), the rule has no opinion at once and
nothing else changes.
"""

from __future__ import annotations

from skylb.core.candidates import Candidates
from skylb.core.plugins.estimated_ttft import EstimatedTTFT
from skylb.core.plugins.prefer_peer import PreferFasterPeer
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.scoring import most_room
from skylb.core.state import PeerState, ReplicaState

__all__ = ["ForwardToSiblingHolder"]


class ForwardToSiblingHolder:
    """Rule: the sibling with room holding ``c.request``'s prefix deeper than this balancer's replicas, when it is
    the cheaper place (above); else no opinion.

    Args:
        locality: the tries and what siblings shared. estimate: prices the local replicas. prefer: prices a peer
            (``peer_cost_s``).
    """

    def __init__(self, *, locality: PrefixLocality, estimate: EstimatedTTFT, prefer: PreferFasterPeer):
        self.locality, self.estimate, self.prefer = locality, estimate, prefer

    def decide(self, c: Candidates, picked: ReplicaState | None) -> PeerState | None:
        """The sibling to forward ``c.request`` to, or None."""
        siblings = [p for p in c.peers if p.sibling and len(p.prefixes)]
        if not siblings:
            return None
        request = c.request
        holders, ratio = self.locality.sibling_match(request, siblings)
        if not holders:
            return None
        here = self.locality.match_among(request, {r.id for r in (*c.local, *c.busy)})
        if here.targets and here.ratio >= ratio:  # a replica of this balancer holds it as well
            return None
        if not c.local:
            return most_room(holders)
        costs = self.estimate.local_costs(request, c.local)
        cheapest = min(c.local, key=lambda r: costs[r.id])
        best, best_s = None, costs[cheapest.id]
        for p in sorted(holders, key=lambda p: p.region):
            cost = self.prefer.peer_cost_s(request, p, ratio, cheapest)
            if cost is not None and cost < best_s:
                best, best_s = p, cost
        return best
