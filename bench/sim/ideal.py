"""The ideal prefix hit rate of a workload: what an infinite prefix cache on one replica would serve.

A physical limit no routing policy can pass (issue 8): every prompt block already seen in an earlier request of the
replayed requests is a hit, as if every request went to one replica whose KV cache never evicts. Prefix caches
(vLLM automatic prefix caching, SGLang's radix tree, llama.cpp's slot cache) reuse only a *prefix* of the prompt,
so a block counts only when every block before it counts too.

Granularity: ``block_tokens`` tokens per block, full blocks only, chained like vLLM's block hashes (block i is
identified by blocks 0..i), and at least the last prompt token is computed (an engine recomputes it for the
logits; bench/emulator/model.py ``cached_prefix_tokens`` does the same). With the simulator's engine block
(16 tokens, vLLM's default) the ideal is exactly the engine model's hit rule with an infinite cache; with 1 it is
the longest prefix shared with any earlier prompt (no engine caches more, whatever its block size). The
Mooncake trace's 512-token blocks (64 words at the simulator's 1/8 scale) are multiples of either, so every
trace block seen before is a hit here, as the issue defines it, plus the parts of blocks an engine can also
reuse.

With ``capacity_blocks`` the cache holds at most that many blocks and evicts the least recently used one (vLLM's
and SGLang's eviction order): the simulator passes the whole cluster's KV blocks pooled on one replica, the hit rate
the deployment's memory allows under perfect routing, and so a tighter limit than the infinite cache (on the warm
Mooncake window: 16.5% against 36.7%). It is still generous: running requests also need KV blocks.

Tokens are words (the benchmarks' convention: one token = one word, bench/replay/workload.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["ideal_cached_tokens", "ideal_hit_rate", "replay_ideal_hit_rate"]


def _cached(prompts: Iterable[Sequence[str]], block_tokens: int,
            capacity_blocks: int | None = None) -> Iterator[tuple[int, int]]:
    """(prompt tokens, ideal cached tokens) of each prompt in order; one prompt in memory at a time."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
    if block_tokens == 1:
        yield from _cached_per_token(prompts, capacity_blocks)
        return
    seen: OrderedDict[int, None] = OrderedDict()  # in use order, least recent first
    for tokens in prompts:
        limit = len(tokens) - 1  # the last token is always computed, so a block holding it is never a hit
        key, hits, matching = 0, 0, True
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            # A chained key: equal keys mean equal prompts up to this block (64-bit hash; collisions negligible).
            key = hash((key, tuple(tokens[start:start + block_tokens])))
            if matching and key in seen and start + block_tokens <= limit:
                hits += 1
                seen.move_to_end(key)
            else:
                matching = False
                seen[key] = None  # every full block is cached, the one holding the last token included
                seen.move_to_end(key)
                if capacity_blocks is not None and len(seen) > capacity_blocks:
                    seen.popitem(last=False)
        yield len(tokens), hits * block_tokens


def _cached_per_token(prompts: Iterable[Sequence[str]], capacity_tokens: int | None) -> Iterator[tuple[int, int]]:
    """``_cached`` at a block of 1 token, on a radix tree (SGLang's token-granular cache, bench/emulator/
    radix_cache.py): the longest prefix shared with an earlier prompt, less the last token; with
    ``capacity_tokens`` the least recently used leaves are evicted. The same figure as the chained per-token hashes,
    in time linear in the prompts' tokens compared run by run rather than hashed one by one."""
    from bench.emulator.radix_cache import RadixCache
    tree = RadixCache()
    for tokens in prompts:
        matched = tree.peek_prefix(tokens)
        tree.insert(tokens)
        if capacity_tokens is not None and tree.total_size > capacity_tokens:
            tree.evict(tree.total_size - capacity_tokens)
        yield len(tokens), min(matched, len(tokens) - 1) if tokens else 0


def ideal_cached_tokens(prompts: Iterable[Sequence[str]], *, block_tokens: int,
                        capacity_blocks: int | None = None) -> list[int]:
    """For each prompt in order, the tokens an infinite prefix cache fed with every earlier prompt would serve.

    ``prompts``: token lists in the order the requests were sent. ``block_tokens``: cache block size (tokens,
    >= 1). ``capacity_blocks``: bound the cache to this many blocks, least recently used evicted (None:
    infinite). Raises ValueError for a block size or capacity below 1.
    """
    return [cached for _, cached in _cached(prompts, block_tokens, capacity_blocks)]


def ideal_hit_rate(prompts: Iterable[Sequence[str]], *, block_tokens: int,
                   counted: Iterable[bool] | None = None, capacity_blocks: int | None = None) -> float | None:
    """Ideal cached tokens / prompt tokens (0-1) over ``prompts`` (in send order); None when there are no tokens.

    ``counted``: one flag per prompt, True for the prompts the rate is taken over (a measurement window); every
    prompt still feeds the cache, counted or not. Default: all. Prompts may be a generator (read once).
    ``capacity_blocks``: the cache's size in blocks, least recently used evicted (None: infinite). Raises
    ValueError for a block size or capacity below 1.
    """
    flags = iter(counted) if counted is not None else None
    total = hits = 0
    for n, cached in _cached(prompts, block_tokens, capacity_blocks):
        if flags is None or next(flags):
            total += n
            hits += cached
    return hits / total if total else None


def replay_ideal_hit_rate(requests: Sequence, *, block_tokens: int = 1) -> float | None:
    """The ideal hit rate of a live replay's requests (bench/replay/workload.py ``Request``, in arrival order), or None
    when the replay is closed loop (some request waits for another: its send order is known only at run time).

    ``block_tokens`` defaults to 1 (the longest prefix shared with any earlier prompt), a limit for every engine
    whatever its cache's block size (vLLM and the emulator 16 tokens, SGLang and llama.cpp per token).
    """
    if not requests or any(r.after is not None for r in requests):
        return None
    ordered = sorted(requests, key=lambda r: r.arrival_s)  # stable: the workload's own order breaks ties
    return ideal_hit_rate((r.prompt.split() for r in ordered), block_tokens=block_tokens)
