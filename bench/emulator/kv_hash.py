"""Block hashes as vLLM computes them, for the emulator's word tokens.

Source: vLLM 0.33 ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``, ``init_none_hash``,
``maybe_convert_block_hash``) and ``vllm/utils/hashing.py`` (``sha256``: SHA-256 of the pickled object, protocol
``pickle.HIGHEST_PROTOCOL``, vLLM's default ``prefix_caching_hash_algo``). Block i's hash is
``sha256(pickle((hash of block i-1, tuple of its token ids, extra keys)))``, the first block's parent being
NONE_HASH = ``sha256(pickle(seed))`` with seed ``"vllm-none-hash"`` (PYTHONHASHSEED unset; vLLM uses PYTHONHASHSEED
when set, and a random seed for the xxhash algorithms: no outsider can match those). Events carry the lower 64 bits.
``tests/fixtures/kv_events/hashes.json`` holds chains computed by vLLM's own functions, checked in the tests.

The emulator's tokens are words; a word's token id is its CRC-32, or the number itself for a word of decimal digits
(a prompt sent as token ids reaches the model as such words), so ids from the emulator's ``/tokenize`` sent back as a
prompt hash to the same blocks. Any fixed map works: the balancer asks the engine's ``/tokenize`` for ids, and the
emulator's must be stable across processes.
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from collections.abc import Sequence

__all__ = ["NONE_HASH", "block_hashes", "external", "token_ids"]

NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
_MASK64 = (1 << 64) - 1


def token_ids(words: Sequence[str]) -> list[int]:
    """The emulator's token id of each word (a decimal number is itself, any other word the CRC-32 of its UTF-8)."""
    return [int(w) if w.isdigit() and w.isascii() else zlib.crc32(w.encode()) for w in words]


def block_hashes(ids: Sequence[int], block_size: int, extra_keys: tuple | None = None) -> list[bytes]:
    """vLLM's chained 32-byte hash of each FULL block of ``ids`` (a trailing partial block has none); ``extra_keys``
    (vLLM's tagged tuple, e.g. ``(("cache_salt", "s"),)``) go into the first block only, as a cache salt does."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(ids) - block_size + 1, block_size):
        keys = extra_keys if start == 0 else None
        parent = hashlib.sha256(pickle.dumps((parent, tuple(ids[start:start + block_size]), keys),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(parent)
    return hashes


def external(block_hash: bytes) -> int:
    """The hash events carry: the lower 64 bits (vLLM ``maybe_convert_block_hash``, the default)."""
    return int.from_bytes(block_hash, "big") & _MASK64
