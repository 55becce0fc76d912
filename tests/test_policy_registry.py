"""The policy registry: names, pushing modes, typed options that reject what a policy does not declare."""

from __future__ import annotations

import pytest

from skylb.config import BalancerConfig
from skylb.core import AvailabilityRules, PolicyError, Request, Router, make_policy, policy_names
from skylb.core.policies import POLICIES

PROMPT_A = "alpha " * 40


def _req(text: str, rid: str = "q", key: str | None = None) -> Request:
    return Request(id=rid, text=text, arrived_at=0.0, session_key=key)


@pytest.mark.parametrize("name, selective", [
    ("sglang", False), ("sglang-selective", True), ("consistent-hash", False), ("skylb-ch", True),
])
def test_pushing_mode_of_each_policy(name, selective):
    """Blind policies take every healthy replica; selective ones only available replicas."""
    assert make_policy(name).selective is selective


@pytest.mark.parametrize("name, placed_on_busy", [
    ("sglang", True), ("consistent-hash", True), ("sglang-selective", False),
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


def test_policy_names_have_one_spelling():
    """Every registered name is lower case with words joined by '-' (no '_')."""
    assert policy_names() == sorted(POLICIES)
    assert all(n == n.lower() and "_" not in n for n in policy_names())
    assert {"skylb", "skylb-ch", "round-robin", "least-load", "consistent-hash", "sglang",
            "sglang-selective"} <= set(policy_names())


@pytest.mark.parametrize("name, options, message", [
    ("skylb", {"match_treshold": 0.2}, "match_treshold"),
    ("skylb", {"match_threshold": 2}, "match_threshold"),
    ("skylb-ch", {"trie_chunk_chars": 64}, "trie_chunk_chars"),
    ("round-robin", {"anything": 1}, "anything"),
    ("random", {}, "known: consistent-hash"),
])
def test_make_policy_rejects_what_the_policy_does_not_declare(name, options, message):
    """A misspelt, out-of-range or foreign option, or an unknown name, is a PolicyError naming it."""
    with pytest.raises(PolicyError, match=message):
        make_policy(name, **options)


def test_config_validates_policy_name_and_each_policys_options():
    """The balancer config accepts registered names and per-policy options, and rejects the rest at load."""
    cfg = BalancerConfig(policy="sglang", policies={"skylb": {"match_threshold": 0.4}, "sglang": {}})
    assert cfg.policy == "sglang"
    with pytest.raises(ValueError, match="unknown policy 'round_robin'"):
        BalancerConfig(policy="round_robin")
    with pytest.raises(ValueError, match="trie_chunk_chars"):
        BalancerConfig(policies={"skylb-ch": {"trie_chunk_chars": 64}})


def test_options_are_typed_and_kept_on_the_policy():
    """A policy keeps the validated options it was built with (what build_router compares)."""
    policy = make_policy("skylb", match_threshold=0.25)
    assert policy.options.match_threshold == 0.25 and policy.options.trie_chunk_chars == 256
    assert make_policy("skylb").options == make_policy("skylb").options
