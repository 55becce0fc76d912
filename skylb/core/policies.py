"""Routing policies: which target, among the candidates the availability rules let through, gets a request.

A policy answers two narrow questions (pick a local replica, pick a peer) and learns from each decision. Policies
register themselves by name (``class X(Policy, name="x")``); ``make_policy(name, ...)`` builds one by name.

- ``skylb``: prefix trie + selective pushing (SkyLB paper §3.2-§3.3, Algorithm 1 lines 18-21). Among the available
  candidates, the one with the longest matching prefix; when the match covers less than ``match_threshold`` of the
  prompt, the least loaded candidate instead (the prototype's SGLang-derived rule, threshold 0.5: a weak match is not
  worth concentrating load for). One trie for local replicas, one regional snapshot for peers.
- ``skylb-ch``: consistent hashing of the session key + selective pushing (§3.2 "SkyLB-CH", lines 23-26).
- ``round_robin`` and ``least_load``: blind pushing baselines (§3.3): every request goes to a healthy local replica
  at once, whatever its pending count.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import ClassVar

from skylb.core.hash_ring import HashRing
from skylb.core.prefix_trie import PrefixTrie
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["Policy", "PrefixPolicy", "HashRingPolicy", "RoundRobinPolicy", "LeastLoadPolicy", "ConsistentHashPolicy",
           "SGLangCacheAwarePolicy", "SGLangSelectivePolicy", "make_policy", "trie_key", "loads_imbalanced",
           "POLICIES"]

#: name -> policy class, filled by ``Policy.__init_subclass__``.
POLICIES: dict[str, type["Policy"]] = {}


class Policy:
    """Base class: chooses among candidates the router already filtered; subclasses register with ``name=``.

    ``selective`` says whether the router offers only available replicas (selective pushing) or every healthy one
    (blind pushing).
    """

    name: ClassVar[str]
    selective: ClassVar[bool] = True

    def __init_subclass__(cls, *, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
            POLICIES[name] = cls

    def __init__(self, **_options):
        self._rotation = itertools.count()

    def pick_replica(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """Choose one of ``candidates`` (non-empty) for ``request``."""
        return self.least_loaded(candidates)

    def pick_peer(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """Choose one of ``candidates`` (non-empty, all available peers) for ``request``."""
        return max(candidates, key=lambda p: (p.available_replicas - p.queue_len - p.sent_since_probe,
                                              -p.outstanding, p.region))

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Learn from a decision: ``request`` went to local replica ``replica`` or to peer region ``peer``."""

    def set_members(self, replicas: Iterable[str], peers: Iterable[str]) -> None:
        """The current local replica ids and peer regions (members that left are forgotten)."""

    def least_loaded(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """Fewest outstanding requests from this balancer, ties rotated so idle replicas share the load."""
        low = min(c.outstanding + c.sent_since_probe for c in candidates)
        tied = [c for c in candidates if c.outstanding + c.sent_since_probe == low]
        return tied[next(self._rotation) % len(tied)]


def trie_key(request: Request, trie: PrefixTrie) -> tuple[str, ...]:
    """``request``'s prompt cut into ``trie``'s chunks, computed once per request and trie chunking."""
    if request.chunks is None or request.chunking != trie.chunking:
        request.chunks, request.chunking = trie.chunks(request.text), trie.chunking
    return request.chunks


def loads_imbalanced(candidates: Sequence[ReplicaState], abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's imbalance test over outstanding requests: max - min > abs and max > rel x min."""
    loads = [c.outstanding for c in candidates]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > rel_threshold * low


class PrefixPolicy(Policy, name="skylb"):
    """Longest prefix match over the available candidates (replica trie, or regional snapshot for peers).

    Load guard (the SkyLB prototype's rule, ported from SGLang's cache-aware policy; shared/reference/peers.md):
    when the candidates' loads are imbalanced (max - min outstanding > ``balance_abs`` and max > ``balance_rel`` x
    min), the least loaded candidate wins over the prefix match. Without it a popular shared prefix keeps feeding one
    replica, which stays "available" for a long time because shared KV blocks let it admit many requests.

    Args:
        trie_max_chars: bound of each trie, in stored characters. trie_chunk_chars: characters of a prompt's first
        trie nodes; trie_chunk_doubling: chunks double in length after every this many (0: never; prefix_trie.py).
        match_threshold: the smallest matched fraction of the prompt (0-1) that routes by prefix.
        balance_abs, balance_rel: the imbalance thresholds (prototype: 32 and 1.0001).
    """

    def __init__(self, *, trie_max_chars: int = 8_000_000, trie_chunk_chars: int = 256, trie_chunk_doubling: int = 16,
                 match_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.0001, **options):
        super().__init__(**options)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.replica_trie = PrefixTrie(max_chars=trie_max_chars, chunk_chars=trie_chunk_chars,
                                       double_every=trie_chunk_doubling)
        self.snapshot_trie = PrefixTrie(max_chars=trie_max_chars, chunk_chars=trie_chunk_chars,
                                        double_every=trie_chunk_doubling)
        self.match_threshold = match_threshold
        self._replicas: set[str] = set()
        self._peers: set[str] = set()

    def _key(self, request: Request) -> tuple[str, ...]:
        return trie_key(request, self.replica_trie)

    def imbalanced(self, candidates: Sequence[ReplicaState]) -> bool:
        """True when the candidates' outstanding requests differ enough to route by load instead of prefix."""
        return loads_imbalanced(candidates, self.balance_abs, self.balance_rel)

    def pick_replica(self, request, candidates):
        if len(candidates) > 1 and self.imbalanced(candidates):
            return self.least_loaded(candidates)
        by_id = {c.id: c for c in candidates}
        m = self.replica_trie.match(self._key(request), by_id)
        if m.targets and m.ratio >= self.match_threshold:
            return self.least_loaded([by_id[t] for t in sorted(m.targets)])
        return self.least_loaded(candidates)

    def pick_peer(self, request, candidates):
        by_region = {c.region: c for c in candidates}
        m = self.snapshot_trie.match(self._key(request), by_region)
        if m.targets and m.ratio >= self.match_threshold:
            return super().pick_peer(request, [by_region[t] for t in sorted(m.targets)])
        return super().pick_peer(request, candidates)

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


class HashRingPolicy(Policy, name="skylb-ch"):
    """Consistent hashing of the session key at both layers, walking past unavailable targets.

    A request without a session key is keyed by the first ``fallback_key_chars`` characters of its prompt (as Olla
    does), so requests sharing a system prompt and first turn stay together.
    """

    def __init__(self, *, hash_ring_vnodes: int = 160, fallback_key_chars: int = 512, **options):
        super().__init__(**options)
        self.replica_ring = HashRing(vnodes=hash_ring_vnodes)
        self.peer_ring = HashRing(vnodes=hash_ring_vnodes)
        self.fallback_key_chars = fallback_key_chars

    def _key(self, request: Request) -> str:
        return request.session_key or request.text[: self.fallback_key_chars]

    def pick_replica(self, request, candidates):
        by_id = {c.id: c for c in candidates}
        chosen = self.replica_ring.pick(self._key(request), by_id)
        return by_id[chosen] if chosen is not None else self.least_loaded(candidates)

    def pick_peer(self, request, candidates):
        by_region = {c.region: c for c in candidates}
        chosen = self.peer_ring.pick(self._key(request), by_region)
        return by_region[chosen] if chosen is not None else super().pick_peer(request, candidates)

    def set_members(self, replicas, peers):
        self.replica_ring.set_targets(replicas)
        self.peer_ring.set_targets(peers)


class RoundRobinPolicy(Policy, name="round_robin"):
    """Blind pushing, round robin over healthy local replicas (baseline)."""

    selective = False

    def pick_replica(self, request, candidates):
        ordered = sorted(candidates, key=lambda c: c.id)
        return ordered[next(self._rotation) % len(ordered)]


class LeastLoadPolicy(Policy, name="least_load"):
    """Blind pushing to the healthy local replica with the fewest outstanding requests (baseline)."""

    selective = False


def make_policy(name: str, **options) -> Policy:
    """Build the policy registered as ``name``; raises ValueError naming the known policies otherwise."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(**options)


# -- baselines for the simulated evaluation (bench/sim), appended: blind consistent hashing and SGLang's router -------


class ConsistentHashPolicy(HashRingPolicy, name="consistent_hash"):
    """Blind pushing by consistent hashing of the session key (baseline CH).

    Source: SkyLB paper §5.1 "Consistent Hashing (CH): a ring hash based consistent hashing algorithm, using the
    user's IP address and session ID as hash key", deployed as one balancer with blind pushing (Envoy's ring hash,
    peers.md). The ring is the same as SkyLB-CH's; the difference is that every healthy replica is a candidate, so a
    key always lands on its owner however loaded it is.
    """

    selective = False


class SGLangCacheAwarePolicy(Policy, name="sglang"):
    """SGLang router's ``cache_aware`` policy with blind pushing (baseline SGL; SkyLB paper §5.1, Fig. 9 "BP").

    Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` and reference/peers.md. Per request:

    1. Load = this balancer's in-flight requests per worker (``ReplicaState.outstanding``). When the candidates are
       imbalanced, ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``, route to the
       least loaded (ties: replica id) and still record the prompt in the tree.
    2. Otherwise match the prompt in the approximate tree; when the matched fraction is at least ``cache_threshold``
       route to a matched worker (several tie: the least loaded, then id; SGLang takes one tenant of the node).
    3. Otherwise route to the worker with the smallest tree (characters recorded for it; ties: id).

    Approximations: the tree is the core's chunked PrefixTrie (``trie_chunk_chars`` characters per node instead of
    single characters); a worker's tree size grows by the characters of each prompt it did not already hold and is
    not reduced by eviction (SGLang evicts by LRU every 120 s beyond ``max_tree_chars``; a simulated run stays far
    below 2^26 characters, so eviction does not happen there).

    Args:
        cache_threshold: smallest match ratio (0-1) routed by prefix (SGLang default 0.3 in recent releases).
        balance_abs_threshold, balance_rel_threshold: the imbalance test (defaults 64 and 1.5).
        max_tree_chars: bound of the tree in characters (SGLang's max tree size, 2^26).
        trie_chunk_chars: characters per tree node.
    """

    selective = False

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_chars: int = 2 ** 26, trie_chunk_chars: int = 64,
                 **options):
        super().__init__(**options)
        self.tree = PrefixTrie(max_chars=max_tree_chars, chunk_chars=trie_chunk_chars)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        #: replica id -> characters recorded for it in the tree (SGLang's per-tenant size).
        self.tree_chars: dict[str, int] = {}

    def _key(self, request: Request) -> tuple[str, ...]:
        return trie_key(request, self.tree)

    def imbalanced(self, candidates: Sequence[ReplicaState]) -> bool:
        """True when SGLang's imbalance test holds over ``candidates``' outstanding requests."""
        return loads_imbalanced(candidates, self.balance_abs_threshold, self.balance_rel_threshold)

    def pick_replica(self, request, candidates):
        if self.imbalanced(candidates):
            return min(candidates, key=lambda c: (c.outstanding, c.id))
        by_id = {c.id: c for c in candidates}
        m = self.tree.match(self._key(request), by_id)
        if m.targets and m.ratio >= self.cache_threshold:
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


class SGLangSelectivePolicy(SGLangCacheAwarePolicy, name="sglang-selective"):
    """SGLang's ``cache_aware`` choice with selective pushing (SkyLB paper §5.2, Fig. 9 "SP-P" and "SP-O").

    The paper extends SGLang's router with a queue: a request waits at the balancer until some replica is
    available, and the cache-aware rule chooses among the available ones only. With engines that report pending
    requests this is SP-P (available = 0 pending); with replicas configured by ``max_concurrency`` and no pending
    metric, the balancer derives pending = outstanding - max_concurrency (skylb/engines/openai.py), which is SP-O,
    a fixed cap on outstanding requests per replica.
    """

    selective = True


