"""SGLang router's ``cache_aware`` policy: ``sglang`` (blind pushing) and ``sglang-selective`` (with a queue).

Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``. Per request:

1. Load = this balancer's in-flight requests per worker (``ReplicaState.outstanding``). When the candidates are
   imbalanced, ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``, route to the least
   loaded (ties: replica id) and still record the prompt in the tree.
2. Otherwise match the prompt in the approximate tree; when the matched fraction is at least ``match_threshold``
   (SGLang's ``cache_threshold``) route to a matched worker (several tie: the least loaded, then id; SGLang takes
   one tenant of the node).
3. Otherwise route to the worker with the smallest tree (characters recorded for it; ties: id).

Approximations: the tree is the core's chunked PrefixTrie (``trie_chunk_chars`` characters per node instead of
single characters); a worker's tree size grows by the characters of each prompt it did not already hold and is not
reduced by eviction (SGLang evicts by LRU every 120 s beyond its max tree size; a simulated run stays far below
2^26 characters, so eviction does not happen there).

``sglang`` is the paper's baseline SGL and Fig. 9 "BP". ``sglang-selective`` is the paper's extension (§5.2,
Fig. 9 "SP-P" and "SP-O"): a request waits at the balancer until some replica is available, and the cache-aware
rule chooses among the available ones only. With engines that report pending requests this is SP-P; with replicas
that have configured slots and no pending metric it is SP-O, a fixed cap on outstanding requests per replica.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.policies.base import OPTIONS_CONFIG, Policy
from skylb.core.policies.scoring import loads_imbalanced, trie_key
from skylb.core.prefix_trie import PrefixTrie

__all__ = ["SGLangCacheAwarePolicy", "SGLangOptions"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SGLangOptions:
    """Options of the SGLang policies (SGLang's defaults).

    Attributes:
        match_threshold: smallest match ratio (0-1) routed by prefix (SGLang's cache_threshold, 0.3).
        balance_abs_threshold, balance_rel_threshold: the imbalance test (SGLang: 64 and 1.5).
        trie_max_chars: bound of the tree in characters (SGLang's max tree size, 2^26).
        trie_chunk_chars: characters per tree node (SGLang's tree is per character; 64 keeps it cheap).
    """

    match_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    trie_max_chars: int = Field(2 ** 26, gt=0)
    trie_chunk_chars: int = Field(64, gt=0)


class SGLangCacheAwarePolicy(Policy, name="sglang"):
    """SGLang's cache-aware choice with blind pushing (every healthy replica is a candidate)."""

    selective = False
    Options = SGLangOptions

    def __init__(self, options: SGLangOptions | None = None):
        super().__init__(options)
        # SGLang bounds its tree in characters only: the byte bound is set out of the way.
        self.tree = PrefixTrie(max_chars=self.options.trie_max_chars, chunk_chars=self.options.trie_chunk_chars,
                               max_bytes=2 ** 40)
        #: replica id -> characters recorded for it in the tree (SGLang's per-tenant size).
        self.tree_chars: dict[str, int] = {}

    def _key(self, request):
        return trie_key(request, self.tree)

    def imbalanced(self, candidates) -> bool:
        """True when SGLang's imbalance test holds over ``candidates``' outstanding requests."""
        return loads_imbalanced(candidates, self.options.balance_abs_threshold, self.options.balance_rel_threshold)

    def pick_replica(self, request, candidates):
        if self.imbalanced(candidates):
            return min(candidates, key=lambda c: (c.outstanding, c.id))
        by_id = {c.id: c for c in candidates}
        m = self.tree.match(self._key(request), by_id)
        if m.targets and m.ratio >= self.options.match_threshold:
            return min((by_id[t] for t in m.targets), key=lambda c: (c.outstanding, c.id))
        return min(candidates, key=lambda c: (self.tree_chars.get(c.id, 0), c.id))

    def routed(self, request, *, replica=None, peer=None):
        if replica is None:
            return
        key = self._key(request)
        held = self.tree.match(key, (replica,)).matched_chars
        self.tree_chars[replica] = self.tree_chars.get(replica, 0) + sum(map(len, key)) - held
        self.tree.insert(key, replica)

    def set_members(self, replicas, peers):
        replicas = set(replicas)
        for gone in set(self.tree_chars) - replicas:
            self.tree.remove_target(gone)
            del self.tree_chars[gone]
        for r in replicas:
            self.tree_chars.setdefault(r, 0)
