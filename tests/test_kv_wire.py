"""SkyLB's decoder of vLLM's KV-event wire format, against bytes recorded from vLLM's own encoder and publisher."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from skylb.engines.kv_wire import (AllBlocksCleared, BlockRemoved, BlockStored, CorruptBatch, decode_batch,
                                   external_hash)

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"
TOP = 2**64 - 1


def _frames() -> dict:
    return msgpack.unpackb((FIXTURES / "frames.msgpack").read_bytes())


def test_fixture_from_vllm_decodes_to_the_published_events():
    """The three messages vLLM 0.33's ZmqEventPublisher sent decode to the events record.py published: topic,
    8-byte big-endian sequence numbers 0-2, stores (GPU, and CPU with a LoRA), a removal and a clear."""
    published = _frames()["published"]
    assert [f[0] for f in published] == [b"kv-events"] * 3
    assert [int.from_bytes(f[1], "big") for f in published] == [0, 1, 2]
    batches = [decode_batch(f[2]) for f in published]
    assert [b.ts for b in batches] == [1700000000.5, 1700000001.25, 1700000002.0]
    assert [b.data_parallel_rank for b in batches] == [0, 0, 1]
    assert batches[0].events == [
        BlockStored([11, TOP], None, list(range(32)), 16, None, "GPU", None),
        BlockStored([12], TOP, list(range(32, 48)), 16, 7, "CPU", "sql-adapter", [["sql-adapter", "tenant-a"]])]
    assert batches[1].events == [BlockRemoved([11], "GPU")]
    assert batches[2].events == [AllBlocksCleared()]
    assert all(b.unknown == 0 and b.corrupt == 0 for b in batches)


def test_fixture_replay_frames_carry_topic_sequence_and_end_marker():
    """vLLM's replay socket answers [empty, topic, seq, payload] per buffered batch from the asked sequence on,
    then [empty, empty, -1 as 8 signed bytes, empty]: the payloads equal the published ones."""
    frames = _frames()
    replayed = frames["replayed_from_1"]
    assert [f[2] for f in replayed[:-1]] == [(1).to_bytes(8, "big"), (2).to_bytes(8, "big")]
    assert [f[3] for f in replayed[:-1]] == [f[2] for f in frames["published"][1:]]
    assert replayed[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_array_encoded_events_of_older_vllm_and_map_encoded_batches_decode():
    """Earlier vLLM releases encoded each event as [tag, fields...] (array_like); a later source encodes the batch
    as a map: both decode to the same events; bytes hashes are reduced to their lower 64 bits."""
    old = msgpack.packb([1.0, [["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"],
                               ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]]])
    assert decode_batch(old).events == [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU"),
                                        BlockRemoved([1], "GPU"), AllBlocksCleared()]
    full = bytes(range(32))
    new = msgpack.packb({"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [full], "medium": None}]})
    assert decode_batch(new).events == [BlockRemoved([int.from_bytes(full[-8:], "big")], None)]
    assert external_hash(full) == int.from_bytes(full[24:], "big")


def test_unknown_and_corrupt_events_are_counted_and_skipped():
    """Inside a good batch an unknown tag, a non-string tag, a bad hash, a missing field or a wrong type is counted
    (unknown or corrupt) and skipped; the good events around them still decode."""
    good = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    events = [good, {"type": "BlockPinned", "block_hashes": [1]}, ["FutureEvent", 1, 2],
              {"type": "BlockStored", "block_hashes": ["x"], "parent_block_hash": None, "token_ids": [],
               "block_size": 16, "lora_id": None, "medium": None},
              {"type": "BlockStored", "block_hashes": [1]}, {"type": "BlockRemoved", "block_hashes": [-1]},
              {"type": "BlockRemoved", "block_hashes": [1], "medium": 3}, [7, 1], 42, [], good]
    batch = decode_batch(msgpack.packb([3.0, events]))
    assert batch.events == [BlockRemoved([5], "GPU")] * 2
    assert (batch.unknown, batch.corrupt) == (2, 7)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\xcb", msgpack.packb("text"), msgpack.packb([1.0]),
                                     msgpack.packb(["ts", []]), msgpack.packb([1.0, {}]),
                                     msgpack.packb([1.0, [], "rank"])])
def test_a_payload_that_is_not_a_batch_raises_corrupt_batch(payload):
    """Garbage, truncated msgpack, or msgpack that is not a KVEventBatch raises CorruptBatch (and nothing else)."""
    with pytest.raises(CorruptBatch):
        decode_batch(payload)
