"""The block index: which replica holds which KV-cache block, learned from the engines' KV-cache events.

Engines that publish KV-cache events (vLLM ``--kv-events-config``; wire format in
:mod:`skylb.engines.kv_wire`) say exactly which blocks they store and evict. A block is named by its 64-bit hash
(vLLM ``maybe_convert_block_hash``: the lower 64 bits of the chained block hash, ``vllm/v1/core/kv_cache_utils.py``);
a prompt's block hashes are chained, so the blocks a replica holds of a prompt form a prefix of its hash list.
:meth:`BlockIndex.matched_tokens` answers, per replica, how long that prefix is (the tokens it would not have to
prefill), the exact counterpart of the prefix trie's guess.

Memory is bounded in blocks (distinct hashes): beyond ``max_blocks`` the least recently stored blocks are forgotten
(a forgotten block only makes the index under-estimate a replica's cache). A holder (replica, medium, LoRA id) is a
bit in a small integer per block, so a block held by up to 8 holders costs one dict entry and its key
(``bench/micro/kv_index_memory.py`` measures the RSS). Dropping a replica (stream lost, reconnect, ``AllBlocksCleared``)
is O(1): its bits are retired and stripped from blocks lazily, when a block is next touched or evicted.

For peers, :meth:`BlockIndex.summary` gives a bounded region summary: the hashes of the held blocks whose hash is a
multiple of ``SUMMARY_STRIDE``, the most recently stored first (skylb/core/plugins/prefix_locality.py
``peer_fractions`` reads a peer's).

Pure: no I/O, no clock, no thread; the subscriber (:mod:`skylb.engines.kv_subscriber`) feeds it in the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

__all__ = ["BlockIndex", "Holder", "ReplicaEvents", "DEFAULT_MAX_BLOCKS", "SUMMARY_STRIDE", "MAX_SUMMARY_BLOCKS",
           "summary_sampled"]

#: Default bound of the index, in blocks: 10^6 blocks of 16 tokens are 16M tokens of KV cache, about 500 replicas
#: of 32k-token Llama-3.1-8B caches; about 100 MiB of index, 145 MiB at the allocator's high-water mark once evicting
#: (bench/results/kv_index.md).
DEFAULT_MAX_BLOCKS = 1_000_000
#: A block is in the region summary a balancer sends its peers (:meth:`BlockIndex.summary`) when its hash is a
#: multiple of this: one block in 8 on average, wherever it sits in its prompt (the hashes are uniform).
SUMMARY_STRIDE = 8
#: The most block hashes one summary carries (the most recently stored; 9 bytes each in msgpack: about 9.2 KiB).
MAX_SUMMARY_BLOCKS = 1024


def summary_sampled(block_hash: int) -> bool:
    """Whether a block with this hash is one a region summary carries (its hash a multiple of SUMMARY_STRIDE)."""
    return block_hash % SUMMARY_STRIDE == 0


class Holder(NamedTuple):
    """One holder of a block: the replica, the storage medium it reported (vLLM: "GPU", "CPU", "STORAGE" or None)
    and the LoRA adapter id (None for the base model)."""

    replica: str
    medium: str | None
    lora_id: int | None


@dataclass
class ReplicaEvents:
    """What the index knows of one replica's event stream (counters are totals since the index began).

    ``live`` is True while its event stream is connected and followed: only then does :meth:`BlockIndex.
    matched_tokens` report the replica, and a router uses the prefix trie for it otherwise. ``block_size`` is the
    tokens per block its latest ``BlockStored`` reported (None before one arrived).
    """

    live: bool = False
    block_size: int | None = None
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    gaps: int = 0
    replayed: int = 0
    unfilled_gaps: int = 0
    skipped_corrupt: int = 0
    skipped_unknown: int = 0
    drops: int = 0


class BlockIndex:
    """Block hash -> the holders that hold it, bounded in blocks, with per-replica stream state.

    Args:
        max_blocks: the most distinct block hashes kept (>= 1); beyond it the least recently stored are evicted,
            a batch of ``evict_batch`` at a time (default 1% of ``max_blocks``) so eviction stays amortised O(1).

    Raises ValueError for a bound below 1. Not thread-safe.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, *, evict_batch: int | None = None):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._evict_batch = max(1, min(max_blocks, evict_batch or max_blocks // 100))
        #: block hash -> bit mask of holder slots; insertion order is store recency (a re-store moves it last).
        self._blocks: dict[int, int] = {}
        self._slot_of: dict[tuple[str, str | None, int | None], int] = {}
        self._holder: list[Holder | None] = []  # slot -> its holder; None once retired
        self._count: list[int] = []  # slot -> blocks whose mask has its bit (retired slots too, until 0)
        self._free: list[int] = []  # retired slots no block refers to: reusable
        self._live_mask = 0  # bits of slots not retired
        self._replica_bits: dict[str, int] = {}
        self.replicas: dict[str, ReplicaEvents] = {}
        #: Blocks evicted by the bound since the index began.
        self.evicted = 0
        #: Counts the changes a query could see (stores, removals, drops, a stream turning live or stale): a router
        #: keeps an answer for one decision only while this is unchanged.
        self.changes = 0
        #: The sampled hashes (``summary_sampled``) stored lately, oldest first, at most 2 x MAX_SUMMARY_BLOCKS;
        #: those no longer held are dropped when :meth:`summary` meets them.
        self._sampled: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks in the index (those of dropped replicas included until touched or evicted)."""
        return len(self._blocks)

    # ---- replicas -------------------------------------------------------------------------------------------

    def replica(self, replica: str) -> ReplicaEvents:
        """The stream state of ``replica`` (created, not live, on first use)."""
        state = self.replicas.get(replica)
        if state is None:
            state = self.replicas[replica] = ReplicaEvents()
        return state

    def is_live(self, replica: str) -> bool:
        """Whether the replica's event stream is followed now (its matches are exact); False: use the trie."""
        state = self.replicas.get(replica)
        return state is not None and state.live

    def mark_live(self, replica: str) -> None:
        """The replica's stream is connected: its matches count from now on (it starts with nothing known)."""
        self.replica(replica).live = True
        self.changes += 1

    def mark_stale(self, replica: str) -> None:
        """The replica's stream is gone: drop what was known of it and stop reporting it until ``mark_live``."""
        self.drop(replica)
        self.replica(replica).live = False

    def drop(self, replica: str) -> None:
        """Forget every block of ``replica`` (a reconnect, ``AllBlocksCleared``, a gap that could not be filled);
        O(holders of the replica), the blocks' bits are stripped lazily."""
        state = self.replica(replica)
        state.drops += 1
        self.changes += 1
        for key in [k for k in self._slot_of if k[0] == replica]:
            slot = self._slot_of.pop(key)
            self._holder[slot] = None
            self._live_mask &= ~(1 << slot)
            if self._count[slot] == 0:
                self._free.append(slot)
        self._replica_bits.pop(replica, None)
        retired = sum(1 for h in self._holder if h is None) - len(self._free)
        if retired > max(8, len(self._slot_of)):
            self.sweep()

    def sweep(self) -> None:
        """Strip the bits of dropped holders from every block and free their slots: O(blocks), run by ``drop`` only
        when retired slots still referenced outnumber max(8, live holders), so masks stay small integers."""
        live, blocks = self._live_mask, self._blocks
        for h in [h for h, mask in blocks.items() if mask & ~live]:
            mask = self._strip_retired(blocks[h])
            if mask:
                blocks[h] = mask  # an existing key keeps its place: recency is unchanged
            else:
                del blocks[h]

    def forget(self, replica: str) -> None:
        """The replica left the membership: drop its blocks and its stream state."""
        self.drop(replica)
        self.replicas.pop(replica, None)

    def replica_blocks(self, replica: str) -> int:
        """Blocks the index holds for ``replica`` (over all its media and LoRA ids; a block on two media counts
        twice)."""
        return sum(self._count[s] for k, s in self._slot_of.items() if k[0] == replica)

    # ---- events ---------------------------------------------------------------------------------------------

    def store(self, replica: str, block_hashes: Iterable[int], *, block_size: int | None = None,
              medium: str | None = None, lora_id: int | None = None) -> None:
        """``replica`` stored these blocks (vLLM ``BlockStored``); a block it already held becomes most recent.

        Hashes are 64-bit ints. ``block_size`` (tokens per block) is remembered for :meth:`matched_tokens`."""
        state = self.replica(replica)
        self.changes += 1
        if block_size is not None:
            state.block_size = block_size
        slot = self._slot(replica, medium, lora_id)
        bit = 1 << slot
        blocks, live = self._blocks, self._live_mask
        added = 0
        sampled, stride = self._sampled, SUMMARY_STRIDE
        for h in block_hashes:
            mask = blocks.pop(h, 0)  # pop and put back: the block becomes the most recent
            if mask & ~live:
                mask = self._strip_retired(mask)
            if not mask & bit:
                mask |= bit
                added += 1
            blocks[h] = mask
            if not h % stride:
                sampled[h] = None
                sampled.move_to_end(h)
        self._count[slot] += added
        if len(blocks) > self.max_blocks:
            self._evict()
        while len(sampled) > 2 * MAX_SUMMARY_BLOCKS:
            sampled.popitem(last=False)

    def remove(self, replica: str, block_hashes: Iterable[int], *, medium: str | None = None) -> None:
        """``replica`` evicted these blocks from ``medium`` (vLLM ``BlockRemoved``), whatever their LoRA id."""
        bits = 0
        for (r, m, _), slot in self._slot_of.items():
            if r == replica and m == medium:
                bits |= 1 << slot
        if not bits:
            return
        self.changes += 1
        blocks = self._blocks
        for h in block_hashes:
            mask = blocks.get(h)
            if mask is None or not mask & bits:
                continue
            self._uncount(mask & bits)
            mask &= ~bits
            if mask & ~self._live_mask:
                mask = self._strip_retired(mask)
            if mask:
                blocks[h] = mask
            else:
                del blocks[h]

    # ---- queries --------------------------------------------------------------------------------------------

    def holders(self, block_hash: int) -> list[Holder]:
        """The live holders of one block (empty when none is known)."""
        mask = self._blocks.get(block_hash, 0) & self._live_mask
        return [self._holder[s] for s in _bits(mask) if self.is_live(self._holder[s].replica)]

    def matched_tokens(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per live replica, the tokens of the longest prefix of ``block_hashes`` it holds (any medium).

        ``block_hashes``: the request's chained 64-bit block hashes, in prompt order, computed with the replicas'
        block size (see :meth:`block_sizes`). Returns {replica: matched blocks x its block size} for every live
        replica, 0 included; a replica absent from the answer is not live (use the prefix trie for it).
        O(log len(block_hashes)) dict lookups per replica holding its first block (see :meth:`matched_blocks`).
        """
        blocks = self.matched_blocks(block_hashes)
        return {r: n * (self.replicas[r].block_size or 0) for r, n in blocks.items()}

    def matched_blocks(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per live replica, how many leading blocks of ``block_hashes`` it holds (see :meth:`matched_tokens`).

        A replica's cached blocks of one chain form a prefix of it: vLLM frees a finished request's blocks tail
        first, so its LRU free queue evicts a chain's later blocks before their parents, and a prefix hit touches
        every block of the prefix (``KVCacheManager.free``, ``vllm/v1/core/kv_cache_manager.py``); SGLang's radix
        cache evicts leaves only. So the held blocks' count is found by galloping then bisecting per replica
        (blocks 1, 3, 7, 15, ... until one is missing, then halving the gap): O(log n) lookups per holding replica
        instead of one per held block (a 32k-token prompt, 2,048 blocks, half held: about 20 lookups instead of
        1,024, each a likely cache miss in a million-entry dict). Where a replica's blocks of the chain have a hole
        (an engine evicting single blocks, or this index's own bound forgetting an old block), the answer is the end
        of one of its runs of held blocks: block ``n - 1`` held and block ``n`` not, 0 when block 0 is not held.
        """
        result = {r: 0 for r, s in self.replicas.items() if s.live}
        n = len(block_hashes)
        if not n:
            return result
        get = self._blocks.get
        masks = {0: get(block_hashes[0], 0)}  # block position -> holder mask, each read once per call
        first = masks[0]
        for replica in result:
            bits = self._replica_bits.get(replica, 0)
            if not first & bits:
                continue
            held, step, missing = 0, 1, n  # block ``held`` is held; ``missing`` is not (or is the end)
            while held + step < n:
                i = held + step
                mask = masks.get(i)
                if mask is None:
                    mask = masks[i] = get(block_hashes[i], 0)
                if not mask & bits:
                    missing = i
                    break
                held, step = i, step * 2
            while missing - held > 1:
                i = (held + missing) // 2
                mask = masks.get(i)
                if mask is None:
                    mask = masks[i] = get(block_hashes[i], 0)
                if mask & bits:
                    held = i
                else:
                    missing = i
            result[replica] = held + 1
        return result

    def summary(self, limit: int = MAX_SUMMARY_BLOCKS) -> tuple[int, ...]:
        """The region summary a balancer sends its peers: up to ``limit`` hashes of the blocks its live replicas
        hold now among the sampled ones (``summary_sampled``), the most recently stored first.

        A prompt's block hashes are chained, so a peer that finds the request's i-th block hash here knows this
        region holds (or held, until its next summary) the prompt's first i + 1 blocks; sampling one block in
        SUMMARY_STRIDE keeps the summary small and places the deepest sampled block, on average, SUMMARY_STRIDE
        blocks before the end of what is held. O(limit) dict lookups."""
        live = 0
        for replica, bits in self._replica_bits.items():
            if self.is_live(replica):
                live |= bits
        blocks, out, gone = self._blocks, [], []
        if not live:
            return ()
        for h in reversed(self._sampled):
            if blocks.get(h, 0) & live:
                out.append(h)
                if len(out) >= limit:
                    break
            else:
                gone.append(h)
        for h in gone:
            del self._sampled[h]
        return tuple(out)

    def block_sizes(self) -> set[int]:
        """The block sizes (tokens) live replicas reported: a request's hashes are computed with one of them."""
        return {s.block_size for s in self.replicas.values() if s.live and s.block_size}

    # ---- internals ------------------------------------------------------------------------------------------

    def _slot(self, replica: str, medium: str | None, lora_id: int | None) -> int:
        key = (replica, medium, lora_id)
        slot = self._slot_of.get(key)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._holder[slot] = Holder(*key)
        else:
            slot = len(self._holder)
            self._holder.append(Holder(*key))
            self._count.append(0)
        self._slot_of[key] = slot
        self._live_mask |= 1 << slot
        self._replica_bits[replica] = self._replica_bits.get(replica, 0) | (1 << slot)
        return slot

    def _uncount(self, mask: int) -> None:
        for slot in _bits(mask):
            self._count[slot] -= 1
            if self._count[slot] == 0 and self._holder[slot] is None:
                self._free.append(slot)

    def _strip_retired(self, mask: int) -> int:
        retired = mask & ~self._live_mask
        self._uncount(retired)
        return mask & self._live_mask

    def _evict(self) -> None:
        """Drop the least recently stored blocks down to ``max_blocks - evict_batch`` (one pass over the oldest)."""
        blocks = self._blocks
        excess = len(blocks) - self.max_blocks + self._evict_batch
        for h in list(islice(blocks, max(excess, 0))):
            self._uncount(blocks.pop(h))
        self.evicted += max(excess, 0)


def _bits(mask: int) -> Iterable[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
