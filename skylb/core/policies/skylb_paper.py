"""``skylb-paper``: prefix trie + selective pushing, the paper's rule (SkyLB paper §3.2-§3.3, Algorithm 1 lines
18-21), kept for reproduction; ``skylb`` (estimated_wait.py) builds on it.

A replica is available only by the paper's rule (0 pending at the latest probe; AvailabilityRules): a finished
request does not make its replica available before the next probe (``reuse_freed_slots`` False).

Among the available candidates, the one with the longest matching prefix in this balancer's replica trie; when the
match covers less than ``match_threshold`` of the prompt, the least loaded candidate instead (the prototype's
SGLang-derived rule, threshold 0.5: a weak match is not worth concentrating load for). Peers are chosen the same way
in the regional snapshot trie (what this balancer forwarded to each).

Load guard (the SkyLB prototype's rule, ported from the SGLang router's cache-aware policy, sgl-project/sglang
``sgl-router/src/policies/cache_aware.rs``): when
the candidates' loads are imbalanced (max - min outstanding > ``balance_abs_threshold`` and max >
``balance_rel_threshold`` x min), the least loaded candidate wins over the prefix match. Without it a popular shared
prefix keeps feeding one replica, which stays "available" for a long time because shared KV blocks let it admit
many requests.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.policies.base import OPTIONS_CONFIG, Policy
from skylb.core.policies.scoring import loads_imbalanced, most_room, trie_key
from skylb.core.prefix_trie import PrefixTrie

__all__ = ["SkyLBPaperPolicy", "SkyLBPaperOptions"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SkyLBPaperOptions:
    """Options of ``skylb``.

    Attributes:
        trie_max_chars: bound of each trie, in stored characters.
        trie_max_bytes: bound of each trie's memory in bytes, nodes and eviction log (64 MiB; prefix_trie.py).
        trie_chunk_chars: characters of a prompt's first trie nodes (256, about 50 tokens).
        trie_chunk_doubling: chunks double in length after every this many (0: never; prefix_trie.py).
        match_threshold: the smallest matched fraction of the prompt (0-1) that routes by prefix.
        balance_abs_threshold, balance_rel_threshold: the load guard's thresholds (prototype: 32 and 1.0001).
    """

    trie_max_chars: int = Field(8_000_000, gt=0)
    trie_max_bytes: int = Field(64 * 2 ** 20, gt=0)
    trie_chunk_chars: int = Field(256, gt=0)
    trie_chunk_doubling: int = Field(16, ge=0)
    match_threshold: float = Field(0.5, ge=0, le=1)
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.0001, ge=1)


class SkyLBPaperPolicy(Policy, name="skylb-paper"):
    """Longest prefix match over the available candidates (replica trie, or regional snapshot for peers)."""

    Options = SkyLBPaperOptions
    reuse_freed_slots = False

    def __init__(self, options: SkyLBPaperOptions | None = None):
        super().__init__(options)
        o = self.options
        self.replica_trie = PrefixTrie(max_chars=o.trie_max_chars, max_bytes=o.trie_max_bytes,
                                       chunk_chars=o.trie_chunk_chars, double_every=o.trie_chunk_doubling)
        self.snapshot_trie = PrefixTrie(max_chars=o.trie_max_chars, max_bytes=o.trie_max_bytes,
                                        chunk_chars=o.trie_chunk_chars, double_every=o.trie_chunk_doubling)
        self._replicas: set[str] = set()
        self._peers: set[str] = set()

    def _key(self, request):
        return trie_key(request, self.replica_trie)

    def imbalanced(self, candidates) -> bool:
        """True when the candidates' outstanding requests differ enough to route by load instead of prefix."""
        return loads_imbalanced(candidates, self.options.balance_abs_threshold, self.options.balance_rel_threshold)

    def pick_replica(self, request, candidates):
        if len(candidates) > 1 and self.imbalanced(candidates):
            return self.least_loaded(candidates)
        by_id = {c.id: c for c in candidates}
        m = self.replica_trie.match(self._key(request), by_id)
        if m.targets and m.ratio >= self.options.match_threshold:
            return self.least_loaded([by_id[t] for t in sorted(m.targets)])
        return self.least_loaded(candidates)

    def pick_peer(self, request, candidates):
        by_region = {c.region: c for c in candidates}
        m = self.snapshot_trie.match(self._key(request), by_region)
        if m.targets and m.ratio >= self.options.match_threshold:
            return most_room([by_region[t] for t in sorted(m.targets)])
        return most_room(candidates)

    def routed(self, request, *, replica=None, peer=None):
        if replica is not None:
            self.replica_trie.insert(self._key(request), replica)
        elif peer is not None:
            self.snapshot_trie.insert(self._key(request), peer)

    def set_members(self, replicas, peers):
        replicas, peers = set(replicas), set(peers)
        for gone in self._replicas - replicas:
            self.replica_trie.remove_target(gone)
        for gone in self._peers - peers:
            self.snapshot_trie.remove_target(gone)
        self._replicas, self._peers = replicas, peers
