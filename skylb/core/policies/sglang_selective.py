"""``sglang-selective``: SGLang's cache-aware choice among available replicas only, with a prefix-aware queue.

The SkyLB paper's extension of the SGLang router (§5.2, Fig. 9 "SP-P" and "SP-O"): a request waits at the balancer
until some replica is available, and the cache-aware rule (skylb/core/policies/sglang.py) chooses among the
available ones only.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.policies.base import OPTIONS_CONFIG
from skylb.core.policies.scoring import prefix_lookahead
from skylb.core.policies.sglang import SGLangCacheAwarePolicy, SGLangOptions

__all__ = ["SGLangSelectivePolicy", "SGLangSelectiveOptions"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SGLangSelectiveOptions(SGLangOptions):
    """Options of ``sglang-selective``: SGLang's, and the queue's look-ahead (skylb/core/policies/scoring.py
    ``prefix_lookahead``).

    Attributes:
        queue_lookahead: how many queued requests, from the head, are searched for one whose prefix a free replica
            holds (0 or 1: first come, first served, the paper's SP-P).
        max_bypass: how many times the head may be passed over for a later request before it goes first.
    """

    queue_lookahead: int = Field(64, ge=0)
    max_bypass: int = Field(64, ge=0)


class SGLangSelectivePolicy(SGLangCacheAwarePolicy, name="sglang-selective"):
    """SGLang's cache-aware choice among available replicas only (selective pushing), and a prefix-aware queue:
    a free replica takes the first of the next ``queue_lookahead`` queued requests whose prefix it holds."""

    selective = True
    Options = SGLangSelectiveOptions

    def __init__(self, options: SGLangSelectiveOptions | None = None):
        super().__init__(options)
        self.queue_lookahead = self.options.queue_lookahead
        self.max_bypass = self.options.max_bypass

    def next_in_queue(self, window, local, peers, replicas):
        return prefix_lookahead(window, local, replicas, self.tree, self.options.match_threshold)
