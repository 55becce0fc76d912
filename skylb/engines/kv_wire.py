"""vLLM's KV-cache event wire format: decoding a published message into events.

Source: vLLM ``vllm/distributed/kv_events.py`` (0.33.0: ``EventBatch``, ``KVCacheEvent``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``, ``ZmqEventPublisher``). A message on the PUB socket is three
frames ``[topic, sequence number (8 bytes, big-endian, unsigned), payload]``; the payload is msgpack (msgspec's
encoder) of ``KVEventBatch(ts: float, events: list, data_parallel_rank: int | None)``, encoded as an array
(``array_like=True``) with a trailing default (``data_parallel_rank`` None) omitted. Each event is a tagged union
(``tag=True``: the tag is the class name): vLLM 0.33 encodes an event as a map whose ``"type"`` key holds the tag and
whose fields equal to their default are omitted; earlier releases declared events ``array_like`` too (as vLLM's
``examples/online_serving/kv_events_subscriber.py`` still does): an array whose first item is the tag, fields in
declaration order. Both are accepted here, and a map-encoded batch too (a later vLLM source dropped ``array_like``
from ``EventBatch``).

Fields read (declaration order): ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx, ...)``, ``BlockRemoved(block_hashes, medium, group_idx, ...)``,
``AllBlocksCleared()``. A block hash is an int (the lower 64 bits of vLLM's hash, the default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the full hash as bytes (``=0``); bytes are reduced to their lower 64
bits as vLLM's ``maybe_convert_block_hash`` does, so the index always keys on 64-bit ints.

A batch that is not msgpack, or not a batch, raises :class:`CorruptBatch`; inside a good batch, an event with an
unknown tag or malformed fields is counted and skipped (:class:`DecodedBatch`), never raised.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from skylb.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "CorruptBatch", "DecodedBatch", "decode_batch",
           "external_hash", "END_SEQ"]

_MASK64 = (1 << 64) - 1
#: The replay socket's end-of-replay sequence number (vLLM ``ZmqEventPublisher.END_SEQ``: -1, signed).
END_SEQ = -1


class DecodedBatch(NamedTuple):
    """One decoded ``KVEventBatch``: its timestamp (s since the epoch, the engine's clock), the events understood,
    the data-parallel rank (None when not sent) and how many events were skipped as unknown or corrupt."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None
    unknown: int
    corrupt: int


class CorruptBatch(ValueError):
    """The payload is not a msgpack-encoded ``KVEventBatch``."""


def external_hash(value: Any) -> int:
    """A block hash as the index keys it: an int in [0, 2^64), or bytes reduced to their lower 64 bits (vLLM
    ``maybe_convert_block_hash``). Raises ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= _MASK64:
            return value
        raise ValueError(f"block hash out of range: {value}")
    if isinstance(value, (bytes, bytearray)) and value:
        return int.from_bytes(value, "big") & _MASK64
    raise ValueError(f"not a block hash: {type(value).__name__}")


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload frame. Raises CorruptBatch when it is not a batch (events inside are skipped, counted)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage: all mean the same here
        raise CorruptBatch(f"payload is not msgpack: {type(exc).__name__}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = raw[0], raw[1], (raw[2] if len(raw) == 3 else None)
    else:
        raise CorruptBatch("payload is not a KVEventBatch")
    if not isinstance(ts, (int, float)) or not isinstance(events, list) or not (rank is None or isinstance(rank, int)):
        raise CorruptBatch("KVEventBatch fields have the wrong types")
    decoded: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    unknown = corrupt = 0
    for item in events:
        try:
            event = _event(item)
        except (ValueError, TypeError, KeyError, IndexError):
            corrupt += 1
            continue
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return DecodedBatch(float(ts), decoded, rank, unknown, corrupt)


#: Field names in declaration order (array-encoded events carry them positionally after the tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(item: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """An event's fields by name, from its map or its array form (missing trailing ones are absent)."""
    if isinstance(item, dict):
        return item
    return dict(zip(names, item[1:]))


def _event(item: Any) -> BlockStored | BlockRemoved | AllBlocksCleared | None:
    """One event, or None for an unknown tag. Raises ValueError/TypeError/KeyError for a malformed one."""
    if isinstance(item, dict):
        tag = item["type"]
    elif isinstance(item, list) and item:
        tag = item[0]
    else:
        raise ValueError("an event is neither a map nor a tagged array")
    if tag == "BlockStored":
        f = _fields(item, _STORED_FIELDS)
        parent = f["parent_block_hash"]
        block_size = f["block_size"]
        token_ids = f["token_ids"]
        if not isinstance(block_size, int) or block_size < 1 or not isinstance(token_ids, list):
            raise ValueError("BlockStored: bad block_size or token_ids")
        extra_keys = f.get("extra_keys")
        if extra_keys is not None and not isinstance(extra_keys, list):
            raise TypeError("BlockStored: extra_keys is not a list")
        return BlockStored([external_hash(h) for h in f["block_hashes"]],
                           None if parent is None else external_hash(parent), token_ids, block_size,
                           _optional(f.get("lora_id"), int), _optional(f.get("medium"), str),
                           _optional(f.get("lora_name"), str), extra_keys)
    if tag == "BlockRemoved":
        f = _fields(item, _REMOVED_FIELDS)
        return BlockRemoved([external_hash(h) for h in f["block_hashes"]], _optional(f.get("medium"), str))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise TypeError("an event's tag is not a string")
    return None


def _optional(value: Any, kind: type) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise TypeError(f"expected {kind.__name__} or None, got {type(value).__name__}")
