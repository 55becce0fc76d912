"""Unit tests of the pure engine model (skylb/emulator/model.py): batching, admission, prefix cache, timing."""

from __future__ import annotations

import pytest

from skylb.emulator.model import (
    EngineModel,
    EngineParams,
    RequestTooLong,
    Step,
    chat_tokens,
    output_token,
    text_tokens,
)

MAX_STEPS = 10_000  # every drive loop is bounded


def words(n: int, tag: str) -> list[str]:
    """``n`` distinct tokens, unique per ``tag`` (so unrelated prompts never share cache blocks)."""
    return [f"{tag}{i}" for i in range(n)]


def run_until_idle(model: EngineModel, now: float = 0.0) -> tuple[float, list[Step]]:
    """Step the model until nothing runs; returns the final time and the steps."""
    steps = []
    for _ in range(MAX_STEPS):
        step = model.next_step(now)
        if step is None:
            return now, steps
        steps.append(step)
        now = step.end
    raise AssertionError("model did not go idle")


def finished_by_id(steps: list[Step]) -> dict:
    """FinishedRequest per request id over ``steps``."""
    return {f.request_id: f for s in steps for f in s.finished}


def test_tokens_are_words_and_chat_prefixes_roles():
    """One token is one whitespace-separated word; chat adds a `<role>:` token before each message."""
    assert text_tokens("  a b\n c\t") == ["a", "b", "c"]
    assert chat_tokens([("system", "be brief"), ("user", "hi there"), ("assistant", "")]) == [
        "system:", "be", "brief", "user:", "hi", "there", "assistant:"]


def test_pending_only_when_slots_are_full():
    """Requests wait only once every running slot (max_num_seqs) is taken."""
    model = EngineModel(EngineParams(max_num_seqs=2))
    for i in range(2):
        model.submit(f"r{i}", words(10, f"p{i}-"), 5, ignore_eos=True, now=0.0)
        assert model.num_waiting == 0
    model.submit("r2", words(10, "p2-"), 5, ignore_eos=True, now=0.0)
    assert (model.num_running, model.num_waiting) == (2, 1)


def test_pending_when_kv_cache_is_full_with_free_slots():
    """A request waits when its prompt plus output does not fit the free KV blocks, even with slots free."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16, max_num_seqs=8))
    model.submit("a", words(100, "a"), 50, ignore_eos=True, now=0.0)  # 150 tokens -> 10 of 16 blocks
    assert model.kv_usage == pytest.approx(10 / 16)
    model.submit("b", words(100, "b"), 50, ignore_eos=True, now=0.0)
    assert (model.num_running, model.num_waiting) == (1, 1)
    run_until_idle(model)
    assert (model.num_running, model.num_waiting, model.kv_usage) == (0, 0, 0.0)


def test_admission_is_fcfs_without_skipping():
    """A small request behind a head that does not fit waits too; admission follows arrival order."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16))
    model.submit("big1", words(150, "x"), 50, ignore_eos=True, now=0.0)  # 13 blocks
    model.submit("big2", words(150, "y"), 50, ignore_eos=True, now=1.0)  # does not fit next to big1
    model.submit("small", words(10, "z"), 5, ignore_eos=True, now=2.0)  # would fit, must not skip big2
    assert (model.num_running, model.num_waiting) == (1, 2)
    _, steps = run_until_idle(model, now=3.0)
    done = finished_by_id(steps)
    assert done["big2"].admitted_at == done["big1"].finished_at
    assert done["small"].admitted_at >= done["big2"].admitted_at
    assert done["small"].queue_s > 0


def test_prefill_time_is_proportional_to_uncached_tokens():
    """The first step's extra time over the fixed base grows linearly with the uncached prompt tokens."""
    p = EngineParams()
    durations = {}
    for n in (256, 512, 1024):
        model = EngineModel(p)
        model.submit("r", words(n, f"n{n}-"), 4, ignore_eos=True, now=0.0)
        step = model.next_step(0.0)
        assert step.prefill_tokens == n
        durations[n] = step.duration - p.decode_base_ms / 1000
    assert durations[512] == pytest.approx(2 * durations[256])
    assert durations[1024] == pytest.approx(2 * durations[512])
    # The paper's anchor: a 512-token prompt prefills in about 300 ms on an L4.
    assert durations[512] + p.decode_base_ms / 1000 == pytest.approx(0.300, abs=0.005)


def test_repeated_prompt_is_served_from_the_prefix_cache_in_full_blocks():
    """A repeated prompt reports cached_tokens in whole blocks (last token always recomputed) and prefills faster."""
    model = EngineModel(EngineParams(block_size=16))
    prompt = words(100, "rep")
    model.submit("first", prompt, 3, ignore_eos=True, now=0.0)
    now, steps = run_until_idle(model)
    first_prefill = steps[0].duration
    assert finished_by_id(steps)["first"].cached_tokens == 0
    model.submit("second", prompt, 3, ignore_eos=True, now=now)
    _, steps = run_until_idle(model, now)
    assert finished_by_id(steps)["second"].cached_tokens == 96  # 6 full blocks of 16
    assert steps[0].prefill_tokens == 4 and steps[0].duration < first_prefill
    # A prompt of exactly 3 blocks hits at most 2: vLLM recomputes the last token to sample from it.
    exact = words(48, "exact")
    model.submit("e1", exact, 2, ignore_eos=True, now=0.0)
    run_until_idle(model)
    model.submit("e2", exact, 2, ignore_eos=True, now=0.0)
    _, steps = run_until_idle(model)
    assert finished_by_id(steps)["e2"].cached_tokens == 32
    assert model.prefix_cache_hits == 96 + 32
    assert model.prefix_cache_queries == 100 + 100 + 48 + 48


def test_a_shared_prefix_hits_up_to_the_first_differing_block():
    """Two prompts that share their first 40 tokens share 2 full blocks of the cache."""
    model = EngineModel(EngineParams(block_size=16))
    model.submit("a", words(40, "s") + words(30, "a"), 2, ignore_eos=True, now=0.0)
    run_until_idle(model)
    model.submit("b", words(40, "s") + words(30, "b"), 2, ignore_eos=True, now=0.0)
    _, steps = run_until_idle(model)
    assert finished_by_id(steps)["b"].cached_tokens == 32


def test_lru_eviction_under_pressure_evicts_oldest_tails_first():
    """Cached blocks stay until an allocation needs room; then the least recently used go, a request's tail first."""
    p = EngineParams(kv_cache_tokens=128, block_size=16)  # 8 blocks; each request below takes 4
    model = EngineModel(p)
    a, b, c = words(48, "A"), words(48, "B"), words(48, "C")
    for rid, prompt in (("a", a), ("b", b)):
        model.submit(rid, prompt, 8, ignore_eos=True, now=0.0)
        run_until_idle(model)
    assert model.evicted_blocks == 0 and model.num_cached_blocks == 6  # A's and B's 3 prompt blocks each
    model.submit("c", c, 8, ignore_eos=True, now=0.0)  # 2 never-used blocks left: evict 2 of A's
    run_until_idle(model)
    assert model.evicted_blocks == 2
    assert model.cached_prefix_tokens(b) == 32  # B untouched (at most 2 of 3 blocks: the last token is computed)
    assert model.cached_prefix_tokens(a) == 16  # A kept only its first block
    assert model.cached_prefix_tokens(c) == 32
    model.submit("b2", b, 8, ignore_eos=True, now=0.0)
    _, steps = run_until_idle(model)
    assert finished_by_id(steps)["b2"].cached_tokens == 32


def test_decode_step_time_grows_with_batch_size():
    """A decode iteration takes longer with more sequences in the batch (per-sequence and per-KV-token terms)."""
    def decode_duration(batch: int) -> float:
        model = EngineModel()
        for i in range(batch):
            model.submit(f"r{i}", words(16, f"d{batch}-{i}-"), 10, ignore_eos=True, now=0.0)
        model.next_step(0.0)  # the prefill step
        step = model.next_step(1.0)
        assert step.decode_seqs == batch and step.prefill_tokens == 0
        return step.duration

    d1, d8, d64 = decode_duration(1), decode_duration(8), decode_duration(64)
    assert d1 < d8 < d64
    p = EngineParams()
    assert d1 == pytest.approx((p.decode_base_ms + p.decode_ms_per_seq + 17 * p.decode_ms_per_kv_token) / 1000)


def test_ignore_eos_generates_exactly_max_tokens():
    """With ignore_eos the completion has exactly max_tokens tokens, one per step after the first."""
    model = EngineModel()
    model.submit("r", words(20, "e"), 37, ignore_eos=True, now=0.0)
    _, steps = run_until_idle(model)
    assert len(steps) == 37
    fin = finished_by_id(steps)["r"]
    assert (fin.completion_tokens, fin.finish_reason) == (37, "length")
    assert [o.index for s in steps for o in s.outputs] == list(range(37))


def test_without_ignore_eos_the_length_is_deterministic_and_bounded():
    """Without ignore_eos a request stops after 1..max_tokens tokens, the same for the same prompt."""
    lengths = []
    for i in range(30):
        model = EngineModel()
        model.submit("r", words(10, f"eos{i}-"), 40, ignore_eos=False, now=0.0)
        _, steps = run_until_idle(model)
        fin = finished_by_id(steps)["r"]
        assert 1 <= fin.completion_tokens <= 40
        assert fin.finish_reason == ("length" if fin.completion_tokens == 40 else "stop")
        lengths.append(fin.completion_tokens)
    assert len(set(lengths)) > 5  # varies with the prompt
    again = EngineModel()
    again.submit("r", words(10, "eos0-"), 40, ignore_eos=False, now=0.0)
    assert finished_by_id(run_until_idle(again)[1])["r"].completion_tokens == lengths[0]


def test_cancel_frees_the_slot_and_blocks():
    """Cancelling a running request frees its slot and KV blocks and admits the next waiting one."""
    model = EngineModel(EngineParams(max_num_seqs=1))
    model.submit("a", words(30, "a"), 100, ignore_eos=True, now=0.0)
    model.submit("b", words(30, "b"), 100, ignore_eos=True, now=0.0)
    model.next_step(0.0)
    assert (model.num_running, model.num_waiting) == (1, 1)
    usage_one = model.kv_usage
    assert model.cancel("a", now=0.5)
    assert (model.num_running, model.num_waiting) == (1, 0)
    assert model.kv_usage == pytest.approx(usage_one)  # b holds what a held
    assert model.cancel("b", now=0.6)
    assert (model.num_running, model.kv_usage) == (0, 0.0)
    assert not model.cancel("b", now=0.7)
    assert model.requests_finished["abort"] == 2
    model.submit("w", words(5, "w"), 3, ignore_eos=True, now=1.0)
    model.submit("x", words(5, "x"), 3, ignore_eos=True, now=1.0)
    assert model.cancel("x", now=1.0)  # a waiting request can be cancelled too
    assert model.num_waiting == 0


def test_capacity_frees_only_when_the_step_completes():
    """A request finishing in an in-flight step keeps its slot until complete_step, so pending stays visible."""
    model = EngineModel(EngineParams(max_num_seqs=1))
    model.submit("a", words(8, "a"), 1, ignore_eos=True, now=0.0)
    model.submit("b", words(8, "b"), 1, ignore_eos=True, now=0.0)
    step = model.start_step(0.0)
    assert [f.request_id for f in step.finished] == ["a"]
    assert (model.num_running, model.num_waiting) == (1, 1)
    with pytest.raises(RuntimeError):
        model.start_step(0.0)
    model.complete_step(step)
    assert (model.num_running, model.num_waiting) == (1, 0)
    _, steps = run_until_idle(model, step.end)
    assert finished_by_id(steps)["b"].admitted_at == step.end


def test_long_prompts_prefill_in_chunks_of_the_token_budget():
    """A prompt longer than max_num_batched_tokens takes several steps to its first token (chunked prefill)."""
    model = EngineModel(EngineParams(max_num_batched_tokens=2048))
    model.submit("r", words(5000, "long"), 2, ignore_eos=True, now=0.0)
    _, steps = run_until_idle(model)
    assert [s.prefill_tokens for s in steps] == [2048, 2048, 904, 0]
    fin = finished_by_id(steps)["r"]
    assert fin.first_token_at == steps[2].end


def test_time_scale_multiplies_every_duration():
    """time_scale=0.01 makes each step a hundredth as long."""
    def durations(scale: float) -> list[float]:
        model = EngineModel(EngineParams(time_scale=scale))
        model.submit("r", words(300, "t"), 5, ignore_eos=True, now=0.0)
        return [s.duration for s in run_until_idle(model)[1]]

    assert durations(0.01) == pytest.approx([d * 0.01 for d in durations(1.0)])


def test_too_long_and_invalid_requests_are_refused():
    """prompt + max_tokens above the model length, empty prompts, bad max_tokens and duplicate ids raise."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16))
    with pytest.raises(RequestTooLong):
        model.submit("r", words(200, "a"), 100, ignore_eos=True, now=0.0)
    with pytest.raises(RequestTooLong):
        model.submit("r", words(300, "a"), None, ignore_eos=True, now=0.0)
    with pytest.raises(ValueError):
        model.submit("r", [], 5, ignore_eos=True, now=0.0)
    with pytest.raises(ValueError):
        model.submit("r", ["a"], 0, ignore_eos=True, now=0.0)
    model.submit("r", ["a"], None, ignore_eos=False, now=0.0)  # None: up to the model length
    with pytest.raises(ValueError):
        model.submit("r", ["a"], 5, ignore_eos=True, now=0.0)
    with pytest.raises(ValueError):
        EngineParams(max_num_seqs=300, max_num_batched_tokens=256)


def test_same_calls_give_the_same_steps():
    """Two models fed the same calls produce identical steps, tokens and texts (determinism)."""
    def trace() -> list[tuple]:
        model = EngineModel(EngineParams(max_num_seqs=3, kv_cache_tokens=1024))
        for i in range(8):
            model.submit(f"r{i}", words(20 + 10 * i, "shared") + [str(i)], 30, ignore_eos=i % 2 == 0, now=0.1 * i)
        _, steps = run_until_idle(model, 1.0)
        return [(s.start, s.duration, tuple((o.request_id, o.index, o.text) for o in s.outputs)) for s in steps]

    assert trace() == trace()
    assert output_token(12345, 3) == output_token(12345, 3)


def test_thousands_of_requests_run_quickly():
    """A few thousand requests step through in well under a few seconds (the simulator drives this class)."""
    model = EngineModel(EngineParams(max_num_seqs=64))
    for i in range(2000):
        model.submit(f"r{i}", words(64, f"q{i % 50}-"), 20, ignore_eos=True, now=0.0)
    now, steps = run_until_idle(model)
    assert model.requests_finished["length"] == 2000 and model.num_waiting == 0
    assert model.prefix_cache_hits > 0
