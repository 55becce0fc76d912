"""The hash-ring policies, ``skylb-ch`` (selective) and ``consistent-hash`` (blind): choices pinned in a table."""

from __future__ import annotations

import pytest

from skylb.core import Request, make_policy
from tests.policy_table import peer_picks, picks, replicas

A, B = "alpha " * 200, "bravo " * 200
FOUR = {"r1": 0, "r2": 0, "r3": 0, "r4": 0}

CASES = [
    ("skylb-ch", "a session key maps to one replica",
     FOUR, [("x", "alice"), ("y", "alice"), ("z", "bob"), ("w", "carol"), ("v", "dave")],
     ["r2", "r2", "r1", "r1", "r4"]),
    ("skylb-ch", "without a key the prompt's first characters are the key",
     FOUR, [(A + "one", None), (A + "two", None), (B, None)], ["r3", "r3", "r2"]),
    ("skylb-ch", "load does not move a key", {"r1": 9, "r2": 0, "r3": 0, "r4": 0},
     [("x", "alice"), ("y", "erin")], ["r2", "r2"]),
    ("consistent-hash", "a key stays on its owner whatever the load", {"r1": 50, "r2": 0, "r3": 0},
     [("x", "alice"), ("x", "bob"), ("x", "carol")], ["r2", "r1", "r1"]),
]


@pytest.mark.parametrize("name, case, loads, asks, expected", CASES, ids=[c[1] for c in CASES])
def test_hash_ring_policy_picks(name, case, loads, asks, expected):
    """The ring owner of the session key (or the prompt's start) among the candidates."""
    assert picks(name, {}, [], loads, asks) == expected


def test_hash_ring_policy_forwards_by_the_peer_ring():
    """Peers are chosen on a ring of regions by the same key."""
    assert peer_picks("skylb-ch", {}, [], {"eu": 1, "asia": 1},
                      [("x", "alice"), ("y", "alice"), ("z", "bob"), ("w", "carol")]) == ["eu", "eu", "asia", "asia"]


def test_consistent_hash_is_sticky_whatever_the_load():
    """Blind consistent hashing keeps a key on its owner even when that replica is the most loaded."""
    policy = make_policy("consistent-hash")
    policy.set_members(["r1", "r2", "r3"], [])
    owner = policy.local.pick(Request("a", "x", arrived_at=0.0, session_key="user-7"), replicas({"r1": 0, "r2": 0, "r3": 0})).id
    loads = {r: (100 if r == owner else 0) for r in ("r1", "r2", "r3")}
    assert policy.local.pick(Request("b", "y", arrived_at=0.0, session_key="user-7"), replicas(loads)).id == owner
