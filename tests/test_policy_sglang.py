"""SGLang's cache-aware policy, blind (``sglang``) and selective (``sglang-selective``): choices pinned."""

from __future__ import annotations

import pytest

from skylb.core import Request, make_policy
from skylb.core.state import ReplicaState
from tests.policy_table import picks

A, B, C = "alpha " * 200, "bravo " * 200, "charlie " * 150

CASES = [
    ("strong match routes to the matched replica", {"trie_chunk_chars": 8},
     [(A, "r2")], {"r1": 0, "r2": 5, "r3": 0}, [(A + "tail", None)], ["r2"]),
    ("weak match goes to the smallest tree", {"trie_chunk_chars": 8},
     [(A, "r1"), (B, "r2")], {"r1": 0, "r2": 0, "r3": 9}, [("zulu " * 40, None)], ["r3"]),
    ("imbalance routes by least load", {"trie_chunk_chars": 8},
     [(A, "r1")], {"r1": 100, "r2": 20, "r3": 30}, [(A, None)], ["r2"]),
    ("new prompts fill the smallest trees in turn", {},
     [], {"r1": 0, "r2": 0, "r3": 0}, [(A, None), (B, None), (C, None), ("delta " * 30, None)],
     ["r1", "r2", "r3", "r1"]),
]


@pytest.mark.parametrize("name", ["sglang", "sglang-selective"])
@pytest.mark.parametrize("case, options, history, loads, asks, expected", CASES, ids=[c[0] for c in CASES])
def test_sglang_policy_picks(name, case, options, history, loads, asks, expected):
    """Both SGLang variants choose alike among the candidates they are offered."""
    assert picks(name, options, history, loads, asks) == expected


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
    assert policy.local.pick(_req(prompt), _replicas(loads)).id == expected, case


def test_sglang_tree_size_counts_only_new_characters():
    """A replica's tree grows by the characters of a prompt it did not already hold (SGLang tenant size)."""
    policy = _sglang([(PROMPT_A, "r1")])
    assert policy.local.tree_chars["r1"] == len(PROMPT_A)
    policy.routed(_req(PROMPT_A + "more text", "x"), replica="r1")
    assert policy.local.tree_chars["r1"] == len(PROMPT_A) + len("more text")
    assert policy.local.tree_chars["r2"] == 0


@pytest.mark.parametrize("lookahead, expected", [(64, ["q1", "q0"]), (0, ["q0", "q1"])])
def test_sglang_selective_queue_looks_ahead_for_a_cached_prefix(lookahead, expected):
    """SP-P's queue: when r0 frees up, the queued request whose prefix r0 holds goes before a head with no match
    there (``queue_lookahead`` 0: first come, first served, the paper's SP-P)."""
    from skylb.core import AvailabilityRules, Router

    router = Router(region="us", policy=make_policy("sglang-selective", queue_lookahead=lookahead),
                    rules=AvailabilityRules(max_dispatch_per_probe=1))
    router.set_replicas([("r0", "http://r0", "vllm"), ("r1", "http://r1", "vllm")])
    for rid in ("r0", "r1"):
        router.observe_replica(rid, now=0.0, healthy=True, pending=2)
    cached = "bravo " * 100
    router.policy.routed(Request("before", cached, 0.0), replica="r0")
    router.enqueue(Request("q0", "alpha " * 100, arrived_at=1.0))
    router.enqueue(Request("q1", cached + "next turn", arrived_at=2.0))
    got = []
    for t in (3.0, 4.0):
        router.observe_replica("r0", now=t, healthy=True, pending=0)
        got += [d.request.id for d in router.dispatch(t)]
    assert got == expected
