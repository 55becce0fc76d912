"""The routing core: pure (no I/O, no clock reads), shared by the live balancer and the simulator.

Source: SkyLB paper §3 and Algorithm 1.
"""

from skylb.core.hash_ring import HashRing
from skylb.core.policies import POLICIES, Policy, make_policy
from skylb.core.prefix_trie import Match, PrefixTrie, chunk_text
from skylb.core.request import Request
from skylb.core.router import Decision, QueueFull, Router
from skylb.core.state import AvailabilityRules, PeerState, ReplicaState

__all__ = [
    "AvailabilityRules", "Decision", "HashRing", "Match", "POLICIES", "PeerState", "Policy", "PrefixTrie",
    "QueueFull", "ReplicaState", "Request", "Router", "chunk_text", "make_policy",
]
