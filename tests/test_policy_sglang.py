"""SGLang's cache-aware policy, blind (``sglang``) and selective (``sglang-selective``): choices pinned."""

from __future__ import annotations

import pytest

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
