"""Unit tests of the pure engine model (bench/emulator/model.py): batching, admission, preemption, prefix cache,
timing."""

from __future__ import annotations

import random

import pytest

from bench.emulator.model import (
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


def test_waiting_until_a_step_schedules_it_then_only_when_slots_are_full():
    """A submitted request is waiting until a step schedules it; after that only requests beyond max_num_seqs wait."""
    model = EngineModel(EngineParams(max_num_seqs=2))
    for i in range(3):
        model.submit(f"r{i}", words(10, f"p{i}-"), 5, ignore_eos=True, now=0.0)
    assert (model.num_running, model.num_waiting, model.kv_usage) == (0, 3, 0.0)
    model.next_step(0.0)
    assert (model.num_running, model.num_waiting) == (2, 1)


def test_a_request_submitted_during_a_step_waits_for_the_next_one():
    """Free slots and blocks do not make a request running: it waits until the next step schedules it."""
    model = EngineModel()
    model.submit("a", words(10, "a"), 5, ignore_eos=True, now=0.0)
    step = model.start_step(0.0)
    model.submit("b", words(10, "b"), 5, ignore_eos=True, now=step.start + step.duration / 2)
    assert (model.num_running, model.num_waiting) == (1, 1)
    model.complete_step(step)
    assert (model.num_running, model.num_waiting) == (1, 1)
    nxt = model.start_step(step.end)
    assert (model.num_running, model.num_waiting) == (2, 0)
    model.complete_step(nxt)
    _, steps = run_until_idle(model, nxt.end)
    assert finished_by_id(steps)["b"].admitted_at == step.end


def test_a_request_given_no_prefill_budget_counts_as_waiting():
    """When a long prompt takes the step's whole token budget, a request behind it stays waiting (vLLM V1)."""
    model = EngineModel(EngineParams(max_num_batched_tokens=256, max_num_seqs=4))
    model.submit("long", words(300, "l"), 3, ignore_eos=True, now=0.0)
    model.submit("short", words(10, "s"), 3, ignore_eos=True, now=0.0)
    first = model.next_step(0.0)
    assert first.prefill_tokens == 256 and first.outputs == ()
    assert (model.num_running, model.num_waiting) == (1, 1)  # a slot and blocks are free, the budget is not
    second = model.next_step(first.end)
    assert second.prefill_tokens == 44 + 10  # the rest of the long prompt, then the short one whole
    assert (model.num_running, model.num_waiting) == (2, 0)
    _, steps = run_until_idle(model, second.end)
    done = finished_by_id([first, second, *steps])
    assert done["short"].admitted_at == second.start and done["short"].queue_s == second.start
    assert done["long"].admitted_at == 0.0 and done["long"].first_token_at == second.end


def test_waiting_when_the_prompt_does_not_fit_the_free_kv_blocks():
    """A request waits while its whole prompt does not fit the free KV blocks, even with slots and budget free."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16, max_num_seqs=8,
                                     max_num_batched_tokens=160))
    model.submit("a", words(150, "a"), 50, ignore_eos=True, now=0.0)  # 150 prompt tokens -> 10 of 16 blocks
    model.submit("b", words(150, "b"), 50, ignore_eos=True, now=0.0)
    model.next_step(0.0)
    assert model.kv_usage == pytest.approx(10 / 16)  # only what is computed is allocated: no output reserved
    assert (model.num_running, model.num_waiting) == (1, 1)  # b's first 10-token chunk would fit, its prompt not
    run_until_idle(model)
    assert (model.num_running, model.num_waiting, model.kv_usage) == (0, 0, 0.0)


def test_without_full_prompt_reservation_only_the_first_chunk_must_fit():
    """scheduler_reserve_full_isl=False (vLLM before #37307) admits a request whose first chunk fits."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16, max_num_seqs=8,
                                     max_num_batched_tokens=160, scheduler_reserve_full_isl=False))
    model.submit("a", words(150, "a"), 50, ignore_eos=True, now=0.0)
    model.submit("b", words(150, "b"), 50, ignore_eos=True, now=0.0)
    step = model.next_step(0.0)
    assert step.prefill_tokens == 160 and (model.num_running, model.num_waiting) == (2, 0)
    _, steps = run_until_idle(model, step.end)
    assert model.num_preemptions > 0  # over-admission: they cannot both grow to 13 blocks
    assert {f.request_id: f.completion_tokens for f in finished_by_id(steps).values()} == {"a": 50, "b": 50}


def test_admission_is_fcfs_without_skipping():
    """A small request behind a head that does not fit waits too; admission follows arrival order."""
    model = EngineModel(EngineParams(kv_cache_tokens=256, block_size=16))
    model.submit("big1", words(150, "x"), 50, ignore_eos=True, now=0.0)  # 10 blocks of prompt, 13 at the end
    model.submit("big2", words(150, "y"), 50, ignore_eos=True, now=1.0)  # its prompt does not fit next to big1
    model.submit("small", words(10, "z"), 5, ignore_eos=True, now=2.0)  # would fit, must not skip big2
    first = model.next_step(3.0)
    assert (model.num_running, model.num_waiting) == (1, 2)
    _, steps = run_until_idle(model, now=first.end)
    done = finished_by_id(steps)
    assert done["big2"].admitted_at == done["big1"].finished_at
    assert done["small"].admitted_at >= done["big2"].admitted_at
    assert done["small"].queue_s > 0
    assert model.num_preemptions == 0


def test_kv_exhaustion_preempts_the_newest_running_request_which_is_recomputed_and_finishes():
    """Out of KV blocks, the newest running request is preempted (recompute), waits at the head, resumes and
    produces every token exactly once; vLLM's num_preemptions counts it."""
    bs = 16
    model = EngineModel(EngineParams(kv_cache_tokens=16 * bs, block_size=bs))
    model.submit("a", words(100, "a"), 80, ignore_eos=True, now=0.0)  # 7 blocks of prompt, 12 at the end
    model.submit("b", words(100, "b"), 80, ignore_eos=True, now=0.0)  # both prompts fit (14 of 16 blocks)
    model.submit("c", words(10, "c"), 60, ignore_eos=True, now=0.0)  # fits too (1 block): the newest
    _, steps = run_until_idle(model)
    preempting = [s for s in steps if s.preempted]
    assert [s.preempted for s in preempting] == [("c",), ("b",)]  # the tail of the running batch, newest first
    assert model.num_preemptions == 2
    done = finished_by_id(steps)
    tokens: dict[str, list[int]] = {}
    for s in steps:
        for o in s.outputs:
            tokens.setdefault(o.request_id, []).append(o.index)
    assert tokens == {"a": list(range(80)), "b": list(range(80)), "c": list(range(60))}  # none lost or repeated
    assert (done["a"].num_preemptions, done["b"].num_preemptions, done["c"].num_preemptions) == (0, 1, 1)
    assert done["b"].admitted_at == 0.0 and done["b"].first_token_at == steps[0].end  # first times are kept
    # b, then c (b went back to the head last) resume only once a finished: b's known tokens did not fit beside
    # a, and c may not skip b. Both recompute their prompt and generated tokens in one chunked step.
    back = next(s for s in steps if s.prefill_tokens > 0 and s.start > 0)
    assert back.start == done["a"].finished_at and back.decode_seqs == 0
    assert [o.request_id for o in back.outputs] == ["b", "c"]
    b_known, c_known = 100 + back.outputs[0].index, 10 + back.outputs[1].index
    assert c_known < back.prefill_tokens < b_known + c_known  # c has no full block to hit; b hits part of its prompt
    assert model.prefix_cache_queries == 210  # a preempted request's lookups are not counted again (vLLM)
    assert (model.num_running, model.num_waiting, model.kv_usage) == (0, 0, 0.0)


def test_a_preempted_request_hits_its_own_cached_prompt_blocks_on_readmission():
    """The prompt blocks a preempted request registered stay cached (LRU) and serve its recomputation."""
    bs = 16
    model = EngineModel(EngineParams(kv_cache_tokens=16 * bs, block_size=bs, max_num_seqs=2))
    model.submit("a", words(100, "a"), 80, ignore_eos=True, now=0.0)
    model.submit("b", words(100, "b"), 80, ignore_eos=True, now=0.0)
    now, step = 0.0, None
    for _ in range(MAX_STEPS):
        step = model.next_step(now)
        now = step.end
        if step.preempted:
            break
    assert step.preempted == ("b",) and (model.num_running, model.num_waiting) == (1, 1)
    assert model.cached_prefix_tokens(words(100, "b")) == 96  # all 6 full prompt blocks, now evictable
    _, steps = run_until_idle(model, now)
    back = next(s for s in steps if s.prefill_tokens > 1)
    (out,) = back.outputs
    known = 100 + out.index  # prompt plus what b generated before its preemption
    hit = known - back.prefill_tokens
    assert hit % bs == 0 and 0 < hit <= 96  # whole blocks of its own prompt; a's growth may have evicted its tail
    assert model.prefix_cache_hits == 0  # hits on readmission are not counted as new requests' hits (vLLM)


def test_no_request_is_lost_or_finished_twice_under_preemption():
    """Random arrivals, cancels and a small KV cache: every request ends exactly once with all its tokens in order."""
    rng = random.Random(20240611)
    params = EngineParams(kv_cache_tokens=512, block_size=16, max_num_seqs=6, max_num_batched_tokens=64)
    model = EngineModel(params)
    shared = words(40, "sys")
    expected: dict[str, int] = {}
    cancelled: set[str] = set()
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    now, submitted = 0.0, 0
    for _ in range(MAX_STEPS):
        for _ in range(rng.choice((0, 0, 0, 1, 2))):
            if submitted < 60:
                rid = f"r{submitted}"
                prompt = (shared if rng.random() < 0.5 else []) + words(rng.randint(1, 150), rid)
                max_tokens = rng.randint(1, min(200, params.model_len - len(prompt)))
                model.submit(rid, prompt, max_tokens, ignore_eos=True, now=now)
                expected[rid] = max_tokens
                submitted += 1
        step = model.start_step(now)
        if step is None:
            if submitted == 60:
                break
            now += 0.01
            continue
        if rng.random() < 0.01 and expected:  # a client goes away mid-step
            victim = rng.choice(sorted(expected))
            if model.cancel(victim, now=now):
                cancelled.add(victim)
        model.complete_step(step)
        for o in step.outputs:
            if o.request_id in cancelled:
                continue  # the caller drops a cancelled request's tokens
            tokens.setdefault(o.request_id, []).append(o.index)
            if o.finished is not None:
                finished.append(o.request_id)
                assert o.finished.completion_tokens == expected[o.request_id]
        assert 0.0 <= model.kv_usage <= 1.0
        assert model.num_running <= params.max_num_seqs
        live = set(expected) - cancelled - set(finished)
        assert model.num_waiting + model.num_running == len(live)
        now = step.end
    else:
        raise AssertionError("model did not go idle")
    assert model.num_preemptions > 0  # the load exercised preemption
    assert len(finished) == len(set(finished)) and set(finished) == set(expected) - cancelled
    for rid in finished:
        assert tokens[rid] == list(range(expected[rid]))
    assert (model.num_running, model.num_waiting, model.kv_usage) == (0, 0, 0.0)
    assert model.num_free_blocks == params.num_blocks


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
    """Cancelling a running request frees its slot and KV blocks; the next step admits the next waiting one."""
    model = EngineModel(EngineParams(max_num_seqs=1))
    model.submit("a", words(30, "a"), 100, ignore_eos=True, now=0.0)
    model.submit("b", words(30, "b"), 100, ignore_eos=True, now=0.0)
    model.next_step(0.0)
    assert (model.num_running, model.num_waiting) == (1, 1)
    usage_one = model.kv_usage
    assert model.cancel("a", now=0.5)
    assert (model.num_running, model.num_waiting) == (0, 1)  # b takes the room at the next step
    model.next_step(0.5)
    assert (model.num_running, model.num_waiting) == (1, 0)
    assert model.kv_usage == pytest.approx(usage_one)  # b holds what a held
    assert model.cancel("b", now=0.6)
    assert (model.num_running, model.kv_usage) == (0, 0.0)
    assert not model.cancel("b", now=0.7)
    assert model.requests_finished["abort"] == 2
    model.submit("w", words(5, "w"), 3, ignore_eos=True, now=1.0)
    model.submit("x", words(5, "x"), 3, ignore_eos=True, now=1.0)
    assert model.cancel("x", now=1.0)  # a waiting request can be cancelled too
    assert model.num_waiting == 1 and not model.has_request("x")


def test_capacity_frees_only_when_the_step_completes():
    """A request finishing in an in-flight step keeps its slot until complete_step; the next step admits the next."""
    model = EngineModel(EngineParams(max_num_seqs=1))
    model.submit("a", words(8, "a"), 1, ignore_eos=True, now=0.0)
    model.submit("b", words(8, "b"), 1, ignore_eos=True, now=0.0)
    step = model.start_step(0.0)
    assert [f.request_id for f in step.finished] == ["a"]
    assert (model.num_running, model.num_waiting) == (1, 1)
    with pytest.raises(RuntimeError):
        model.start_step(0.0)
    model.complete_step(step)
    assert (model.num_running, model.num_waiting) == (0, 1)  # vLLM reports b waiting until it is scheduled
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
