"""The routing core: pure (no I/O, no clock reads), shared by the live balancer and the simulator.

Source: SkyLB paper §3 and Algorithm 1. ``build_router`` (builder.py) is the one way from settings to a Router.

The names below load their module on first use (PEP 562 module ``__getattr__``), so a program that needs only the
core's vocabulary (``skylb.core.request``'s priority classes, as `skylb-ctl` does) does not load the policies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylb.core.builder import RouterSettings, build_policy, build_router, build_rules
    from skylb.core.hash_ring import HashRing
    from skylb.core.policies import POLICIES, PolicyError, make_policy, policy_names, policy_options
    from skylb.core.profile import Profile
    from skylb.core.prefix_trie import Match, PrefixTrie, chunk_text
    from skylb.core.request import Request
    from skylb.core.router import Decision, QueueFull, Router
    from skylb.core.state import AvailabilityRules, PeerState, PeerStatus, ReplicaState

#: Exported name -> the module of the core that defines it.
_HOMES = {
    **dict.fromkeys(["RouterSettings", "build_policy", "build_router", "build_rules"], "builder"),
    "HashRing": "hash_ring",
    **dict.fromkeys(["POLICIES", "PolicyError", "make_policy", "policy_names", "policy_options"], "policies"),
    "Profile": "profile",
    **dict.fromkeys(["Match", "PrefixTrie", "chunk_text"], "prefix_trie"),
    "Request": "request",
    **dict.fromkeys(["Decision", "QueueFull", "Router"], "router"),
    **dict.fromkeys(["AvailabilityRules", "PeerState", "PeerStatus", "ReplicaState"], "state"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """``skylb.core.NAME``: the exported object, its module imported now; AttributeError for any other name."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
