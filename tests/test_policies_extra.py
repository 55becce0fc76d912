"""The baseline policies added for the simulated evaluation: sglang, sglang-selective and consistent_hash."""

from __future__ import annotations

import pytest

from skylb.core import AvailabilityRules, Request, Router, make_policy
from skylb.core.state import ReplicaState

PROMPT_A = "alpha " * 40  # 240 characters
PROMPT_B = "bravo " * 40


def _replicas(loads: dict[str, int]) -> list[ReplicaState]:
    return [ReplicaState(id=rid, url=f"sim://{rid}", healthy=True, probed_at=0.0, outstanding=n)
            for rid, n in loads.items()]


def _req(text: str, rid: str = "q", key: str | None = None) -> Request:
    return Request(id=rid, text=text, arrived_at=0.0, session_key=key)


def _sglang(history: list[tuple[str, str]], **options):
    """An sglang policy whose tree has seen ``history`` ((prompt, replica) pairs)."""
    policy = make_policy("sglang", trie_chunk_chars=8, **options)
    policy.set_members(["r1", "r2", "r3"], [])
    for i, (text, replica) in enumerate(history):
        policy.routed(_req(text, f"h{i}"), replica=replica)
    return policy


@pytest.mark.parametrize("case, history, loads, prompt, expected", [
    ("strong match routes to the matched replica",
     [(PROMPT_A, "r2")], {"r1": 0, "r2": 5, "r3": 0}, PROMPT_A + "tail", "r2"),
    ("several matched replicas: the least loaded of them",
     [(PROMPT_A, "r2"), (PROMPT_A, "r3")], {"r1": 0, "r2": 5, "r3": 3}, PROMPT_A, "r3"),
    ("weak match goes to the smallest tree",
     [(PROMPT_A, "r1"), (PROMPT_B, "r2")], {"r1": 0, "r2": 0, "r3": 9}, "zulu " * 40, "r3"),
    ("match below 0.3 of the prompt is weak",
     [(PROMPT_A[:40], "r1")], {"r1": 0, "r2": 0, "r3": 0}, PROMPT_A[:40] + "x" * 200, "r2"),
    ("imbalance (max - min > 64 and max > 1.5 min) routes by least load despite a match",
     [(PROMPT_A, "r1")], {"r1": 100, "r2": 20, "r3": 30}, PROMPT_A, "r2"),
    ("large but relatively balanced loads keep the prefix route",
     [(PROMPT_A, "r1")], {"r1": 150, "r2": 120, "r3": 110}, PROMPT_A, "r1"),
])
def test_sglang_cache_aware_choice(case, history, loads, prompt, expected):
    """SGLang's cache_aware rule: prefix match >= 0.3, else smallest tree; least load when imbalanced."""
    policy = _sglang(history)
    assert policy.pick_replica(_req(prompt), _replicas(loads)).id == expected, case


def test_sglang_tree_size_counts_only_new_characters():
    """A replica's tree grows by the characters of a prompt it did not already hold (SGLang tenant size)."""
    policy = _sglang([(PROMPT_A, "r1")])
    assert policy.tree_chars["r1"] == len(PROMPT_A)
    policy.routed(_req(PROMPT_A + "more text", "x"), replica="r1")
    assert policy.tree_chars["r1"] == len(PROMPT_A) + len("more text")
    assert policy.tree_chars["r2"] == 0


@pytest.mark.parametrize("name, selective", [
    ("sglang", False), ("sglang-selective", True), ("consistent_hash", False), ("skylb-ch", True),
])
def test_pushing_mode_of_each_policy(name, selective):
    """Blind policies take every healthy replica; selective ones only available replicas."""
    assert make_policy(name).selective is selective


@pytest.mark.parametrize("name, placed_on_busy", [
    ("sglang", True), ("consistent_hash", True), ("sglang-selective", False),
])
def test_router_respects_pushing_mode(name, placed_on_busy):
    """Through the Router: a blind policy places on a replica with pending requests, a selective one waits."""
    router = Router(region="us", policy=make_policy(name), rules=AvailabilityRules(max_dispatch_per_probe=0))
    router.set_replicas([("r1", "sim://r1", "vllm")])
    router.observe_replica("r1", now=0.0, healthy=True, pending=3)
    router.enqueue(_req(PROMPT_A, "a", key="user-1"))
    decisions = router.dispatch(0.01)
    assert (len(decisions) == 1) is placed_on_busy
    assert len(router.queue) == (0 if placed_on_busy else 1)


def test_consistent_hash_is_sticky_whatever_the_load():
    """Blind consistent hashing keeps a key on its owner even when that replica is the most loaded."""
    policy = make_policy("consistent_hash")
    policy.set_members(["r1", "r2", "r3"], [])
    owner = policy.pick_replica(_req("x", key="user-7"), _replicas({"r1": 0, "r2": 0, "r3": 0})).id
    loads = {r: (100 if r == owner else 0) for r in ("r1", "r2", "r3")}
    assert policy.pick_replica(_req("y", key="user-7"), _replicas(loads)).id == owner
