"""The block index (skylb/core/kv_index.py): holders per block, the chained-prefix match per replica, liveness,
drops, and the bound in blocks."""

from __future__ import annotations

import pytest

from skylb.core.kv_index import BlockIndex, Holder


def _live(*replicas: str, max_blocks: int = 1000) -> BlockIndex:
    index = BlockIndex(max_blocks)
    for r in replicas:
        index.mark_live(r)
    return index


def test_matched_tokens_is_the_longest_held_prefix_times_the_block_size():
    """Per live replica: blocks held from the start of the request's chain, times the block size it reported; a
    block held past a missing one does not count; a live replica holding nothing answers 0."""
    index = _live("a", "b", "c")
    index.store("a", [1, 2, 3], block_size=16)
    index.store("b", [1, 3, 4], block_size=32)
    assert index.matched_tokens([1, 2, 3, 4]) == {"a": 48, "b": 32, "c": 0}
    assert index.matched_blocks([9, 1]) == {"a": 0, "b": 0, "c": 0}
    assert index.matched_tokens([]) == {"a": 0, "b": 0, "c": 0}


@pytest.mark.parametrize("seed", range(6))
def test_matched_blocks_equals_the_block_by_block_definition(seed):
    """Random stores and tail removals (several media on some replicas, a replica not live): each live replica's
    count is the number of leading blocks of the request that it holds in any medium, as an engine's prefix cache
    keeps them (a chain's later blocks evicted before their parents). With a hole (one block of the held prefix
    evicted alone), the count ends a run of held blocks: block n - 1 held and block n not."""
    import random
    rng = random.Random(seed)
    prompt = [rng.getrandbits(64) for _ in range(1500)]  # past the first runs read at once
    index = BlockIndex(100_000)
    media = {"r0": [None], "r1": [None], "r2": [None, "cpu"] if seed % 2 else [None], "r3": [None]}
    for replica, kinds in media.items():
        index.mark_live(replica)
        for medium in kinds:
            held = rng.randrange(len(prompt) + 1)
            index.store(replica, prompt[:held] + [rng.getrandbits(64) for _ in range(50)], block_size=16,
                        medium=medium)
            if rng.random() < 0.5 and held > 10:  # the tail evicted, as the engines evict
                index.remove(replica, prompt[rng.randrange(held):held], medium=medium)
    if seed % 3 == 0:
        index.drop("r3")

    def holds(replica, h):
        return any(holder.replica == replica for holder in index.holders(h))

    def leading(replica):
        n = 0
        while n < len(prompt) and holds(replica, prompt[n]):
            n += 1
        return n
    expected = {replica: leading(replica) for replica in index.replicas if index.is_live(replica)}
    assert index.matched_blocks(prompt) == expected
    assert index.matched_blocks(prompt[:0]) == dict.fromkeys(expected, 0)
    for replica, n in expected.items():
        if n > 10:  # a hole inside the held prefix, in every medium
            for medium in media[replica]:
                index.remove(replica, [prompt[rng.randrange(n - 1)]], medium=medium)
    for replica, n in index.matched_blocks(prompt).items():
        if n == 0:
            assert not holds(replica, prompt[0])
        else:
            assert holds(replica, prompt[n - 1]) and (n == len(prompt) or not holds(replica, prompt[n]))


def test_matched_blocks_reads_a_long_held_prefix_in_logarithmic_lookups():
    """Half of a 2,048-block prompt held by one of 8 replicas, 300 blocks by another: the answer is exact and reads
    at most 2 log2(n) + 1 blocks per holding replica, not one per held block."""
    import random
    rng = random.Random(1)
    prompt = [rng.getrandbits(64) for _ in range(2048)]
    index = _live(*(f"r{i}" for i in range(8)), max_blocks=10_000)
    index.store("r3", prompt[:1024], block_size=16)
    index.store("r5", prompt[:300], block_size=16)

    class CountingDict(dict):
        reads = 0

        def get(self, *args):
            CountingDict.reads += 1
            return super().get(*args)
    index._blocks = CountingDict(index._blocks)
    assert index.matched_blocks(prompt) == {**{f"r{i}": 0 for i in range(8)}, "r3": 1024, "r5": 300}
    assert CountingDict.reads <= 2 * (2 * 11 + 1)


@pytest.mark.parametrize("events, expected", [
    ([("store", "GPU", [1, 2])], 2),
    ([("store", "GPU", [1, 2]), ("remove", "GPU", [2])], 1),
    ([("store", "GPU", [1, 2]), ("remove", "CPU", [1])], 2),  # the CPU copy was never stored
    ([("store", "GPU", [1, 2]), ("store", "CPU", [1, 2]), ("remove", "GPU", [1])], 2),  # still on CPU
    ([("store", "GPU", [1]), ("store", "CPU", [2])], 2),  # a prefix across media still matches
    ([("store", "GPU", [1, 2]), ("remove", "GPU", [1])], 0),
])
def test_media_are_holders_of_their_own(events, expected):
    """A removal takes a block off one medium only; the prefix counts a block held on any medium."""
    index = _live("a")
    for kind, medium, hashes in events:
        if kind == "store":
            index.store("a", hashes, block_size=1, medium=medium)
        else:
            index.remove("a", hashes, medium=medium)
    assert index.matched_blocks([1, 2]) == {"a": expected}


def test_holders_name_replica_medium_and_lora():
    """holders() lists each live (replica, medium, LoRA id) holding the block; a stale replica is not listed."""
    index = _live("a", "b")
    index.store("a", [5], medium="GPU", lora_id=3)
    index.store("b", [5], medium="CPU")
    assert sorted(index.holders(5)) == [Holder("a", "GPU", 3), Holder("b", "CPU", None)]
    index.mark_stale("b")
    assert index.holders(5) == [Holder("a", "GPU", 3)]
    assert index.holders(6) == []


def test_a_stale_replica_is_absent_and_starts_empty_when_live_again():
    """mark_stale drops what was known and hides the replica (the router uses the trie for it); live again, it
    answers 0 until it stores; drop() (AllBlocksCleared) forgets blocks but keeps it live."""
    index = _live("a", "b")
    index.store("a", [1, 2], block_size=16)
    index.store("b", [1], block_size=16)
    index.mark_stale("a")
    assert not index.is_live("a") and index.matched_tokens([1, 2]) == {"b": 16}
    index.mark_live("a")
    assert index.matched_tokens([1, 2]) == {"a": 0, "b": 16}
    index.drop("b")
    assert index.is_live("b") and index.matched_tokens([1, 2]) == {"a": 0, "b": 0}
    index.store("b", [1, 2], block_size=16)
    assert index.matched_tokens([1, 2]) == {"a": 0, "b": 32}
    assert index.replica_blocks("b") == 2 and index.replica_blocks("a") == 0


def test_dropped_holder_slots_are_reused_once_no_block_refers_to_them():
    """Retired holder bits are stripped lazily; a slot comes back only when no block has its bit, so masks stay
    small however often replicas reconnect."""
    index = _live("a", "b")
    for round_ in range(50):
        index.store("a", [round_, 1000 + round_])
        index.store("b", [round_])
        index.drop("a")
        index.remove("b", [round_])
    assert len(index._holder) <= 12  # at most 9 retired slots wait for a sweep, plus the live ones
    assert index.matched_blocks([49]) == {"a": 0, "b": 0}


def test_the_bound_holds_in_blocks_with_a_million_blocks_stored():
    """10^6 distinct blocks through an index bounded at 50,000: it never holds more than the bound, evicts the
    least recently stored first, and a re-stored block counts as recent."""
    index = _live("a", "b", max_blocks=50_000)
    index.store("a", [0], block_size=16)
    for start in range(1, 1_000_000, 10_000):
        index.store("a" if start % 20_000 else "b", range(start, start + 10_000))
        index.store("a", [0])  # keeps block 0 the most recent
        assert len(index) <= 50_000
    assert index.evicted >= 950_000
    assert index.matched_blocks([0]) == {"a": 1, "b": 0}
    assert index.holders(999_999) and not index.holders(1)
    assert index.replica_blocks("a") + index.replica_blocks("b") == len(index)


def test_a_bound_below_one_block_is_refused():
    """max_blocks < 1 raises ValueError."""
    with pytest.raises(ValueError, match="max_blocks"):
        BlockIndex(0)


def test_metrics_read_the_index_and_pass_promtool():
    """The collector exposes per-replica event counters, liveness, the index size and bound; the exposition
    passes `promtool check metrics`."""
    import subprocess

    from prometheus_client import CollectorRegistry, generate_latest

    from skylb.engines.kv_metrics import KVIndexCollector
    from tests.system import require_binary

    index = _live("a", "b")
    index.store("a", [1, 2])
    state = index.replica("a")
    state.stored, state.gaps, state.skipped_unknown = 1, 2, 3
    registry = CollectorRegistry()
    KVIndexCollector(index, region="us").register(registry)
    sample = registry.get_sample_value
    assert sample("skylb_kv_events_total", {"region": "us", "replica": "a", "kind": "stored"}) == 1
    assert sample("skylb_kv_event_gaps_total", {"region": "us", "replica": "a"}) == 2
    assert sample("skylb_kv_events_skipped_total", {"region": "us", "replica": "a", "reason": "unknown"}) == 3
    assert sample("skylb_kv_index_replica_blocks", {"region": "us", "replica": "a"}) == 2
    assert sample("skylb_kv_index_blocks", {"region": "us"}) == 2
    index.mark_stale("b")
    assert sample("skylb_kv_events_live", {"region": "us", "replica": "b"}) == 0
    checked = subprocess.run([require_binary("promtool"), "check", "metrics"], input=generate_latest(registry),
                             capture_output=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
