"""``skylb-ch``: consistent hashing of the session key with selective pushing (SkyLB paper §3.2 "SkyLB-CH",
Algorithm 1 lines 23-26): a ring at both layers (local replicas, peer regions), walking past unavailable targets
(skylb/core/plugins/hash_ring.py). The blind baseline on the same ring is ``consistent-hash``
(skylb/core/policies/consistent_hash.py).
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.plugins.hash_ring import PeerRing, ReplicaRing, SessionKey
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.profile import Profile, Turns

__all__ = ["HashRingOptions", "hash_ring"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class HashRingOptions:
    """Options of the hash-ring policies.

    Attributes:
        hash_ring_vnodes: virtual nodes per ring member (uhashring's default, 160).
        fallback_key_chars: characters of the prompt that key a request without a session key.
    """

    hash_ring_vnodes: int = Field(160, gt=0)
    fallback_key_chars: int = Field(512, gt=0)


def hash_ring(options: HashRingOptions, *, name: str = "skylb-ch", selective: bool = True) -> Profile:
    """The ring owner of the request's key among the candidates, at both layers; least load (most room) if none."""
    key = SessionKey(options.fallback_key_chars)
    local, peer = ReplicaRing(key, options.hash_ring_vnodes, Turns()), PeerRing(key, options.hash_ring_vnodes)
    # Selective pushing by the paper's rule sends no request to wait in an engine (pending_allowance 0); the
    # blind ring sends every request at once, so the allowance does not apply to it.
    return Profile(name, options, local=local, peer=peer, selective=selective, learners=(local, peer),
                   pending_allowance=0 if selective else 1)


register("skylb-ch", HashRingOptions, hash_ring)
