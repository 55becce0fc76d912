"""The ``skylb-paper`` policy (prefix trie + selective pushing): its choices pinned in a table. ``skylb`` must make
the same choices while no replica has a prefill backlog (tests/test_policy_skylb.py covers the rest)."""

from __future__ import annotations

import pytest

from tests.policy_table import peer_picks, picks

A, B, C = "alpha " * 200, "bravo " * 200, "charlie " * 150  # 1,200 characters: several trie chunks

CASES = [
    ("strong match goes to the replica that holds the prefix",
     {}, [(A, "r2")], {"r1": 0, "r2": 0, "r3": 0}, [(A + "tail", None)], ["r2"]),
    ("weak match (below match_threshold) goes to the least loaded",
     {}, [(A[:300], "r2")], {"r1": 0, "r2": 1, "r3": 2}, [(A[:300] + "z" * 1500, None)], ["r1"]),
    ("a lower match_threshold routes the same partial match by prefix",
     {"match_threshold": 0.1}, [(A[:300], "r2")], {"r1": 0, "r2": 1, "r3": 2}, [(A[:300] + "z" * 1500, None)],
     ["r2"]),
    ("no match: least loaded, ties rotate",
     {}, [], {"r1": 0, "r2": 0, "r3": 0}, [(A, None), (B, None), (C, None), ("d" * 1200, None)],
     ["r1", "r2", "r3", "r1"]),
    ("several matched replicas: the least loaded of them",
     {}, [(A, "r1"), (A, "r3")], {"r1": 3, "r2": 0, "r3": 1}, [(A, None)], ["r3"]),
    ("imbalanced loads (max - min > 32) beat the match",
     {"balance_abs_threshold": 32}, [(A, "r1")], {"r1": 40, "r2": 2, "r3": 5}, [(A, None)], ["r2"]),
    ("loads imbalanced past SGLang's 64 and 1.5x beat the match (skylb's own guard of a cache hit too)",
     {}, [(A, "r1")], {"r1": 80, "r2": 2, "r3": 5}, [(A, None)], ["r2"]),
    ("loads within the guard keep the match",
     {"balance_abs_threshold": 32}, [(A, "r1")], {"r1": 30, "r2": 2, "r3": 5}, [(A, None)], ["r1"]),
    ("follow-up turns stick to the first turn's replica",
     {}, [], {"r1": 0, "r2": 0}, [(A, None), (A + "turn 2", None), (A + "turn 2 turn 3", None)],
     ["r1", "r1", "r1"]),
]


@pytest.mark.parametrize("name", ["skylb-paper", "skylb"])
@pytest.mark.parametrize("case, options, history, loads, asks, expected", CASES, ids=[c[0] for c in CASES])
def test_prefix_policy_picks(name, case, options, history, loads, asks, expected):
    """Longest prefix match among available replicas, least load below the threshold or when imbalanced. The table
    pins the paper's guard, of every request; skylb's own guard of a cache hit (``cache_hit_guard``, which keeps a hit
    on its holder up to SGLang's thresholds) is pinned in tests/test_policy_skylb.py, so it is set to the paper's
    ("balance") here except in the case past both guards; skylb's pricing of generation stalls is off here
    (``stall_weight``, tests/test_plugins.py: a 17% match no longer outweighs stalling a replica's decode)."""
    if name == "skylb" and "balance_abs_threshold" in options:
        options = {**options, "cache_hit_guard": "balance"}
    if name == "skylb":
        options = {**options, "stall_weight": 0.0}
    assert picks(name, options, history, loads, asks) == expected


@pytest.mark.parametrize("name", ["skylb-paper", "skylb"])
def test_prefix_policy_forwards_by_the_regional_snapshot(name):
    """A prompt extending one forwarded before goes to that peer; others go to the peer with most room."""
    assert peer_picks(name, {}, [(A, "asia")], {"eu": 1, "asia": 1},
                      [(A + "x", None), (B, None), (B + "y", None)]) == ["asia", "eu", "eu"]
