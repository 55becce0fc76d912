"""Routing policies as plugins: which target, among the candidates the availability rules let through, gets a
request. One module per policy; ``scoring`` holds what they share; ``base`` the interface and the registry.

========================  ========  ==================================================================
name                      pushing   module
========================  ========  ==================================================================
``skylb``                 selective ``estimated_wait``: prefix trie + estimated wait, forwards when a peer is
                                    faster (the default; issue 8)
``skylb-paper``           selective ``prefix``: prefix trie + regional snapshot, the paper's rule (§3.2-§3.3)
``skylb-ch``              selective ``hash_ring``: consistent hashing of the session key (paper §3.2)
``estimated-wait``        blind     ``measured_wait``: least estimated wait from measured speed (seed 000)
``round-robin``           blind     ``round_robin`` (baseline RR)
``least-load``            blind     ``least_load`` (baseline LL)
``consistent-hash``       blind     ``hash_ring`` (baseline CH)
``sglang``                blind     ``sglang``: SGLang's cache_aware router (baseline SGL, Fig. 9 BP)
``sglang-selective``      selective ``sglang``: the same with a queue (Fig. 9 SP-P / SP-O)
========================  ========  ==================================================================
"""

from skylb.core.policies.base import (POLICIES, Policy, PolicyError, make_policy, options_class, policy_names,
                                      policy_options)
from skylb.core.policies.estimated_wait import EstimatedWaitPolicy
from skylb.core.policies.hash_ring import ConsistentHashPolicy, HashRingPolicy
from skylb.core.policies.least_load import LeastLoadPolicy
from skylb.core.policies.measured_wait import MeasuredWaitPolicy
from skylb.core.policies.prefix import PrefixPolicy
from skylb.core.policies.round_robin import RoundRobinPolicy
from skylb.core.policies.scoring import least_loaded, loads_imbalanced, most_room, trie_key
from skylb.core.policies.sglang import SGLangCacheAwarePolicy, SGLangSelectivePolicy

__all__ = ["POLICIES", "Policy", "PolicyError", "make_policy", "options_class", "policy_names", "policy_options",
           "PrefixPolicy", "EstimatedWaitPolicy", "HashRingPolicy", "ConsistentHashPolicy", "RoundRobinPolicy",
           "LeastLoadPolicy", "MeasuredWaitPolicy",
           "SGLangCacheAwarePolicy", "SGLangSelectivePolicy", "trie_key", "loads_imbalanced", "least_loaded",
           "most_room"]
