"""Scoring helpers the policies share: trie keys, load imbalance, least load, the peer with most room.

Each helper is a pure function over candidate states; policies combine them (the Gateway API Inference
Extension endpoint picker's filter -> scorer -> picker shape).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.prefix_trie import Match, PrefixTrie
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["trie_key", "loads_imbalanced", "least_loaded", "most_room", "prefix_lookahead"]


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
    low = min(c.outstanding + c.sent_since_probe for c in candidates)
    tied = [c for c in candidates if c.outstanding + c.sent_since_probe == low]
    return tied[turn % len(tied)]


def most_room(candidates: Sequence[PeerState]) -> PeerState:
    """The peer with the most available replicas left after its queue and what was sent since its status;
    then the fewest requests this balancer has in flight there; then the region name (deterministic)."""
    return max(candidates, key=lambda p: (p.available_replicas - p.queue_len - p.sent_since_probe,
                                          -p.outstanding, p.region))


def prefix_lookahead(window: Sequence[Request], local: Sequence[ReplicaState], replicas: Sequence[ReplicaState],
                     trie: PrefixTrie, threshold: float) -> int:
    """Index in ``window`` (queued requests, head first) of the one to place next for a prefix-aware queue.

    With local replicas free (``local``): the first request whose prompt ``trie`` matches on a free replica that
    serves its model, over at least ``threshold`` of the prompt (a cache hit there). With none free (only peers):
    the first that may be forwarded and has no such match on any of ``replicas`` (its cache is not here anyway).
    Otherwise 0, the head. At most ``len(window)`` trie walks, each kept on its request while the trie does not
    change under its key (prefix_trie.KeptMatch, which answers for whichever replicas are free): the same requests
    are scanned again on every dispatch, and a long prompt's walk is most of a scan's time (bench/results/overhead.md
    part (d)). Source: SGLang's
    scheduler orders its waiting queue by longest prefix match (``schedule_policy.py``, "lpm") for the same
    reason: under load, a cache hit is prefill saved; here only within a bounded window, and the router bounds
    how often the head is passed over.
    """
    if local:
        serving: dict[tuple[str, str], frozenset[str]] = {}  # the free replicas serving each (model, api)
        for i, req in enumerate(window):
            ids = serving.get((req.model, req.api))
            if ids is None:
                ids = serving[req.model, req.api] = frozenset(r.id for r in local if r.serves(req.model, req.api))
            if ids:
                m = _kept_match(req, trie, ids)
                if m.targets and m.ratio >= threshold:
                    return i
        return 0
    all_ids = frozenset(r.id for r in replicas)
    for i, req in enumerate(window):
        if req.may_forward:
            m = _kept_match(req, trie, all_ids)
            if not m.targets or m.ratio < threshold:
                return i
    return 0


def _kept_match(request: Request, trie: PrefixTrie, available: frozenset[str]) -> Match:
    """``trie.match`` of ``request`` among ``available``, from the KeptMatch kept on the request."""
    kept = request.kept_match = trie.kept_match(trie_key(request, trie), request.kept_match)
    return kept.match(available)
