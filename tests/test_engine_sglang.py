"""The SGLang scheduler model (bench/emulator/sglang_model.py): each rule pinned on a small hand-worked case."""

from __future__ import annotations

import random

import pytest

from bench.emulator.model import EngineModel, EngineParams, make_engine, sglang_kv_cache_tokens
from bench.emulator.radix_cache import RadixCache
from bench.emulator.sglang_model import SglangEngineModel, sglang_max_running_requests


def words(n: int, tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def sg(**kw) -> SglangEngineModel:
    model = make_engine(EngineParams(admission="sglang", **kw))
    assert isinstance(model, SglangEngineModel)
    return model


def step(model, now: float = 0.0):
    s = model.start_step(now)
    assert s is not None
    model.complete_step(s)
    return s


def ids(s) -> list[str]:
    return [o.request_id for o in s.outputs]


# ---- parameters and factory -------------------------------------------------------------------------------------

def test_make_engine_picks_the_model_from_params():
    """admission="vllm" (the default) builds EngineModel, "sglang" the SGLang model; anything else is refused."""
    assert type(make_engine(EngineParams())) is EngineModel
    assert type(make_engine(EngineParams(admission="sglang"))) is SglangEngineModel
    with pytest.raises(ValueError):
        EngineParams(admission="tgi")
    with pytest.raises(ValueError):
        EngineParams(admission="sglang", schedule_policy="dfs-weight")


def test_sglang_capacity_follows_mem_fraction_static():
    """(22.0 - 14.96) GiB - 22.0 GiB x (1 - 0.88) = 4.40 GiB at 128 KiB per token: 36044 tokens; vLLM keeps 32768."""
    assert sglang_kv_cache_tokens(0.88) == 36044
    assert EngineParams(admission="sglang").kv_cache_tokens == 36044
    assert EngineParams(admission="sglang", mem_fraction_static=0.80).kv_cache_tokens == int(
        ((22.0 - 14.96) - 22.0 * 0.2) * 8192)
    assert EngineParams().kv_cache_tokens == 32768
    assert EngineParams(admission="sglang", kv_cache_tokens=5000).kv_cache_tokens == 5000
    assert sglang_max_running_requests(36044) == 2049  # the request pool, not the KV, bounds it
    assert sglang_max_running_requests(1000) == 500


# ---- admission ----------------------------------------------------------------------------------------------------

def test_admission_reserves_running_output_times_ratio_and_refuses_what_does_not_fit():
    """rem_total = free + evictable - sum(min(max_new - generated, clip) x ratio) - admitted (extend + max_new).

    After A's prefill (100 cached, 900 free): A reserves (400 - 1) x 0.7 = 279.3, so B (150 + 400 = 550 < 620.7)
    is admitted and C (50 + 30 = 80 >= 900 - 279.3 - 550 = 70.7) is refused. A ratio of 1 would refuse B.
    """
    m = sg(kv_cache_tokens=1000)
    m.submit("a", words(100, "a"), 400, ignore_eos=True, now=0)
    assert step(m).prefill_tokens == 100
    assert m.available == 900 and m.cache.protected_size == 100
    m.submit("b", words(150, "b"), 400, ignore_eos=True, now=0)
    m.submit("c", words(50, "c"), 30, ignore_eos=True, now=0)
    s = step(m)
    assert (s.prefill_tokens, ids(s)) == (150, ["b"])
    assert m.num_waiting == 1 and m.num_running == 2
    # Refused for tokens, the batch counts as full: no prefill is tried again until the batch shrinks, although
    # the decaying ratio would now let C in.
    for _ in range(5):
        s = step(m)
        assert s.prefill_tokens == 0 and s.decode_seqs == 2
    assert m.num_waiting == 1


def test_admission_clips_the_output_estimate():
    """With clip 100, A (max 400) reserves min(399, 100) x 0.7 = 69.3 and B reserves 150 + min(400, 100) = 250
    (unclipped, B's 550 would not fit the 500 free)."""
    m = sg(kv_cache_tokens=600, clip_max_new_tokens=100)
    m.submit("a", words(100, "a"), 400, ignore_eos=True, now=0)
    step(m)  # 500 free
    m.submit("b", words(150, "b"), 400, ignore_eos=True, now=0)  # 250 < 500 - 69.3 = 430.7
    m.submit("c", words(90, "c"), 400, ignore_eos=True, now=0)  # 190 >= 430.7 - 250 = 180.7: refused
    s = step(m)
    assert ids(s) == ["b"] and m.num_waiting == 1


def test_max_prefill_tokens_stops_the_batch():
    """A second request whose input exceeds the prefill tokens left waits for the next prefill batch."""
    m = sg(kv_cache_tokens=5000, max_prefill_tokens=100)
    m.submit("a", words(60, "a"), 5, ignore_eos=True, now=0)
    m.submit("b", words(60, "b"), 5, ignore_eos=True, now=0)
    assert ids(step(m)) == ["a"]
    s = step(m)  # not refused for tokens, so the batch is not full: B's prefill comes next
    assert (s.prefill_tokens, ids(s)) == (60, ["b"])


def test_running_request_limit():
    """max_running_requests caps the batch; the rest wait."""
    m = sg(kv_cache_tokens=5000, max_running_requests=2)
    for r in "abc":
        m.submit(r, words(10, r), 5, ignore_eos=True, now=0)
    assert ids(step(m)) == ["a", "b"]
    assert m.num_waiting == 1


# ---- new_token_ratio ----------------------------------------------------------------------------------------------

def test_ratio_decays_per_decode_step_to_its_floor_and_resets_when_idle():
    """decay = (0.7 - 0.7 x 0.14) / 10 = 0.0602 per decode step, none per prefill; floor 0.098; idle resets."""
    m = sg(kv_cache_tokens=1000, new_token_ratio_decay_steps=10)
    m.submit("a", words(10, "a"), 30, ignore_eos=True, now=0)
    step(m)
    assert m.new_token_ratio == pytest.approx(0.7)
    for _ in range(5):
        step(m)
    assert m.new_token_ratio == pytest.approx(0.7 - 5 * 0.0602)
    for _ in range(24):  # to the last token (30 in all)
        step(m)
    assert m.new_token_ratio == pytest.approx(0.098)
    assert m.start_step(0.0) is None  # idle
    assert m.new_token_ratio == pytest.approx(0.7)


# ---- retraction -----------------------------------------------------------------------------------------------

def _three_decoding(a_max: int = 60, **kw) -> SglangEngineModel:
    """Capacity 100, clip 1 (reservations of about one token): A, B (prompts 20) and C (30) are all admitted, 30
    tokens stay free; after 10 decode steps of 3 tokens nothing is free and every request has 11 outputs."""
    m = sg(kv_cache_tokens=100, clip_max_new_tokens=1, **kw)
    m.submit("a", words(20, "a"), a_max, ignore_eos=True, now=0)
    m.submit("b", words(20, "b"), 60, ignore_eos=True, now=0)
    m.submit("c", words(30, "c"), 60, ignore_eos=True, now=0)
    assert ids(step(m)) == ["a", "b", "c"]
    for _ in range(10):
        assert step(m).preempted == ()
    assert m.available == 0
    return m


def test_retraction_takes_fewest_outputs_then_longest_input_then_latest():
    """Equal outputs: C (longest input) goes first; 10 tokens free < 2 x 25, C's prompt evicted, still 40 < 50, so
    B (ties A, later in the batch) goes too. Ratio = (11 + 25) / 60 = 0.6; both wait at the tail, C first."""
    m = _three_decoding(retract_decode_steps=25)
    s = step(m)
    assert s.preempted == ("c", "b")
    assert (m.retractions, m.num_preemptions) == (2, 2)
    assert ids(s) == ["a"] and [r.request_id for r in m._waiting] == ["c", "b"]
    assert m.new_token_ratio == pytest.approx(0.6)
    assert m.cached_prefix_tokens(words(30, "c")) == 0  # evicted to make room


def test_retracted_request_keeps_its_prefix_and_output_and_is_readmitted():
    """With 5 steps: C alone frees 10 >= 2 x 5; its prompt stays cached (unlocked); ratio (22 + 10) / (12 + 60).
    A finishes in that step (max 12), so C is readmitted at once: its whole prompt hits (it matches all but the
    last of 41 known tokens), it recomputes its 11 outputs and then produces its 12th token."""
    m = _three_decoding(a_max=12, retract_decode_steps=5)
    s = step(m)
    assert s.preempted == ("c",)
    assert m.new_token_ratio == pytest.approx(32 / 72)
    assert m.cached_prefix_tokens(words(30, "c")) == 29
    assert m.cache.evictable_size == 30 + 31 and m.num_waiting == 1  # C's prompt; A finished: 20 + 11
    now, done = 0.0, {}
    c = m._ids["c"]
    s = m.start_step(now)
    assert ids(s) == ["c"] and (c.prefix_len, c.extend, s.prefill_tokens) == (30, 11, 11)
    assert s.outputs[0].index == 11
    while s is not None:  # to the end (memory stays tight: more retractions may come)
        m.complete_step(s)
        now = s.end
        done.update({f.request_id: f for f in s.finished})
        s = m.start_step(now)
    assert {r: f.completion_tokens for r, f in done.items()} == {"b": 60, "c": 60}  # A finished earlier
    assert done["c"].num_preemptions >= 1
    assert m.prefix_cache_hits == 0  # counted at first admission only, like the vLLM model


# ---- waiting-queue order ------------------------------------------------------------------------------------------

def _queue_after_p(**kw) -> SglangEngineModel:
    m = sg(kv_cache_tokens=10000, **kw)
    p = words(50, "p")
    m.submit("p", p, 1, ignore_eos=True, now=0)
    step(m)  # P finishes: its prompt stays cached
    m.submit("x", words(10, "x"), 1, ignore_eos=True, now=0)
    m.submit("y", p + words(5, "y"), 1, ignore_eos=True, now=0)
    m.submit("z", p[:20] + words(5, "z"), 1, ignore_eos=True, now=0)
    return m


def test_lpm_orders_the_queue_by_longest_cached_prefix():
    """Y matches 50 tokens, Z 20, X none: the prefill batch runs Y, Z, X (arrival order X, Y, Z)."""
    m = _queue_after_p()
    s = step(m)
    assert ids(s) == ["y", "z", "x"]
    assert s.prefill_tokens == 5 + 5 + 10


def test_lpm_falls_back_to_fcfs_when_the_queue_is_long():
    """More waiting than the threshold (here 2, SGLang 128): no sorting, arrival order."""
    assert ids(step(_queue_after_p(lpm_fcfs_threshold=2))) == ["x", "y", "z"]
    assert ids(step(_queue_after_p(schedule_policy="fcfs"))) == ["x", "y", "z"]


# ---- radix cache ----------------------------------------------------------------------------------------------

def test_prefix_hits_are_token_granular():
    """A second prompt sharing 23 of 30 tokens hits 23 (a 16-token block cache would hit 16)."""
    m = sg(kv_cache_tokens=1000)
    a = words(30, "a")
    m.submit("a", a, 2, ignore_eos=True, now=0)
    step(m)
    step(m)
    m.submit("b", a[:23] + words(7, "b"), 2, ignore_eos=True, now=0)
    s = step(m)
    assert s.prefill_tokens == 7
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (23, 60)


def test_radix_cache_splits_matches_and_evicts_least_recently_used_unlocked_leaves():
    """Match splits a node at the divergence; eviction removes the LRU unlocked leaf first, never a locked one."""
    c = RadixCache()
    assert c.insert(list("abcdef")) == 0
    assert c.insert(list("abcxyz")) == 3
    assert c.evictable_size == 9
    n, node = c.match_prefix(list("abq"))
    assert n == 2 and node.key == list("ab")
    c.insert(list("klm"))
    c.match_prefix(list("abcdef"))  # touch: "xyz" is now the least recently used leaf
    assert c.evict(1) == 3 and c.peek_prefix(list("abcxyz")) == 3
    n, node = c.match_prefix(list("abcdef"))
    c.inc_lock_ref(node)
    assert (c.protected_size, c.evictable_size) == (6, 3)
    assert c.evict(100) == 3  # only "klm"
    assert c.peek_prefix(list("abcdef")) == 6 and c.peek_prefix(list("klm")) == 0
    c.dec_lock_ref(node)
    assert c.evict(100) == 6 and c.total_size == 0


# ---- chunked prefill ----------------------------------------------------------------------------------------------

def test_chunked_prefill_continues_first_and_shares_the_last_chunk():
    """Chunk 64: a 150-token prompt takes 64, 64, 22 tokens; B (10) waits while a chunk fills the budget and joins
    the last chunk's batch; the chunked request counts as running, and its first token comes with its last chunk."""
    m = sg(kv_cache_tokens=5000, chunked_prefill_size=64)
    m.submit("a", words(150, "a"), 5, ignore_eos=True, now=0)
    s = step(m)
    assert (s.prefill_tokens, ids(s), m.num_running, m.num_waiting) == (64, [], 1, 0)
    m.submit("b", words(10, "b"), 5, ignore_eos=True, now=0)
    s = step(m)
    assert (s.prefill_tokens, ids(s), m.num_waiting) == (64, [], 1)
    s = step(m)
    assert (s.prefill_tokens, ids(s), m.num_running) == (32, ["a", "b"], 2)
    assert m.cached_prefix_tokens(words(150, "a")) == 149


# ---- accounting ---------------------------------------------------------------------------------------------------

def test_kv_tokens_are_conserved_under_random_load():
    """free + cached + held always equals the capacity, every request finishes with its tokens, in any order."""
    m = sg(kv_cache_tokens=3000)
    rng = random.Random(7)
    now, finished, base = 0.0, {}, words(200, "s")
    for i in range(60):
        m.submit(f"r{i}", base[: rng.randint(0, 200)] + words(rng.randint(1, 300), f"u{i}-"), rng.randint(1, 200),
                 ignore_eos=True, now=now)
        for _ in range(rng.randint(0, 15)):
            s = m.start_step(now)
            if s is None:
                break
            held = sum(r.private for r in m._ids.values())
            assert m.available >= 0 and m.available + m.cache.total_size + held == m.capacity
            m.complete_step(s)
            now = s.end
            finished.update({f.request_id: f.completion_tokens for f in s.finished})
    while (s := m.next_step(now)) is not None:
        now = s.end
        finished.update({f.request_id: f.completion_tokens for f in s.finished})
    assert len(finished) == 60 and m.num_running == m.num_waiting == 0
    assert m.available + m.cache.evictable_size == m.capacity and m.kv_usage == 0.0


def test_the_sglang_personality_exports_the_schedulers_new_token_ratio():
    """With the SGLang scheduler model the emulator's /metrics carries ``sglang:new_token_ratio`` (SGLang's gauge),
    which the balancer's SGLang adapter reads as the share of the running batch's output it keeps reserved; with
    vLLM's model behind the SGLang personality there is no such ratio to export."""
    from prometheus_client import CollectorRegistry, generate_latest

    from bench.emulator.personalities.sglang import _SglangCollector
    from skylb.engines.base import gauges
    from skylb.engines.sglang import NEW_TOKEN_RATIO

    for params, expected in ((EngineParams(admission="sglang"), 0.7), (EngineParams(), None)):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_SglangCollector(make_engine(params), "m"))
        _, highest = gauges(generate_latest(registry).decode(), (), (NEW_TOKEN_RATIO,))
        assert highest.get(NEW_TOKEN_RATIO) == expected
