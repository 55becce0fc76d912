"""The block index fed by the engine model's KV-cache events agrees exactly with the engine's prefix cache, driven
directly and inside the simulator."""

from __future__ import annotations

import random

from bench.emulator import kv_hash
from bench.emulator.model import EngineModel, EngineParams
from bench.sim.cluster import BalancerSetup, Cluster
from bench.sim.workloads import SimRequest, Workload
from skylb.config import BalancerConfig
from skylb.core.kv_events import apply_events
from skylb.core.kv_index import BlockIndex


def _cached(model: EngineModel) -> set[int]:
    return {kv_hash.external(h) for h in model._cache}


def _indexed(index: BlockIndex, replica: str) -> set[int]:
    return {h for h in index._blocks if any(holder.replica == replica for holder in index.holders(h))}


def test_index_equals_the_engines_cache_through_evictions():
    """200 requests sharing 8 system prompts through a 32-block cache (evicting all along): after every step the
    blocks the index holds for the replica are exactly the blocks in the engine's prefix cache."""
    rng = random.Random(0)
    model = EngineModel(EngineParams(kv_cache_tokens=512, block_size=16, max_num_seqs=4))
    model.enable_kv_events()
    index = BlockIndex(10_000)
    index.mark_live("r")
    systems = [[f"s{k}-{i}" for i in range(rng.randrange(20, 120))] for k in range(8)]
    now, checked = 0.0, 0
    for n in range(200):
        words = rng.choice(systems) + [f"q{n}-{i}" for i in range(rng.randrange(1, 60))]
        model.submit(f"r{n}", words, rng.randrange(1, 20), ignore_eos=True, now=now)
        for _ in range(rng.randrange(1, 6)):
            if model.next_step(now) is None:
                break
            now += 0.01
            apply_events(index, "r", model.take_kv_events())
            assert _indexed(index, "r") == _cached(model)
            checked += 1
    assert model.evicted_blocks > 100 and checked > 300


def test_the_simulator_feeds_its_replicas_events_into_the_index():
    """A simulated run with kv_index: every replica is live in the index and holds exactly its engine's cache at
    the end; a prompt served there matches its cached blocks."""
    words = [f"w{i}" for i in range(64)]
    arrivals = [SimRequest(id=f"q{i}", session_key=f"s{i % 3}", tokens=words + [f"t{i}"] * 8, output_tokens=4,
                           arrival_s=0.1 * i, region="us") for i in range(12)]
    setup = BalancerSetup("us", ("us-r0", "us-r1"), BalancerConfig())
    index = BlockIndex(10_000)
    cluster = Cluster(workload=Workload("kv", "kv", arrivals=arrivals), replicas={"us-r0": "us", "us-r1": "us"},
                      balancers=[setup], entry={"us": "us"}, stop_at=10.0, kv_index=index).run()
    assert len(cluster.records) == 12
    chain = [kv_hash.external(h) for h in kv_hash.block_hashes(kv_hash.token_ids(words), 16)]
    matched = index.matched_tokens(chain)
    assert set(matched) == {"us-r0", "us-r1"} and max(matched.values()) == 64
    for rid, replica in cluster.replicas.items():
        assert index.replica_blocks(rid) == len(replica.engine._cache)
        assert index.replica(rid).stored > 0
