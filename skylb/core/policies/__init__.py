"""Named routing policies: each is a scheduling profile (skylb/core/profile.py) composed of plugins
(skylb/core/plugins/), built from its typed options; ``base`` holds the registry.

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

from skylb.core.policies.base import (POLICIES, PolicyError, PolicySpec, make_policy, options_class, policy_names,
                                      policy_options, register)
from skylb.core.policies import (consistent_hash, estimated_wait, least_load, round_robin, sglang,  # noqa: F401
                                 sglang_selective, skylb, skylb_ch, skylb_paper)
from skylb.core.profile import Profile

__all__ = ["POLICIES", "PolicyError", "PolicySpec", "Profile", "make_policy", "options_class", "policy_names",
           "policy_options", "register"]
