"""The plugins that routing profiles are composed of (skylb/core/profile.py), one module each.

========================  ==============  ===================================================================
module                    kind            what it does
========================  ==============  ===================================================================
``least_load``            replica picker  fewest in flight, ties take turns (baseline LL)
``round_robin``           replica picker  replicas in id order (baseline RR)
``hash_ring``             pickers         consistent hashing of the session key, local and peer (CH, SkyLB-CH)
``sglang_tree``           replica picker  SGLang's cache-aware choice over its approximate tree
``estimated_wait``        replica picker  OllamaRouter's least estimated wait from measured speed
``prefix_match``          pickers         the paper's longest prefix match (replica trie, regional snapshot)
``estimated_ttft``        replica picker  least estimated time to first token (the default's)
``most_room``             peer picker     the peer with the most room
``engine_pressure``       filter          prefill backlog and KV usage
``sibling_holder``        rule (first)    a prefix a sibling's replica holds goes to that sibling
``push_to_holder``        rule (first)    a cache hit goes into its holder's full batch
``predicted_ttft``        rule (first)    every candidate priced by one cost, predicted TTFT
``prefer_peer``           rule (then)     a faster peer over the local pick
``hold_for_faster``       rule (then)     wait for a faster busy replica
``forward_queued``        rule (no room)  first come, first served across regions
``prefix_lookahead``      queue order     a free replica takes a queued request whose prefix it holds
``prefix_locality``       learner         the replica and regional snapshot tries
``kv_locality``           locality        exact cached tokens from engines' KV-cache events (prefix_locality asks
                                          it first for replicas whose event stream is live)
``scoring``               helpers         trie keys, the imbalance test, least load, most room
========================  ==============  ===================================================================
"""
