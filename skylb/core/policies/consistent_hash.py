"""``consistent-hash``: consistent hashing of the session key with blind pushing (baseline CH).

SkyLB paper §5.1 "Consistent Hashing (CH): a ring hash based consistent hashing algorithm, using the user's IP
address and session ID as hash key", deployed as one balancer with blind pushing (Envoy's ring hash): every healthy
replica is a candidate, so a key always lands on its owner however loaded it is. The ring and its options are
``skylb-ch``'s (skylb/core/policies/skylb_ch.py).
"""

from __future__ import annotations

from skylb.core.policies.base import register
from skylb.core.policies.skylb_ch import HashRingOptions, hash_ring
from skylb.core.profile import Profile

__all__ = ["consistent_hash"]


def consistent_hash(options: HashRingOptions) -> Profile:
    """Blind pushing by consistent hashing of the session key (baseline CH, paper §5.1)."""
    return hash_ring(options, name="consistent-hash", selective=False)


register("consistent-hash", HashRingOptions, consistent_hash)
