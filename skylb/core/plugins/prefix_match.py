"""Longest prefix match (SkyLB paper §3.2-§3.3, Algorithm 1 lines 18-21): the candidate with the longest matching
prefix in this balancer's replica trie (local replicas) or regional snapshot trie (peers).

When the match covers less than ``threshold`` of the prompt, the least loaded candidate (or the peer with most room)
instead: the prototype's SGLang-derived rule, a weak match is not worth concentrating load for. Load guard (the
SkyLB prototype's rule, ported from the SGLang router's cache-aware policy, sgl-project/sglang
``sgl-router/src/policies/cache_aware.rs``): when the candidates' outstanding requests are imbalanced (max - min >
``abs_threshold`` and max > ``rel_threshold`` x min), the least loaded wins over the prefix match; without it a
popular shared prefix keeps feeding one replica, which stays available long because shared KV blocks let it admit
many requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.scoring import least_loaded, loads_imbalanced, most_room
from skylb.core.profile import Turns
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PrefixMatch", "SnapshotMatch"]


class PrefixMatch:
    """ReplicaPicker: the least loaded of the replicas holding the deepest replica-trie match (at least
    ``locality.threshold``), unless the load guard trips; else the least loaded."""

    def __init__(self, locality: PrefixLocality, turns: Turns, *, abs_threshold: int, rel_threshold: float):
        self.locality, self.turns = locality, turns
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The pick among ``candidates`` (non-empty)."""
        if len(candidates) > 1 and loads_imbalanced(candidates, self.abs_threshold, self.rel_threshold):
            return least_loaded(candidates, self.turns.next())
        by_id = {c.id: c for c in candidates}
        m = self.locality.replica_trie.match(self.locality.key(request), by_id)
        if m.targets and m.ratio >= self.locality.threshold:
            return least_loaded([by_id[t] for t in sorted(m.targets)], self.turns.next())
        return least_loaded(candidates, self.turns.next())


class SnapshotMatch:
    """PeerPicker: the peer with most room among those holding the largest fraction of the prompt
    (PrefixLocality.peer_fractions: a region summary of KV-cache blocks, else the regional snapshot's match; at least
    ``locality.threshold``); else the peer with most room."""

    def __init__(self, locality: PrefixLocality):
        self.locality = locality

    def pick(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """The pick among ``candidates`` (non-empty, peers with room)."""
        held = self.locality.peer_fractions(request, candidates)
        if held:
            best = max(held.values())
            return most_room([c for c in sorted(candidates, key=lambda c: c.region) if held.get(c.region) == best])
        return most_room(candidates)
