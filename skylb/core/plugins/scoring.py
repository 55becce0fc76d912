"""Scoring helpers the plugins share: trie keys, load imbalance, least load, the peer with most room.

Each helper is a pure function over candidate states; plugins (skylb/core/plugins/) combine them.
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.prefix_trie import PrefixTrie
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["trie_key", "loads_imbalanced", "least_loaded", "most_room"]


def trie_key(request: Request, trie: PrefixTrie) -> tuple[str, ...]:
    """``request``'s prompt cut into ``trie``'s chunks, computed once per request and trie chunking."""
    if request.chunks is None or request.chunking != trie.chunking:
        request.chunks, request.chunking = trie.chunks(request.text), trie.chunking
    return request.chunks


def loads_imbalanced(candidates: Sequence[ReplicaState], abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's imbalance test over outstanding requests: max - min > abs and max > rel x min.

    Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (balance_abs_threshold,
    balance_rel_threshold); the SkyLB prototype uses the same rule as its load guard.
    """
    loads = [c.outstanding for c in candidates]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > rel_threshold * low


def least_loaded(candidates: Sequence[ReplicaState], turn: int) -> ReplicaState:
    """Fewest requests in flight from this balancer (outstanding plus those the last probe has not seen yet);
    among equals the ``turn``-th modulo their number, so idle replicas share the load."""
    loads = [c.outstanding + len(c.dispatch_times) for c in candidates]  # sent_since_probe, without a call each
    low = min(loads)
    tied = [c for c, load in zip(candidates, loads) if load == low]
    return tied[turn % len(tied)]


def most_room(candidates: Sequence[PeerState]) -> PeerState:
    """The peer with the most available replicas left after its queue and what was sent since its status;
    then the fewest requests this balancer has in flight there; then the region name (deterministic)."""
    return max(candidates, key=lambda p: (p.available_replicas - p.queue_len - p.sent_since_probe,
                                          -p.outstanding, p.region))
