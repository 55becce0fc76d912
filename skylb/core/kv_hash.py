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
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

__all__ = ["NONE_HASH", "block_hashes", "external", "request_block_hashes"]

#: The parent of a prompt's first block: SHA-256 of the pickled seed "vllm-none-hash" (PYTHONHASHSEED unset).
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
_MASK64 = (1 << 64) - 1


def block_hashes(ids: Sequence[int], block_size: int, extra_keys: tuple | None = None, *,
                 every_block: tuple | None = None) -> list[bytes]:
    """vLLM's chained 32-byte hash of each full block of ``ids`` (a trailing partial block has none).

    ``extra_keys``: vLLM's tagged keys of the first block only (e.g. ``(("cache_salt", "s"),)``); ``every_block``:
    keys of every block, first ones first (a LoRA key, e.g. ``("lora", name, path)``). ``block_size`` >= 1 tokens.
    """
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(ids) - block_size + 1, block_size):
        keys = (every_block or ()) + (extra_keys or ()) if start == 0 else every_block
        parent = hashlib.sha256(pickle.dumps((parent, tuple(ids[start:start + block_size]), keys or None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(parent)
    return hashes


def external(block_hash: bytes) -> int:
    """The hash events carry: the lower 64 bits (vLLM ``maybe_convert_block_hash``, the default)."""
    return int.from_bytes(block_hash, "big") & _MASK64


def request_block_hashes(ids: Sequence[int], block_size: int, *, cache_salt: str | None = None,
                         lora_key: tuple | None = None) -> tuple[int, ...]:
    """The 64-bit block hashes a request's token ``ids`` have on a vLLM replica with blocks of ``block_size``
    tokens, as :class:`skylb.core.kv_index.BlockIndex` keys them; ``cache_salt`` and ``lora_key`` as the engine adds
    them (module docstring). Raises ValueError for a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    salt = (("cache_salt", cache_salt),) if cache_salt else None
    every = (lora_key,) if lora_key else None
    return tuple(external(h) for h in block_hashes(ids, block_size, salt, every_block=every))
