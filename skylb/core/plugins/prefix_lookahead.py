"""A prefix-aware queue order (QueueOrder): a free replica takes a queued request whose prefix it holds.

Source: SGLang's scheduler orders its waiting queue by longest prefix match (``python/sglang/srt/managers/
schedule_policy.py``, "lpm"): under load, a cache hit is prefill saved. Here only within a bounded window of the
queue, and the router bounds how often the head is passed over (the profile's ``max_bypass``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from skylb.core.plugins.scoring import trie_key
from skylb.core.prefix_trie import Match, PrefixTrie
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PrefixLookahead", "prefix_lookahead"]


class PrefixLookahead:
    """QueueOrder over the trie ``trie()`` returns (the replica trie, or SGLang's tree), a hit at ``threshold``."""

    def __init__(self, trie: Callable[[], PrefixTrie], threshold: float):
        self.trie, self.threshold = trie, threshold

    def next_in_queue(self, window: Sequence[Request], local: Sequence[ReplicaState], peers: Sequence[PeerState],
                      replicas: Sequence[ReplicaState]) -> int:
        """``prefix_lookahead`` over the trie (a free replica takes a request whose prefix it holds; with only
        peers free, one whose cache is not here goes first)."""
        return prefix_lookahead(window, local, replicas, self.trie(), self.threshold)


def prefix_lookahead(window: Sequence[Request], local: Sequence[ReplicaState], replicas: Sequence[ReplicaState],
                     trie: PrefixTrie, threshold: float) -> int:
    """Index in ``window`` (queued requests, head first) of the one to place next for a prefix-aware queue.

    With local replicas free (``local``): the first request whose prompt ``trie`` matches on a free replica that
    serves its model, over at least ``threshold`` of the prompt (a cache hit there). With none free (only peers):
    the first that may be forwarded and has no such match on any of ``replicas`` (its cache is not here anyway).
    Otherwise 0, the head. At most ``len(window)`` trie walks, each kept on its request while the trie does not
    change under its key (prefix_trie.KeptMatch, which answers for whichever replicas are free): the same requests
    are scanned again on every dispatch, and a long prompt's walk is most of a scan's time (bench/results/overhead.md
    part (d)). Source: the module docstring.
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
