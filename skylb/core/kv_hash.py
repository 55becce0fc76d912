"""A request's KV-cache block hashes, chained as vLLM chains them, so they can be looked up in the block index.

Source: vLLM ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``, ``init_none_hash``,
``generate_block_hash_extra_keys``, ``maybe_convert_block_hash``) and ``vllm/utils/hashing.py`` (``sha256``: SHA-256
of the pickled object, protocol ``pickle.HIGHEST_PROTOCOL``; vLLM's default ``--prefix-caching-hash-algo``). Block
i's hash is ``sha256(pickle((hash of block i-1, tuple of its token ids, extra keys)))``; the first block's parent is
NONE_HASH = ``sha256(pickle("vllm-none-hash"))``. Only full blocks are hashed. KV-cache events carry the lower 64 bits
(:func:`external`). ``tests/fixtures/kv_events/hashes.json`` holds chains computed by vLLM's own functions.

Extra keys, as vLLM tags them: a ``cache_salt`` (an OpenAI request field vLLM accepts, so tenants that must not share
a cache never do) is ``("cache_salt", salt)`` in the first block only; a LoRA adapter's key goes in every block.

Where these hashes cannot match the engine's, and what happens then: an engine started with
``--prefix-caching-hash-algo sha256_cbor`` (CBOR instead of pickle), ``xxhash`` or ``xxhash_cbor`` (random seed), or
with PYTHONHASHSEED set (it seeds NONE_HASH instead of "vllm-none-hash"), a multimodal prompt (image hashes are extra
keys) or prompt embeddings. None of these raise: the request's hashes simply match nothing in the index, every
replica reports 0 matched tokens, and routing loses its locality for event-publishing replicas. Operators of such
engines leave ``kv_events`` unset on those replicas, so the balancer keeps the prefix trie for them.

Hashing costs about 2.5 us per block in Python (a 32k-token prompt: 2,048 blocks, about 5 ms of the balancer's event
loop). Requests repeat blocks (a conversation's next turn extends the last prompt, tenants share system prompts), and
a block's hash depends only on its parent's hash, its token ids and its extra keys, so a :class:`BlockHashCache`
(given to :func:`request_block_hashes`) answers a block seen lately from those inputs, exactly: about a third of the
cost per block found there, about 1.2x per block hashed in full and kept (its key and the store).
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Sequence
from itertools import islice

__all__ = ["NONE_HASH", "BlockHashCache", "block_hashes", "external", "request_block_hashes"]

#: The parent of a prompt's first block: SHA-256 of the pickled seed "vllm-none-hash" (PYTHONHASHSEED unset).
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
_MASK64 = (1 << 64) - 1
#: Bytes of a token id in a cache key (a C unsigned int: 4 on the common platforms).
_ID_BYTES = array("I").itemsize


class BlockHashCache:
    """The chained hashes of recently hashed blocks, keyed by what determines them: the parent block's hash, the
    block's token ids (as C unsigned ints, 4 bytes) and its extra keys. Bounded to ``max_blocks`` entries (>= 1,
    about 230 bytes each: 7.5 MB at the default 32,768, half a million tokens of blocks), the oldest dropped first, a
    64th of the bound at a time, after a request's hashes are done; ``hits`` and ``misses`` count blocks. Not
    thread-safe.

    Raises ValueError for a bound below 1."""

    def __init__(self, max_blocks: int = 32_768):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._hashes: dict = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._hashes)


def block_hashes(ids: Sequence[int], block_size: int, extra_keys: tuple | None = None, *,
                 every_block: tuple | None = None, cache: BlockHashCache | None = None) -> list[bytes]:
    """vLLM's chained 32-byte hash of each full block of ``ids`` (a trailing partial block has none).

    ``extra_keys``: vLLM's tagged keys of the first block only (e.g. ``(("cache_salt", "s"),)``); ``every_block``:
    keys of every block, first ones first (a LoRA key, e.g. ``("lora", name, path)``). ``block_size`` >= 1 tokens.
    ``cache``: blocks hashed lately, read and filled (module docstring); a prompt with a token id that is negative or
    beyond 4 bytes bypasses it.
    """
    first_keys = (every_block or ()) + (extra_keys or ())
    packed = None
    if cache is not None:
        try:
            packed = array("I", ids).tobytes()  # one C pass; a block's key is then a slice of it
        except (OverflowError, TypeError):
            packed = None
    if packed is None:
        hashes: list[bytes] = []
        parent = NONE_HASH
        for start in range(0, len(ids) - block_size + 1, block_size):
            keys = first_keys if start == 0 else every_block
            parent = _hash_block(parent, ids[start:start + block_size], keys)
            hashes.append(parent)
        return hashes
    return _cached_hashes(ids, packed, block_size, first_keys, every_block, cache)


def _hash_block(parent: bytes, tokens: Sequence[int], keys: tuple | None) -> bytes:
    """vLLM's ``hash_block_tokens`` with its default SHA-256 of the pickled (parent, token ids, extra keys)."""
    data = pickle.dumps((parent, tuple(tokens), keys or None), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


def _cached_hashes(ids: Sequence[int], packed: bytes, block_size: int, first_keys: tuple, every_block: tuple | None,
                   cache: BlockHashCache) -> list[bytes]:
    """:func:`block_hashes` through ``cache``; ``packed``: ``ids`` as C unsigned ints."""
    kept = cache._hashes
    get, bound = kept.get, cache.max_blocks
    sha256, dumps, protocol = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
    hashes: list[bytes] = []
    parent, hits, width = NONE_HASH, 0, _ID_BYTES * block_size
    looking = True  # until the first miss: a block after it has a parent no earlier request had, as a rule
    for end in range(width, len(packed) + 1, width):
        keys = first_keys if end == width else every_block
        key = parent + packed[end - width:end]
        if keys:
            key = (key, keys)
        known = get(key) if looking else None
        if known is None:
            looking = False
            start = end // _ID_BYTES - block_size
            known = sha256(dumps((parent, tuple(ids[start:start + block_size]), keys or None), protocol)).digest()
            kept[key] = known
        else:
            hits += 1
        parent = known
        hashes.append(known)
    cache.hits += hits
    cache.misses += len(hashes) - hits
    if len(kept) > bound:  # the oldest first, a batch at a time (dict order is insertion order)
        for key in list(islice(kept, len(kept) - bound + bound // 64)):
            del kept[key]
    return hashes


def external(block_hash: bytes) -> int:
    """The hash events carry: the lower 64 bits (vLLM ``maybe_convert_block_hash``, the default)."""
    return int.from_bytes(block_hash, "big") & _MASK64


def request_block_hashes(ids: Sequence[int], block_size: int, *, cache_salt: str | None = None,
                         lora_key: tuple | None = None, cache: BlockHashCache | None = None) -> tuple[int, ...]:
    """The 64-bit block hashes a request's token ``ids`` have on a vLLM replica with blocks of ``block_size``
    tokens, as :class:`skylb.core.kv_index.BlockIndex` keys them; ``cache_salt`` and ``lora_key`` as the engine adds
    them (module docstring); ``cache`` as in :func:`block_hashes`. Raises ValueError for a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    salt = (("cache_salt", cache_salt),) if cache_salt else None
    every = (lora_key,) if lora_key else None
    return tuple(external(h) for h in block_hashes(ids, block_size, salt, every_block=every, cache=cache))
