"""Consistent hashing of the session key, at both layers: local replicas and peer regions (SkyLB paper §3.2
"SkyLB-CH", Algorithm 1 lines 23-26; baseline CH of §5.1 with blind pushing).

A request without a session key is keyed by the first ``fallback_key_chars`` characters of its prompt (as Olla
does), so requests sharing a system prompt and first turn stay together. A ring walks past members that are not
candidates; with none of them on the ring the least loaded replica (or the peer with most room) takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.hash_ring import HashRing
from skylb.core.plugins.scoring import least_loaded, most_room
from skylb.core.profile import Turns
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["SessionKey", "ReplicaRing", "PeerRing"]


class SessionKey:
    """A request's ring key: its session key, else the first ``fallback_chars`` characters of its prompt."""

    def __init__(self, fallback_chars: int):
        self.fallback_chars = fallback_chars

    def __call__(self, request: Request) -> str:
        return request.session_key or request.text[: self.fallback_chars]


class ReplicaRing:
    """ReplicaPicker and Learner: the ring owner of the request's key among the candidates (``vnodes`` virtual
    nodes per replica), else the least loaded."""

    def __init__(self, key: SessionKey, vnodes: int, turns: Turns):
        self.key, self.turns = key, turns
        self.ring = HashRing(vnodes=vnodes)

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The ring owner of ``request``'s key among ``candidates`` (non-empty), else the least loaded."""
        by_id = {c.id: c for c in candidates}
        chosen = self.ring.pick(self.key(request), by_id)
        return by_id[chosen] if chosen is not None else least_loaded(candidates, self.turns.next())

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """The ring's members are the local replicas."""
        self.ring.set_targets(replicas)


class PeerRing:
    """PeerPicker and Learner: the ring owner of the request's key among the peers with room, else most room."""

    def __init__(self, key: SessionKey, vnodes: int):
        self.key = key
        self.ring = HashRing(vnodes=vnodes)

    def pick(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """The ring owner of ``request``'s key among ``candidates`` (non-empty), else the one with most room."""
        by_region = {c.region: c for c in candidates}
        chosen = self.ring.pick(self.key(request), by_region)
        return by_region[chosen] if chosen is not None else most_room(candidates)

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """The ring's members are the peer regions."""
        self.ring.set_targets(peers)
