"""The routing core: pure (no I/O, no clock reads), shared by the live balancer and the simulator.

Source: SkyLB paper §3 and Algorithm 1. ``build_router`` (builder.py) is the one way from settings to a Router.
"""

from skylb.core.builder import RouterSettings, build_policy, build_router, build_rules
from skylb.core.hash_ring import HashRing
from skylb.core.policies import POLICIES, Policy, PolicyError, make_policy, policy_names, policy_options
from skylb.core.prefix_trie import Match, PrefixTrie, chunk_text
from skylb.core.request import Request
from skylb.core.router import Decision, QueueFull, Router
from skylb.core.state import AvailabilityRules, PeerState, PeerStatus, ReplicaState

__all__ = [
    "AvailabilityRules", "Decision", "HashRing", "Match", "POLICIES", "PeerState", "PeerStatus", "Policy",
    "PolicyError",
    "PrefixTrie", "QueueFull", "ReplicaState", "Request", "Router", "RouterSettings", "build_policy",
    "build_router", "build_rules", "chunk_text", "make_policy", "policy_names", "policy_options",
]
