"""Routing by KV-cache events, without processes: a request's block hashes as vLLM's own functions chain them
(tests/fixtures/kv_events/hashes.json), the /tokenize bodies, the replica entries' validation (static flags, the
controller's store), the balancer's bookkeeping of endpoints, and the simulator's balancers reading the index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bench.sim.cluster import BalancerSetup, Cluster
from bench.sim.workloads import SimRequest, Workload
from controller.store import InvalidInput, MembershipStore
from skylb.balancer.kv_routing import KVRouting, kv_endpoint, tokenize_body
from skylb.balancer.static import parse_replica, static_membership
from skylb.config import BalancerConfig, ConfigError
from skylb.core.kv_index import BlockIndex
from skylb.core.state import ReplicaState
from skylb.core.kv_hash import BlockHashCache, request_block_hashes

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"


def test_request_hashes_equal_vllms_chains_with_a_cache_salt_and_a_lora_key():
    """request_block_hashes gives the 64-bit hashes of vLLM's hash_block_tokens for the fixture's token ids: plain,
    with ("cache_salt", s) in the first block only, and with a LoRA key in every block."""
    cases = [c for c in json.loads((FIXTURES / "hashes.json").read_text())["cases"] if c["algo"] == "sha256"]
    seen = set()
    for case in cases:
        extra = case["extra_keys_first_block"]
        kind = extra[0][0] if extra else None
        salt = extra[0][1] if kind == "cache_salt" else None
        lora = tuple(extra[0]) if kind == "lora" else None
        got = request_block_hashes(case["token_ids"], case["block_size"], cache_salt=salt, lora_key=lora)
        assert list(got) == [b["external"] for b in case["chain"]], kind
        seen.add(kind)
    assert seen == {None, "cache_salt", "lora"}
    plain = request_block_hashes(list(range(40)), 16)
    assert len(plain) == 2 and request_block_hashes(list(range(40)), 16, cache_salt="t")[1] != plain[1]
    with pytest.raises(ValueError, match="block_size"):
        request_block_hashes([1], 0)


def test_the_block_hash_cache_gives_vllms_chains_and_hashes_only_new_blocks_in_full():
    """Through a BlockHashCache the fixture's chains (plain, salted, LoRA) come out the same; a next turn that extends
    a prompt finds its old blocks there and hashes only its new ones; a salt or a LoRA key never reuses another
    key's blocks; token ids beyond 4 bytes bypass the cache; the bound drops the oldest blocks first."""
    cache = BlockHashCache(max_blocks=1000)
    for case in [c for c in json.loads((FIXTURES / "hashes.json").read_text())["cases"] if c["algo"] == "sha256"]:
        extra = case["extra_keys_first_block"]
        kind = extra[0][0] if extra else None
        salt = extra[0][1] if kind == "cache_salt" else None
        lora = tuple(extra[0]) if kind == "lora" else None
        for _ in range(2):  # the second time from the cache
            got = request_block_hashes(case["token_ids"], case["block_size"], cache_salt=salt, lora_key=lora,
                                       cache=cache)
            assert list(got) == [b["external"] for b in case["chain"]], kind
    import random
    rng = random.Random(0)
    turn = [rng.randrange(150_000) for _ in range(16 * 40 + 5)]
    cache = BlockHashCache(max_blocks=1000)
    assert request_block_hashes(turn, 16, cache=cache) == request_block_hashes(turn, 16)
    assert (cache.hits, cache.misses) == (0, 40)
    follow_up = turn + [rng.randrange(150_000) for _ in range(16 * 10)]
    assert request_block_hashes(follow_up, 16, cache=cache) == request_block_hashes(follow_up, 16)
    assert (cache.hits, cache.misses) == (40, 50)  # the 40 blocks seen, then 10 new ones (the 5 tokens now fill one)
    salted = request_block_hashes(turn, 16, cache_salt="tenant-b", cache=cache)
    assert salted == request_block_hashes(turn, 16, cache_salt="tenant-b") and salted[0] != request_block_hashes(
        turn, 16)[0] and cache.hits == 40
    assert request_block_hashes([2 ** 40] * 32, 16, cache=cache) == request_block_hashes([2 ** 40] * 32, 16)
    small = BlockHashCache(max_blocks=30)
    request_block_hashes(turn, 16, cache=small)
    assert len(small) == 30
    request_block_hashes(turn[:16 * 5], 16, cache=small)  # its first blocks were the oldest: gone
    assert small.hits == 0
    with pytest.raises(ValueError, match="max_blocks"):
        BlockHashCache(0)


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
                              "temperature": 0.5},
     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": []}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}, {"model": "m", "prompt": "hi"}),
    ("/v1/completions", {"model": "m", "prompt": [5, 6, 7]}, [5, 6, 7]),  # token ids: nothing to ask
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, None),  # a batch of prompts
    ("/v1/responses", {"model": "m", "input": "hi"}, None),
])
def test_tokenize_body_is_vllms_tokenize_request(path, body, expected):
    """Chat requests keep their chat-template fields, completions their prompt; others get no hashes."""
    assert tokenize_body(path, body) == expected


@pytest.mark.parametrize("flag, error", [
    ("http://h:1#kv=tcp://h:5557,replay=tcp://h:5558,block_size=32", None),
    ("http://h:1#kv=tcp://h", "tcp://HOST:PORT"),
    ("http://h:1#kv=http://h:5557", "tcp://HOST:PORT"),
    ("http://h:1#replay=tcp://h:5558", "need kv="),
    ("http://h:1#kv=tcp://h:5557,colour=red", "expected kv="),
    ("http://h:1#kv=tcp://h:5557,kv=tcp://h:5559", "given twice"),
    ("http://h:1#kv=tcp://h:5557,block_size=0", "positive integer"),
])
def test_replica_flag_takes_kv_event_endpoints_after_a_hash(flag, error):
    """--replica URL#kv=...: valid endpoints become the entry's kv_* keys; anything else is a clear ConfigError."""
    if error is None:
        assert parse_replica(flag) == ("http://h:1", {"kv_events": "tcp://h:5557", "kv_events_replay": "tcp://h:5558",
                                                      "kv_block_size": 32})
        entry = static_membership("us", [flag, "http://h:2"])["replicas"]
        assert entry[0]["kv_events"] == "tcp://h:5557" and "kv_events" not in entry[1]
    else:
        with pytest.raises(ConfigError, match=error):
            parse_replica(flag)


def test_the_controller_keeps_a_replicas_kv_event_endpoints_and_refuses_bad_ones(tmp_path):
    """add_replica stores kv_events, kv_events_replay and kv_block_size (in the snapshot, and across a reopen);
    a malformed endpoint, a replay without events and a zero block size are InvalidInput naming the field."""
    store = MembershipStore(tmp_path / "m.db")
    r = store.add_replica("us", "http://10.0.0.1:8000", kv_events="tcp://10.0.0.1:5557",
                          kv_events_replay="tcp://10.0.0.1:5558", kv_block_size=16)
    assert (r.kv_events, r.kv_events_replay, r.kv_block_size) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", 16)
    plain = store.add_replica("us", "http://10.0.0.2:8000")
    assert plain.to_dict()["kv_events"] is None
    for fields, field in (({"kv_events": "tcp://10.0.0.3"}, "kv_events"),
                          ({"kv_events_replay": "tcp://10.0.0.3:5558"}, "kv_events"),
                          ({"kv_events": "tcp://10.0.0.3:5557", "kv_block_size": 0}, "kv_block_size"),
                          ({"kv_events": 5557}, "kv_events")):
        with pytest.raises(InvalidInput) as err:
            store.add_replica("us", "http://10.0.0.3:8000", **fields)
        assert err.value.field == field
    store.close()
    reopened = MembershipStore(tmp_path / "m.db")
    assert reopened.snapshot().to_dict()["replicas"][0]["kv_events_replay"] == "tcp://10.0.0.1:5558"


def test_balancer_settings_bound_the_index_and_the_tokenizer_wait():
    """kv_index_max_blocks defaults to 10^6 blocks and must be positive; the tokenizer wait must be positive."""
    assert BalancerConfig().kv_index_max_blocks == 1_000_000 and BalancerConfig().kv_events
    for bad in ({"kv_index_max_blocks": 0}, {"kv_tokenize_timeout_ms": 0}):
        with pytest.raises(ValueError):
            BalancerConfig(**bad)


def test_kv_routing_follows_entries_with_endpoints_and_picks_a_live_tokenizer():
    """Entries with kv_events are followed (a bad one is skipped, logged); the tokenizer is a live, healthy replica
    serving the model, least loaded first; block sizes: the entry's, else the events', else 16."""
    kv = KVRouting(max_blocks=100, region="us", tokenize_timeout_s=0.1)
    kv.register(CollectorRegistry())
    kv.apply([{"id": "a", "kv_events": "tcp://h:1", "kv_block_size": 32}, {"id": "b", "kv_events": "tcp://h:2"},
              {"id": "c", "kv_events": "bogus"}, {"id": "d"}])
    assert set(kv.endpoints) == {"a", "b"} and kv.block_size("a") == 32 and kv.block_size("b") == 16
    kv.index.mark_live("b")
    kv.index.store("b", [1], block_size=64)
    assert kv.block_size("b") == 64
    replicas = [ReplicaState(id=i, url=f"http://{i}", healthy=True, models=frozenset({"m"}), outstanding=n)
                for i, n in (("a", 0), ("b", 3), ("d", 0))]
    assert kv.tokenizer(replicas, "m").id == "b"  # the only live one
    kv.index.mark_live("a")
    assert kv.tokenizer(replicas, "m").id == "a" and kv.tokenizer(replicas, "other") is None
    assert kv.status()["replicas"]["b"]["live"] and kv.status()["replicas"]["b"]["blocks"] == 1
    with pytest.raises(ValueError, match="needs kv_events"):
        kv_endpoint({"kv_events_replay": "tcp://h:3"})


def test_simulated_balancers_route_by_the_index_when_asked():
    """A balancer with kv_routing reads the cluster's index: a prompt first served on one replica goes back to it
    (the index says so), and kv_routing without an index is refused."""
    words = [f"w{i}" for i in range(96)]
    arrivals = [SimRequest(id=f"q{i}", session_key=None, tokens=words + [f"t{i}"] * 4, output_tokens=2,
                           arrival_s=0.5 * i, region="us") for i in range(6)]
    setup = BalancerSetup("us", ("us-r0", "us-r1"), BalancerConfig(), kv_routing=True)
    layout = {"us-r0": "us", "us-r1": "us"}
    index = BlockIndex(10_000)
    cluster = Cluster(workload=Workload("kv", "kv", arrivals=arrivals), replicas=layout, balancers=[setup],
                      entry={"us": "us"}, stop_at=10.0, kv_index=index).run()
    served = {f.replica.id for f in cluster.records}
    assert len(cluster.records) == 6 and len(served) == 1  # every request after the first hit its prefix there
    with pytest.raises(ValueError, match="kv_index"):
        Cluster(workload=Workload("kv", "kv", arrivals=arrivals), replicas=layout, balancers=[setup],
                entry={"us": "us"}, stop_at=10.0)
