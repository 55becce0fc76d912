"""``skylb-ch``: consistent hashing of the session key with selective pushing.

SkyLB paper §3.2 "SkyLB-CH" and Algorithm 1 lines 23-26: a ring at both layers (local replicas, peer regions),
walking past unavailable targets. The blind baseline on the same ring is ``consistent-hash``
(skylb/core/policies/consistent_hash.py).

A request without a session key is keyed by the first ``fallback_key_chars`` characters of its prompt (as Olla does), so
requests sharing a system prompt and first turn stay together.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.hash_ring import HashRing
from skylb.core.policies.base import OPTIONS_CONFIG, Policy
from skylb.core.policies.scoring import most_room

__all__ = ["HashRingPolicy", "HashRingOptions"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class HashRingOptions:
    """Options of the hash-ring policies.

    Attributes:
        hash_ring_vnodes: virtual nodes per ring member (uhashring's default, 160).
        fallback_key_chars: characters of the prompt that key a request without a session key.
    """

    hash_ring_vnodes: int = Field(160, gt=0)
    fallback_key_chars: int = Field(512, gt=0)


class HashRingPolicy(Policy, name="skylb-ch"):
    """The ring owner of the request's key among the candidates, at both layers; least load if none."""

    Options = HashRingOptions

    def __init__(self, options: HashRingOptions | None = None):
        super().__init__(options)
        self.replica_ring = HashRing(vnodes=self.options.hash_ring_vnodes)
        self.peer_ring = HashRing(vnodes=self.options.hash_ring_vnodes)

    def _key(self, request) -> str:
        return request.session_key or request.text[: self.options.fallback_key_chars]

    def pick_replica(self, request, candidates):
        by_id = {c.id: c for c in candidates}
        chosen = self.replica_ring.pick(self._key(request), by_id)
        return by_id[chosen] if chosen is not None else self.least_loaded(candidates)

    def pick_peer(self, request, candidates):
        by_region = {c.region: c for c in candidates}
        chosen = self.peer_ring.pick(self._key(request), by_region)
        return by_region[chosen] if chosen is not None else most_room(candidates)

    def set_members(self, replicas, peers):
        self.replica_ring.set_targets(replicas)
        self.peer_ring.set_targets(peers)
