"""The ideal prefix hit rate (bench/sim/ideal.py): an infinite prefix cache on one replica, a limit no policy passes."""

from __future__ import annotations

import pytest

from bench.sim.ideal import ideal_cached_tokens, ideal_hit_rate, replay_ideal_hit_rate
from bench.sim.scenarios import execute, runs_of
from bench.replay.workload import Request
from bench.emulator.model import EngineParams, make_engine

A = "a b c d e f g h".split()


@pytest.mark.parametrize("prompts, block, expected", [
    ([A, A], 2, [0, 6]),  # a repeat: every full block but the one holding the last token
    ([A, A + ["x", "y"]], 2, [0, 8]),  # an extension: all of the earlier prompt
    ([A, ["z"] + A], 2, [0, 0]),  # the same words shifted: a prefix cache reuses nothing
    ([A, A[:4] + ["q"] * 4], 2, [0, 4]),  # a shared first half
    ([A, A[:3] + ["q"] * 5], 2, [0, 2]),  # a partial block is not reused
    ([A, A[:3] + ["q"] * 5], 1, [0, 3]),  # ... but per token it is
    ([A[:4], A], 4, [0, 4]),  # the earlier prompt's last full block is cached although it held its last token
    ([["x"]], 1, [0]),  # a one-token prompt is always computed
], ids=["repeat", "extension", "shifted", "half", "partial-block", "per-token", "last-block-cached", "one-token"])
def test_ideal_cached_tokens(prompts, block, expected):
    """Each prompt's ideal hit is its longest run of leading full blocks seen before, at least the last token computed."""
    assert ideal_cached_tokens(prompts, block_tokens=block) == expected


def test_ideal_hit_rate_counts_only_flagged_prompts_but_caches_all():
    """Prompts outside the measured window still fill the cache; the rate is taken over the flagged ones only."""
    assert ideal_hit_rate([A, A], block_tokens=4) == pytest.approx(4 / 16)
    assert ideal_hit_rate([A, A], block_tokens=4, counted=[False, True]) == pytest.approx(4 / 8)
    assert ideal_hit_rate([], block_tokens=4) is None
    with pytest.raises(ValueError):
        ideal_cached_tokens([A], block_tokens=0)


def test_ideal_bounds_an_engine_that_sees_every_request():
    """One engine fed the same prompts one after another never caches more than the ideal at its block size."""
    prompts = [A * 5, A * 5 + ["x"] * 20, A * 3 + ["y"] * 30, A * 5 + ["x"] * 20 + ["z"] * 9]
    engine = make_engine(EngineParams())
    cached, now = [], 0.0
    for i, p in enumerate(prompts):
        cached.append(engine.cached_prefix_tokens(p))
        engine.submit(f"r{i}", p, 1, ignore_eos=True, now=now)
        while (step := engine.start_step(now)) is not None:
            engine.complete_step(step)
            now = step.end
    ideal = ideal_cached_tokens(prompts, block_tokens=EngineParams().block_size)
    assert all(c <= i for c, i in zip(cached, ideal)) and cached == ideal  # no eviction: the engine reaches it


@pytest.mark.parametrize("spec", [s for s in runs_of("smoke") if s.system in ("SkyLB", "CH", "Oracle")],
                         ids=lambda s: s.system)
def test_no_simulated_run_passes_its_ideal(spec):
    """Every simulated run reports an ideal hit rate of its own requests at or above the hit rate it reached."""
    r = execute(spec)
    assert 0.0 < r.hit_rate <= r.ideal_hit_rate <= 1.0


def test_replay_ideal_is_for_open_loop_replays_only():
    """A trace replay (no request waits for another) gets an ideal in arrival order; a closed-loop one gets None."""
    def req(rid, arrival, text, after=None):
        return Request(id=rid, arrival_s=arrival, region="us", session_id="s", prompt_tokens=len(text.split()),
                       output_tokens=1, after=after, text=text)
    later_first = [req("b", 1.0, "a b c d e"), req("a", 0.0, "a b c")]
    assert replay_ideal_hit_rate(later_first) == pytest.approx(3 / 8)  # all of "a b c", sent first
    assert replay_ideal_hit_rate([req("a", 0.0, "a b c"), req("b", 0.0, "a b c d", after="a")]) is None
    assert replay_ideal_hit_rate([]) is None


def test_a_bounded_cache_evicts_the_least_recently_used_block():
    """With room for 4 one-token blocks (each prompt stores 2), a prefix used again stays cached while one not used
    since is evicted; the bound is never above the infinite cache, and a capacity below 1 is an error."""
    a, b, c = ["a", "x"], ["b", "x"], ["c", "x"]
    prompts = [a, b, a, c, a, b]  # 'a' is reused each time, so 'b' is the least recently used when 'c' arrives
    assert ideal_cached_tokens(prompts, block_tokens=1) == [0, 0, 1, 0, 1, 1]
    assert ideal_cached_tokens(prompts, block_tokens=1, capacity_blocks=4) == [0, 0, 1, 0, 1, 0]
    assert ideal_hit_rate(prompts, block_tokens=1, capacity_blocks=4) < ideal_hit_rate(prompts, block_tokens=1)
    with pytest.raises(ValueError, match="capacity_blocks"):
        ideal_hit_rate(prompts, block_tokens=1, capacity_blocks=0)


def test_a_one_token_block_is_the_longest_prefix_shared_with_an_earlier_prompt():
    """At block 1 (SGLang's token-granular cache) each prompt's ideal hit is its longest common prefix with any
    earlier prompt, less the last token: checked against a brute-force comparison of every pair."""
    import random
    from bench.sim.ideal import ideal_cached_tokens
    rng = random.Random(1)
    prompts = [[rng.choice("abcd") for _ in range(rng.randint(1, 12))] for _ in range(300)]
    expected = []
    for i, p in enumerate(prompts):
        best = max((next((k for k, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                    for q in prompts[:i]), default=0)
        expected.append(min(best, len(p) - 1))
    assert ideal_cached_tokens(prompts, block_tokens=1) == expected
