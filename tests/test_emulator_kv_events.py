"""The emulator's KV-cache events: vLLM's bytes, vLLM's block hashes, vLLM's flag, and what its block cache emits."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgpack
import pytest

from bench.emulator import kv_hash
from bench.emulator.kv_publisher import KVEventsConfig, encode_batch
from bench.emulator.model import EngineModel, EngineParams
from bench.emulator.server import add_arguments
from skylb.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"


def test_encoded_batches_are_byte_for_byte_vllms():
    """encode_batch writes the exact payloads vLLM 0.33's msgspec encoder wrote for the same batches (map-encoded
    events with a 16-bit header for BlockStored, defaults omitted, group 0, data-parallel rank last)."""
    published = msgpack.unpackb((FIXTURES / "frames.msgpack").read_bytes())["published"]
    ours = [
        encode_batch(1700000000.5, [
            BlockStored([11, 2**64 - 1], None, list(range(32)), 16, None, "GPU", None),
            BlockStored([12], 2**64 - 1, list(range(32, 48)), 16, 7, "CPU", "sql-adapter",
                        [("sql-adapter", "tenant-a")])]),
        encode_batch(1700000001.25, [BlockRemoved([11], "GPU")]),
        encode_batch(1700000002.0, [AllBlocksCleared()], 1),
    ]
    assert ours == [frames[2] for frames in published]


def test_block_hashes_equal_vllms_own_chain():
    """kv_hash reproduces vLLM's default (pickle + SHA-256) chain and NONE_HASH for known token ids, with no extra
    keys and with a cache salt on the first block; events carry the lower 64 bits."""
    cases = json.loads((FIXTURES / "hashes.json").read_text())["cases"]
    checked = 0
    for case in cases:
        extra = case["extra_keys_first_block"]
        if case["algo"] != "sha256" or (extra and extra[0][0] == "lora"):
            continue
        keys = tuple(tuple(k) for k in extra) if extra else None
        chain = kv_hash.block_hashes(case["token_ids"], case["block_size"], keys)
        assert kv_hash.NONE_HASH.hex() == case["none_hash"]
        assert [h.hex() for h in chain] == [b["full"] for b in case["chain"]]
        assert [kv_hash.external(h) for h in chain] == [b["external"] for b in case["chain"]]
        checked += 1
    assert checked == 2


def test_the_block_cache_emits_stores_then_evictions_with_parents_and_token_ids():
    """A 40-token prompt caches 2 full blocks (one BlockStored, no parent, their 32 token ids); a second prompt in a
    4-block cache evicts the first prompt's last block (BlockRemoved) before storing its own."""
    model = EngineModel(EngineParams(kv_cache_tokens=64, block_size=16, max_num_seqs=4))
    model.enable_kv_events()
    first = [f"w{i}" for i in range(40)]
    ids = kv_hash.token_ids(first)
    chain = [kv_hash.external(h) for h in kv_hash.block_hashes(ids, 16)]
    now = 0.0
    for request_id, words in (("a", first), ("b", [f"x{i}" for i in range(40)])):
        model.submit(request_id, words, 2, ignore_eos=True, now=now)
        while model.next_step(now):
            now += 1.0
        if request_id == "a":
            assert model.take_kv_events() == [BlockStored(chain, None, ids[:32], 16)]
    events = model.take_kv_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[0] == BlockRemoved([chain[1]], "GPU")
    assert model.take_kv_events() == []


def test_events_must_be_enabled_before_the_first_request():
    """enable_kv_events on a model that already holds requests raises RuntimeError; off, nothing is recorded."""
    model = EngineModel(EngineParams(kv_cache_tokens=64, block_size=16))
    model.submit("a", ["w"] * 20, 1, ignore_eos=True, now=0.0)
    assert model.take_kv_events() == []
    with pytest.raises(RuntimeError):
        model.enable_kv_events()


def _flag(value: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--port", "1", "--kv-events-config", value])


def test_vllms_flag_and_json_configure_the_publisher(capsys):
    """--kv-events-config takes vLLM's JSON (publisher defaults to zmq when enabled, null otherwise); an unknown
    key, a wrong type, an unknown publisher or text that is not JSON exits 2 naming the problem."""
    config = _flag('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                   '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}').kv_events_config
    assert config.enabled and config.replay_endpoint == "tcp://*:5558" and config.buffer_steps == 10_000
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_json('{"endpoint": "tcp://*:1"}').enabled
    for bad, needle in (('{"enable_kv_cache_events": true, "port": 1}', "unknown key"),
                        ('{"buffer_steps": 0}', "buffer_steps"), ('{"publisher": "kafka"}', "publisher"),
                        ("{not json", "not JSON"), ('["zmq"]', "object")):
        with pytest.raises(SystemExit) as exit_info:
            _flag(bad)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_token_ids_of_a_prompt_sent_as_ids_are_those_ids():
    """A word of decimal digits (how a prompt of token ids reaches the model) is its own id; any other word is its
    CRC-32: ids from /tokenize sent back as a prompt hash to the same blocks."""
    ids = kv_hash.token_ids(["w1", "w2"])
    assert kv_hash.token_ids([str(i) for i in ids]) == ids
    assert kv_hash.token_ids(["123"]) == [123]


def test_a_prefix_cache_reset_clears_when_no_request_holds_blocks():
    """reset_prefix_cache is refused while a request runs (as vLLM's) and, once idle, frees every cached block and
    records AllBlocksCleared."""
    model = EngineModel(EngineParams(kv_cache_tokens=64, block_size=16))
    model.enable_kv_events()
    model.submit("a", [f"w{i}" for i in range(40)], 3, ignore_eos=True, now=0.0)
    model.next_step(0.0)
    assert not model.reset_prefix_cache()
    while model.next_step(1.0):
        pass
    model.take_kv_events()
    assert model.num_cached_blocks == 2 and model.reset_prefix_cache()
    assert model.num_cached_blocks == 0 and model.num_free_blocks == 4
    assert model.take_kv_events() == [AllBlocksCleared()]
