"""A new prefix group is homed in a less loaded region (a first Rule of the default profile).

A request whose prompt matches no prefix held here (no local replica holds at least the locality's threshold of it,
by the replica trie or the engines' KV-cache events) and none held abroad (no peer's region summary or regional
snapshot match) starts a new group: a new conversation, tenant, agent or tree. Its later requests follow the replica
that computed its prefix (the push of cache hits, push_to_holder.py; the peer picker's snapshot match). So where a
group is born decides where its load lands for as long as it lives. Every other rule places one request at a time
by its time to first token, which keeps a new group at home whenever a local replica has room now, even in a region
whose clients outnumber its replicas; that region's groups then grow into its full batches, their hits are pushed
behind a batch's worth of waiting requests, and its engines decode larger batches than their peers'.

This rule sends such a request, although a local replica has room, to the least loaded peer with room when

* at least ``busy_fraction`` of this region's usable replicas have no room (the region is under pressure, not
  merely busier than its peers: at low load homing only adds a round trip to every request of the group), and
* this region's mean load per replica is above ``ratio`` x that peer's plus ``slack`` (requests per replica; a
  peer's is its status's ``load_per_replica`` plus the requests forwarded to it since, spread over its replicas).

A replica's load is what its engine runs and holds waiting at the latest probe plus this balancer's requests sent
since, or this balancer's requests in flight there when larger (``ReplicaState.in_engine``). SGLang's
cache-aware router homes a new prefix on the worker with the smallest radix tree for the same reason
(sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``); this is that choice made between regions, by load.

Measured in the simulator (bench/results/home_new_prefix.md, seeds 0-2): on regions of 2, 4 and 6 replicas P90 TTFT
geometric mean 0.949 over the 36 matrix cells (the 150 tenants at 2x 1.57 -> 0.81 s, tool agents at 1x 0.99 ->
0.39 s); on the matrix's even regions 0.996 (Mixed Tree at 8x 0.81x; two speeds at 0.5x 1.18x, where each request
starts a group and homing one abroad only adds the round trip).
"""

from __future__ import annotations

from skylb.core.candidates import Candidates
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.state import PeerState, ReplicaState

__all__ = ["HomeNewPrefix"]


class HomeNewPrefix:
    """Rule: the least loaded peer with room for a request that starts a new prefix group, when this region is under
    pressure and its mean load per replica is above ``ratio`` x that peer's + ``slack``; else no opinion.

    Args:
        locality: the tries, the block index and the peers' summaries (what counts as a held prefix).
        ratio: how many times a peer's mean load per replica this region's must exceed (> 1).
        slack: requests per replica this region's mean load must exceed the peer's scaled load by (>= 0).
        busy_fraction: the share of this region's usable replicas (0-1) that must have no room.

    Raises:
        ValueError: ``ratio`` not above 1, ``slack`` negative, or ``busy_fraction`` outside 0-1.
    """

    def __init__(self, locality: PrefixLocality, *, ratio: float, slack: float, busy_fraction: float):
        if not ratio > 1.0:
            raise ValueError(f"ratio must be above 1, not {ratio}")
        if slack < 0:
            raise ValueError(f"slack is requests per replica, at least 0, not {slack}")
        if not 0.0 <= busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction is a share of replicas (0-1), not {busy_fraction}")
        self.locality, self.ratio, self.slack, self.busy_fraction = locality, ratio, slack, busy_fraction

    def decide(self, c: Candidates, picked: ReplicaState | None) -> PeerState | None:
        """The peer to home ``c.request``'s new prefix group in, or None."""
        if not c.local or not c.peers or not c.request.may_forward:
            return None
        if len(c.local) > (1.0 - self.busy_fraction) * c.replicas:
            return None  # too many with room even among all replicas (the usable ones, listed below, are no more)
        # Cheapest first: the peers' loads (a few), then the local replicas' (all of them), then the prefix lookups.
        # A peer that says no load (an older one, or one with no usable replica) is not a candidate.
        loads = [(p.load_per_replica + p.sent_since_probe / max(1, p.replicas), p)
                 for p in sorted(c.peers, key=lambda p: p.region) if p.load_per_replica is not None]
        if not loads:
            return None
        best_load, best = min(loads, key=lambda lp: lp[0])  # the first in region order among equals
        busy = c.busy
        replicas = len(c.local) + len(busy)
        if len(busy) < self.busy_fraction * replicas:
            return None
        here = (sum(r.in_engine for r in c.local) + sum(r.in_engine for r in busy)) / replicas
        if here <= self.ratio * best_load + self.slack or not self._new_group(c):
            return None
        return best

    def _new_group(self, c: Candidates) -> bool:
        """Whether no local replica and no peer's region holds at least the threshold of ``c.request``'s prompt."""
        loc, request = self.locality, c.request
        here = loc.deepest(request)  # None with a block index: then the exact match among every local replica
        if here is None:
            here = loc.match_among(request, loc.replicas)
        if here.targets and here.ratio >= loc.threshold:
            return False
        return not loc.peer_fractions(request, c.reachable)
