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

A sibling without room (every replica's batch full at its latest status) that holds the prefix, with nothing
waiting in its own queue, gets the request too when no sibling with room holds it (``push_when_busy``, the
default profile's ``push_to_prefix_holder``): the sibling then pushes it into the holder's full batch
(push_to_holder.py), as one balancer does with a cache hit on its own replica. Without this clause a session whose
turns alternate between two siblings lost the hit whenever the holder's sibling was full, and a second copy of the
prefix went into the other sibling's replica: live, two siblings each given half the requests of 32 closed-loop
conversations on 4 replicas of batch 4 kept a 77.8% prefix hit rate where one balancer kept 87.3%
(bench/results/baselines_siblings.md).

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

    def __init__(self, *, locality: PrefixLocality, estimate: EstimatedTTFT, prefer: PreferFasterPeer,
                 push_when_busy: bool = False):
        self.locality, self.estimate, self.prefer = locality, estimate, prefer
        self.push_when_busy = push_when_busy

    def decide(self, c: Candidates, picked: ReplicaState | None) -> PeerState | None:
        """The sibling to forward ``c.request`` to, or None."""
        request = c.request
        siblings = [p for p in c.peers if p.sibling and len(p.prefixes)]
        holders, ratio = self.locality.sibling_match(request, siblings) if siblings else ([], 0.0)
        if not holders:
            return self._busy_holder(c) if self.push_when_busy else None
        if self._held_here(c, ratio):
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

    def _held_here(self, c: Candidates, ratio: float) -> bool:
        """Whether a replica of this balancer (room or not) holds ``c.request``'s prefix at least as deep."""
        here = self.locality.match_among(c.request, {r.id for r in (*c.local, *c.busy)})
        return bool(here.targets) and here.ratio >= ratio

    def _busy_holder(self, c: Candidates) -> PeerState | None:
        """A sibling without room, with an empty queue at its latest status and fewer requests sent there since
        than it has replicas, that holds the prefix deeper than this balancer's replicas (the one with the fewest
        requests in flight from here), or None."""
        offered = {p.region for p in c.peers}
        # At most one request per its replica between two of its statuses: what it queued since is not known.
        busy = [p for p in c.reachable if p.sibling and p.region not in offered and not p.queue_len
                and p.sent_since_probe < max(1, p.replicas) and len(p.prefixes)]
        if not busy:
            return None
        holders, ratio = self.locality.sibling_match(c.request, busy)
        if not holders or self._held_here(c, ratio):
            return None
        return min(holders, key=lambda p: (p.outstanding, p.region))
