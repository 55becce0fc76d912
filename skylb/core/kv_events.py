"""KV-cache events, as engines publish them, and how they change the block index.

Source: vLLM ``vllm/distributed/kv_events.py`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; vLLM
0.33). The wire format is decoded in :mod:`skylb.engines.kv_wire`; the emulator and the simulator build these
events directly. Pure: the same :func:`apply_events` serves the live subscriber and the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Union

from skylb.core.kv_index import BlockIndex

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "apply_events"]


class BlockStored(NamedTuple):
    """Blocks a replica stored: ``block_hashes`` (64-bit ints, prompt order), ``parent_block_hash`` (the block
    before the first, None at the prompt's start), ``token_ids`` (len = blocks x ``block_size``), ``lora_id``,
    ``medium`` (vLLM: "GPU", "CPU", "STORAGE" or None), ``lora_name``, ``extra_keys`` (vLLM's untagged per-block
    extra keys: LoRA name, cache salt, ...; None when there are none)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None


class BlockRemoved(NamedTuple):
    """Blocks a replica evicted from ``medium``."""

    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(NamedTuple):
    """The replica emptied its prefix cache (vLLM ``reset_prefix_cache``)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def apply_events(index: BlockIndex, replica: str, events: Iterable[KVEvent]) -> None:
    """Apply one replica's events, in order, to ``index`` and count them in its :class:`ReplicaEvents`."""
    state = index.replica(replica)
    for event in events:
        if isinstance(event, BlockStored):
            state.stored += 1
            index.store(replica, event.block_hashes, block_size=event.block_size, medium=event.medium,
                        lora_id=event.lora_id)
        elif isinstance(event, BlockRemoved):
            state.removed += 1
            index.remove(replica, event.block_hashes, medium=event.medium)
        elif isinstance(event, AllBlocksCleared):
            state.cleared += 1
            index.drop(replica)
