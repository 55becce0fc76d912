"""``skylb-paper``: prefix trie + selective pushing, the paper's rule (SkyLB paper §3.2-§3.3, Algorithm 1 lines
18-21), kept for reproduction; ``skylb`` (skylb.py) builds on it.

A replica is available only by the paper's rule (0 pending at the latest probe; AvailabilityRules): a finished
request does not make its replica available before the next probe (``reuse_freed_slots`` False), and no request is
sent to wait in an engine's queue beyond its learned batch (``pending_allowance`` 0 unless the settings give one).

Among the available candidates, the one with the longest matching prefix in this balancer's replica trie; when the
match covers less than ``match_threshold`` of the prompt, the least loaded candidate instead (the prototype's
SGLang-derived rule, threshold 0.5: a weak match is not worth concentrating load for). Peers are chosen the same way
in the regional snapshot trie (what this balancer forwarded to each).

Load guard (the SkyLB prototype's rule, ported from the SGLang router's cache-aware policy, sgl-project/sglang
``sgl-router/src/policies/cache_aware.rs``): when the candidates' loads are imbalanced (max - min outstanding >
``balance_abs_threshold`` and max > ``balance_rel_threshold`` x min), the least loaded candidate wins over the prefix
match (skylb/core/plugins/prefix_match.py).
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.prefix_match import PrefixMatch, SnapshotMatch
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.profile import Profile, Turns

__all__ = ["SkyLBPaperOptions", "skylb_paper", "prefix_locality"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SkyLBPaperOptions:
    """Options of ``skylb-paper``.

    Attributes:
        trie_max_chars: bound of each trie, in stored characters.
        trie_max_bytes: bound of each trie's memory in bytes, nodes and eviction log (64 MiB; prefix_trie.py).
        trie_chunk_chars: characters of a prompt's first trie nodes (256, about 50 tokens).
        trie_chunk_doubling: chunks double in length after every this many (0: never; prefix_trie.py).
        match_threshold: the smallest matched fraction of the prompt (0-1) that routes by prefix.
        balance_abs_threshold, balance_rel_threshold: the load guard's thresholds (prototype: 32 and 1.0001).
    """

    trie_max_chars: int = Field(8_000_000, gt=0)
    trie_max_bytes: int = Field(64 * 2 ** 20, gt=0)
    trie_chunk_chars: int = Field(256, gt=0)
    trie_chunk_doubling: int = Field(16, ge=0)
    match_threshold: float = Field(0.5, ge=0, le=1)
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.0001, ge=1)


def prefix_locality(options: SkyLBPaperOptions) -> PrefixLocality:
    """The replica and snapshot tries configured by ``options``."""
    o = options
    return PrefixLocality(max_chars=o.trie_max_chars, max_bytes=o.trie_max_bytes, chunk_chars=o.trie_chunk_chars,
                          double_every=o.trie_chunk_doubling, threshold=o.match_threshold,
                          kv_bound=getattr(o, "trie_kv_bound", False))


def skylb_paper(options: SkyLBPaperOptions) -> Profile:
    """Longest prefix match over the available candidates (replica trie, or regional snapshot for peers); a
    replica is available by the paper's rule only (``reuse_freed_slots`` False)."""
    loc = prefix_locality(options)
    local = PrefixMatch(loc, Turns(), abs_threshold=options.balance_abs_threshold,
                        rel_threshold=options.balance_rel_threshold)
    return Profile("skylb-paper", options, local=local, peer=SnapshotMatch(loc), learners=(loc,),
                   reuse_freed_slots=False, tries=(loc.replica_trie, loc.snapshot_trie), pending_allowance=0)


register("skylb-paper", SkyLBPaperOptions, skylb_paper)
