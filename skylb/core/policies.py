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

__all__ = ["Policy", "PrefixPolicy", "HashRingPolicy", "RoundRobinPolicy", "LeastLoadPolicy", "make_policy",
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


class PrefixPolicy(Policy, name="skylb"):
    """Longest prefix match over the available candidates (replica trie, or regional snapshot for peers).

    Args:
        trie_max_chars: bound of each trie, in stored characters. trie_chunk_chars: characters per trie node.
        match_threshold: the smallest matched fraction of the prompt (0-1) that routes by prefix.
    """

    def __init__(self, *, trie_max_chars: int = 8_000_000, trie_chunk_chars: int = 64,
                 match_threshold: float = 0.5, **options):
        super().__init__(**options)
        self.replica_trie = PrefixTrie(max_chars=trie_max_chars, chunk_chars=trie_chunk_chars)
        self.snapshot_trie = PrefixTrie(max_chars=trie_max_chars, chunk_chars=trie_chunk_chars)
        self.match_threshold = match_threshold
        self._replicas: set[str] = set()
        self._peers: set[str] = set()

    def _key(self, request: Request) -> tuple[str, ...]:
        if request.chunks is None:
            request.chunks = self.replica_trie.chunks(request.text)
        return request.chunks

    def pick_replica(self, request, candidates):
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
