"""The SGLang router's ``cache_aware`` choice (sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``).

Per request:

1. Load = this balancer's in-flight requests per worker (``ReplicaState.outstanding``). When the candidates are
   imbalanced, ``max - min > abs_threshold`` and ``max > rel_threshold * min``, route to the least loaded (ties:
   replica id) and still record the prompt in the tree.
2. Otherwise match the prompt in the approximate tree; when the matched fraction is at least ``threshold``
   (SGLang's ``cache_threshold``) route to a matched worker (several tie: the least loaded, then id; SGLang takes
   one tenant of the node).
3. Otherwise route to the worker with the smallest tree (characters recorded for it; ties: id).

Approximations: the tree is the core's chunked PrefixTrie (``chunk_chars`` characters per node instead of single
characters); a worker's tree size grows by the characters of each prompt it did not already hold and is not reduced
by eviction (SGLang evicts by LRU every 120 s beyond its max tree size; a simulated run stays far below 2^26
characters, so eviction does not happen there).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.plugins.scoring import loads_imbalanced, trie_key
from skylb.core.prefix_trie import PrefixTrie
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["SGLangTree"]


class SGLangTree:
    """ReplicaPicker and Learner: SGLang's approximate tree and its choice.

    Args:
        threshold: smallest match ratio (0-1) routed by prefix. abs_threshold, rel_threshold: the imbalance test.
        max_chars: bound of the tree in characters. chunk_chars: characters per tree node.
    """

    def __init__(self, *, threshold: float, abs_threshold: int, rel_threshold: float, max_chars: int,
                 chunk_chars: int):
        self.threshold, self.abs_threshold, self.rel_threshold = threshold, abs_threshold, rel_threshold
        # SGLang bounds its tree in characters only: the byte bound is set out of the way.
        self.tree = PrefixTrie(max_chars=max_chars, chunk_chars=chunk_chars, max_bytes=2 ** 40)
        #: replica id -> characters recorded for it in the tree (SGLang's per-tenant size).
        self.tree_chars: dict[str, int] = {}

    def key(self, request: Request) -> tuple[str, ...]:
        """``request``'s prompt in the tree's chunks."""
        return trie_key(request, self.tree)

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """SGLang's choice among ``candidates`` (non-empty): steps 1-3 of the module docstring."""
        if loads_imbalanced(candidates, self.abs_threshold, self.rel_threshold):
            return min(candidates, key=lambda c: (c.outstanding, c.id))
        by_id = {c.id: c for c in candidates}
        m = self.tree.match(self.key(request), by_id)
        if m.targets and m.ratio >= self.threshold:
            return min((by_id[t] for t in m.targets), key=lambda c: (c.outstanding, c.id))
        return min(candidates, key=lambda c: (self.tree_chars.get(c.id, 0), c.id))

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Record ``request``'s prompt for ``replica`` and grow its size by the characters it did not hold."""
        if replica is None:
            return
        key = self.key(request)
        held = self.tree.match(key, (replica,)).matched_chars
        self.tree_chars[replica] = self.tree_chars.get(replica, 0) + sum(map(len, key)) - held
        self.tree.insert(key, replica)

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """Forget replicas that left; start new ones at size 0."""
        for gone in set(self.tree_chars) - replicas:
            self.tree.remove_target(gone)
            del self.tree_chars[gone]
        for r in replicas:
            self.tree_chars.setdefault(r, 0)
