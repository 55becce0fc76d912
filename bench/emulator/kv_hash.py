"""Block hashes as vLLM computes them, for the emulator's word tokens (the chain itself is skylb/core/kv_hash.py,
which the balancer uses too).

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

import zlib
from collections.abc import Sequence

from skylb.core.kv_hash import NONE_HASH, block_hashes, external

__all__ = ["NONE_HASH", "block_hashes", "external", "token_ids"]


def token_ids(words: Sequence[str]) -> list[int]:
    """The emulator's token id of each word (a decimal number is itself, any other word the CRC-32 of its UTF-8)."""
    return [int(w) if w.isdigit() and w.isascii() else zlib.crc32(w.encode()) for w in words]
