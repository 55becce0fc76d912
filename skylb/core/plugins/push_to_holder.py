"""Cache hits go to their replica (a first Rule of the default profile).

A request whose prefix a local replica holds (replica trie, at least the locality's threshold) while no replica with
room holds it is pushed into the holder's full batch, as SGLang's cache-aware router (sgl-router ``cache_aware``)
sends every matched request, unless a batch's worth already waits there, the holder's bound is stated rather than
learned (llama.cpp's slots, ``max_concurrency``), or the local replicas' outstanding requests are imbalanced
(``abs_threshold``, ``rel_threshold``: SGLang's 64 and 1.5). Selective pushing sent such a hit to a replica with
room, which prefilled the whole prefix and kept a second copy of it; under load those copies evicted other
prefixes, misses grew the load, and the load made more misses (150 tenants behind 6,000-token prefixes at 2x: each
tenant's requests spread over 3.3 replicas and 67% hits, where one SGLang router kept each tenant on one replica for
83%). Requests without a match keep selective pushing.

A push is priced (``escape``): its predicted time to first token is the wait for a place in the holder's batch
(skylb/core/cost.py ``slot_wait_s``: the requests past the batch's limit, plus this one, times the holder's measured
service time over its limit) plus the holder's estimate (wait + uncached prefill; estimated_ttft.py). A peer with
room whose region holds the prefix (its region summary of KV-cache blocks, else the regional snapshot) and that beats
it by the forward margin (prefer_peer.py ``cheaper_peer``) gets the request instead, so a region whose holders' batches
are full sends a prefix's requests to the peer that already holds it rather than queueing them (simulated, closed-loop
trees at their heaviest loads, P90 TTFT: Mixed Tree at 8x 10 -> 5 s, Tree of Thoughts at 4x 1.13 -> 0.92 s). A peer
without the prefix is not asked: its copy would cost the prefill the push saves, and under load such copies spread
(150 tenants at 2x, tried: hits 78% -> 70%, P90 TTFT 0.6 -> 3.6 s, seeds 0-2).
"""

from __future__ import annotations

from skylb.core.candidates import Candidates
from skylb.core.cost import slot_wait_s
from skylb.core.plugins.estimated_ttft import EstimatedTTFT
from skylb.core.plugins.prefer_peer import PreferFasterPeer
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.scoring import least_loaded, loads_imbalanced
from skylb.core.profile import Turns
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PushToPrefixHolder", "queue_shorter_than_batch"]


class PushToPrefixHolder:
    """Rule: the least loaded full local replica holding the request's prefix, when no replica with room holds it
    and the local loads are not imbalanced, or a peer with room predicted faster than that push (``escape``); else
    no opinion.

    Args:
        locality: the replica trie. turns: the shared tie-break counter.
        abs_threshold, rel_threshold: the load guard (no push while outstanding requests are imbalanced).
        escape: the peer pricing (None: the push is not priced); estimate: the local picker pricing the holder.
    """

    def __init__(self, locality: PrefixLocality, turns: Turns, *, abs_threshold: int, rel_threshold: float,
                 escape: PreferFasterPeer | None = None, estimate: EstimatedTTFT | None = None):
        self.locality, self.turns = locality, turns
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.escape, self.estimate = escape, estimate

    def decide(self, c: Candidates, picked: ReplicaState | None) -> ReplicaState | PeerState | None:
        """The holder to push ``c.request`` into, a peer faster than that push, or None."""
        deepest = self.locality.deepest(c.request)
        if deepest is not None:
            # Settled without listing the full replicas (most requests): no replica holds the prefix deep enough, or
            # one with room holds the deepest match, which the match among the full ones and those with room reaches.
            if not deepest.targets or deepest.ratio < self.locality.threshold:
                return None
            if any(r.id in deepest.targets for r in c.local):
                return None
        busy = c.busy
        if not busy:
            return None
        everyone = [*c.local, *busy]
        # Not the decision's kept match: that one is over the replicas with room, which the rest of the rule prices.
        m = self.locality.match_among(c.request, {r.id for r in everyone})
        if not m.targets or m.ratio < self.locality.threshold or any(r.id in m.targets for r in c.local):
            return None
        holders = [r for r in busy if r.id in m.targets and queue_shorter_than_batch(r)]
        if not holders:
            return None
        holder = least_loaded(holders, self.turns.next())
        if loads_imbalanced(everyone, self.abs_threshold, self.rel_threshold):
            return None
        return self._cheaper_peer(c, holder) or holder

    def _cheaper_peer(self, c: Candidates, holder: ReplicaState) -> PeerState | None:
        """A peer with room predicted faster than pushing into ``holder`` (module docstring), or None (no
        pricing, no peer with room, or the holder's service time not measured yet)."""
        if self.escape is None or self.estimate is None or not c.peers or not c.request.may_forward:
            return None
        service_s = holder.rates.overall.service_s
        if service_s is None:
            return None
        push_s = slot_wait_s(holder, service_s) + self.estimate.local_costs(c.request, [holder])[holder.id]
        return self.escape.cheaper_peer(c, push_s, holder, holders_only=True)


def queue_shorter_than_batch(replica: ReplicaState) -> bool:
    """True when ``replica``'s batch is bounded only by its learned admission capacity (skylb/core/capacity.py)
    and fewer requests wait for it than that capacity, so a request pushed there starts within about one turnover
    of the batch. False for an engine that reports its slots (llama.cpp) or a replica with ``max_concurrency``:
    those bounds are stated, not estimated, and are never exceeded."""
    if replica.slots is not None or replica.max_concurrency is not None or replica.running is None:
        return False
    limit = replica.capacity.limit
    # The probe's running and waiting, plus what this balancer sent since; its own in-flight count never errs low.
    waiting = max(replica.running + replica.pending + replica.sent_since_probe, replica.outstanding) - limit
    return waiting < limit
