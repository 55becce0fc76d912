"""Exact cache locality from the engines' KV-cache events: how much of a prompt each replica holds, by the block index.

Engines that publish KV-cache events (vLLM ``--kv-events-config``) feed the block index (skylb/core/kv_index.py);
a request whose block hashes were computed before it was queued (``Request.block_hashes``, skylb/core/kv_hash.py)
is then matched exactly: replica r holds ``matched_tokens[r]`` of its prompt, a fraction of ``prompt_tokens``.
Replicas whose event stream is not live (none configured, a lost stream, an engine without events) are absent from
the index's answer and keep the prefix trie's guess (:class:`CachedMatch` combines both). The prefix locality
(prefix_locality.py) asks this plugin first, so every plugin that prices "tokens it holds" gets the exact answer
(llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router). Pure: reads the index, never waits for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from skylb.core.estimate import prompt_tokens
from skylb.core.kv_index import BlockIndex
from skylb.core.request import Request

__all__ = ["CachedMatch", "KVLocality"]


@dataclass(frozen=True)
class CachedMatch:
    """A prompt's match among some replicas, exact where the index knows (the prefix trie's ``Match`` shape).

    Attributes:
        targets: the replicas holding the largest fraction (empty when none holds any).
        ratio: that fraction of the prompt, 0-1.
        exact: {live replica: fraction it holds, 0-1} for every replica whose events are live (members or not).
        trie_targets, trie_ratio: the trie's deepest match among the members without live events.
    """

    targets: frozenset[str]
    ratio: float
    exact: Mapping[str, float]
    trie_targets: frozenset[str]
    trie_ratio: float

    def fraction(self, replica_id: str) -> float:
        """The fraction of the prompt ``replica_id`` holds: the index's for a live replica, else the trie's ratio
        when it is among the trie's deepest match, else 0."""
        if replica_id in self.exact:
            return self.exact[replica_id]
        return self.trie_ratio if replica_id in self.trie_targets else 0.0


class KVLocality:
    """The block index's answer per request, kept while neither the request nor the index changes.

    Args:
        index: the block index the balancer's subscribers (or the simulator's engines) feed.
    """

    def __init__(self, index: BlockIndex):
        self.index = index
        self._memo: tuple[Request, int, dict[str, float] | None] | None = None

    def fractions(self, request: Request) -> dict[str, float] | None:
        """{live replica: fraction of ``request``'s prompt it holds, 0-1}, or None when the request has no block
        hashes or no replica's events are live (use the trie). O(block hashes) once per index change."""
        memo, changes = self._memo, self.index.changes
        if memo is not None and memo[0] is request and memo[1] == changes:
            return memo[2]
        answer = None
        if request.block_hashes is not None:
            tokens = self.index.matched_tokens(request.block_hashes)
            if tokens:
                total = prompt_tokens(request)
                answer = {r: min(1.0, n / total) for r, n in tokens.items()}
        self._memo = (request, changes, answer)
        return answer

    def combine(self, exact: Mapping[str, float], members: frozenset[str] | set[str], trie_match) -> CachedMatch:
        """The match among ``members``: exact fractions for live replicas, ``trie_match(others)`` (a prefix-trie
        ``Match`` over the members without live events) for the rest; the best fraction's holders are the targets."""
        others = [r for r in members if r not in exact]
        trie = trie_match(others) if others else None
        trie_targets = trie.targets if trie is not None else frozenset()
        trie_ratio = trie.ratio if trie is not None else 0.0
        fractions = {r: exact[r] for r in members if r in exact}
        fractions.update((r, trie_ratio) for r in trie_targets)
        best = max(fractions.values(), default=0.0)
        targets = frozenset(r for r, f in fractions.items() if f == best) if best > 0 else frozenset()
        return CachedMatch(targets, best, exact, frozenset(trie_targets), trie_ratio)
