"""``sglang-selective``: SGLang's cache-aware choice among available replicas only, with a prefix-aware queue.

The SkyLB paper's extension of the SGLang router (§5.2, Fig. 9 "SP-P" and "SP-O"): a request waits at the balancer
until some replica is available, and the cache-aware rule (skylb/core/plugins/sglang_tree.py) chooses among the
available ones only. With engines that report pending requests this is SP-P; with replicas that have configured
slots and no pending metric it is SP-O, a fixed cap on outstanding requests per replica.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.plugins.most_room import MostRoom
from skylb.core.plugins.prefix_lookahead import PrefixLookahead
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.policies.sglang import SGLangOptions, sglang_tree
from skylb.core.profile import Profile

__all__ = ["SGLangSelectiveOptions", "sglang_selective"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SGLangSelectiveOptions(SGLangOptions):
    """Options of ``sglang-selective``: SGLang's, and the queue's look-ahead (skylb/core/plugins/prefix_lookahead.py).

    Attributes:
        queue_lookahead: how many queued requests, from the head, are searched for one whose prefix a free replica
            holds (0 or 1: first come, first served, the paper's SP-P).
        max_bypass: how many times the head may be passed over for a later request before it goes first.
    """

    queue_lookahead: int = Field(64, ge=0)
    max_bypass: int = Field(64, ge=0)


def sglang_selective(options: SGLangSelectiveOptions) -> Profile:
    """SGLang's cache-aware choice among available replicas only (selective pushing), and a prefix-aware queue:
    a free replica takes the first of the next ``queue_lookahead`` queued requests whose prefix it holds."""
    tree = sglang_tree(options)
    return Profile("sglang-selective", options, local=tree, peer=MostRoom(), learners=(tree,),
                   queue=PrefixLookahead(lambda: tree.tree, options.match_threshold),
                   lookahead=options.queue_lookahead, max_bypass=options.max_bypass)


register("sglang-selective", SGLangSelectiveOptions, sglang_selective)
