"""Routing policies as plugins: which target, among the candidates the availability rules let through, gets a
request. One module per policy; ``scoring`` holds what they share; ``base`` the interface and the registry.

========================  ========  ==================================================================
name                      pushing   module
========================  ========  ==================================================================
``skylb``                 selective ``skylb``: prefix trie + estimated wait, forwards when a peer is faster (the
                                    default)
``skylb-paper``           selective ``skylb_paper``: prefix trie + regional snapshot, the paper's rule (§3.2-§3.3)
``skylb-ch``              selective ``skylb_ch``: consistent hashing of the session key (paper §3.2)
``estimated-wait``        blind     ``estimated_wait``: least estimated wait from measured speed (OllamaRouter)
``round-robin``           blind     ``round_robin`` (baseline RR)
``least-load``            blind     ``least_load`` (baseline LL)
``consistent-hash``       blind     ``consistent_hash`` (baseline CH)
``sglang``                blind     ``sglang``: SGLang's cache_aware router (baseline SGL, Fig. 9 BP)
``sglang-selective``      selective ``sglang_selective``: the same with a queue (Fig. 9 SP-P / SP-O)
========================  ========  ==================================================================
"""

from skylb.core.policies.base import (POLICIES, Policy, PolicyError, make_policy, options_class, policy_names,
                                      policy_options)
from skylb.core.policies.skylb import SkyLBPolicy
from skylb.core.policies.consistent_hash import ConsistentHashPolicy
from skylb.core.policies.skylb_ch import HashRingPolicy
from skylb.core.policies.least_load import LeastLoadPolicy
from skylb.core.policies.estimated_wait import EstimatedWaitPolicy
from skylb.core.policies.skylb_paper import SkyLBPaperPolicy
from skylb.core.policies.round_robin import RoundRobinPolicy
from skylb.core.policies.scoring import least_loaded, loads_imbalanced, most_room, trie_key
from skylb.core.policies.sglang import SGLangCacheAwarePolicy
from skylb.core.policies.sglang_selective import SGLangSelectivePolicy

__all__ = ["POLICIES", "Policy", "PolicyError", "make_policy", "options_class", "policy_names", "policy_options",
           "SkyLBPaperPolicy", "SkyLBPolicy", "HashRingPolicy", "ConsistentHashPolicy", "RoundRobinPolicy",
           "LeastLoadPolicy", "EstimatedWaitPolicy",
           "SGLangCacheAwarePolicy", "SGLangSelectivePolicy", "trie_key", "loads_imbalanced", "least_loaded",
           "most_room"]
