"""The ``round-robin`` baseline (blind pushing): its choices pinned in a table."""

from __future__ import annotations

from tests.policy_table import peer_picks, picks


def test_round_robin_rotates_over_sorted_ids_whatever_the_load():
    """Replicas in id order, one after another, loads ignored."""
    assert picks("round-robin", {}, [], {"r2": 5, "r1": 0, "r3": 1}, [("a", None)] * 5) == [
        "r1", "r2", "r3", "r1", "r2"]


def test_default_peer_choice_is_the_peer_with_most_room():
    """A policy without a peer rule of its own forwards to the peer reporting the most available replicas."""
    assert peer_picks("round-robin", {}, [], {"eu": 1, "asia": 3}, [("x", None)]) == ["asia"]
