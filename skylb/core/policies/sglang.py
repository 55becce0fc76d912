"""SGLang router's ``cache_aware`` policy with blind pushing: ``sglang`` (skylb/core/plugins/sglang_tree.py).

Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``. ``sglang`` is the SkyLB paper's baseline SGL
and Fig. 9 "BP"; ``sglang-selective`` (sglang_selective.py) is the same choice with a queue.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.plugins.most_room import MostRoom
from skylb.core.plugins.sglang_tree import SGLangTree
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.profile import Profile

__all__ = ["SGLangOptions", "sglang", "sglang_tree"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SGLangOptions:
    """Options of the SGLang policies (SGLang's defaults).

    Attributes:
        match_threshold: smallest match ratio (0-1) routed by prefix (SGLang's cache_threshold, 0.3).
        balance_abs_threshold, balance_rel_threshold: the imbalance test (SGLang: 64 and 1.5).
        trie_max_chars: bound of the tree in characters (SGLang's max tree size, 2^26).
        trie_chunk_chars: characters per tree node (SGLang's tree is per character; 64 keeps it cheap).
    """

    match_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    trie_max_chars: int = Field(2 ** 26, gt=0)
    trie_chunk_chars: int = Field(64, gt=0)


def sglang_tree(options: SGLangOptions) -> SGLangTree:
    """The SGLang tree plugin configured by ``options``."""
    return SGLangTree(threshold=options.match_threshold, abs_threshold=options.balance_abs_threshold,
                      rel_threshold=options.balance_rel_threshold, max_chars=options.trie_max_chars,
                      chunk_chars=options.trie_chunk_chars)


def sglang(options: SGLangOptions) -> Profile:
    """SGLang's cache-aware choice with blind pushing (every healthy replica is a candidate)."""
    tree = sglang_tree(options)
    return Profile("sglang", options, local=tree, peer=MostRoom(), selective=False, learners=(tree,))


register("sglang", SGLangOptions, sglang)
