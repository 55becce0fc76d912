"""Helpers for the table-driven policy tests: build a policy, replay a history, ask for picks.

Each policy's table pins the choices it makes today, so moving or reshaping a policy cannot change a decision
unnoticed. A row gives the policy's options, what it saw before (``history``: (prompt, replica) pairs routed to
local replicas, or (prompt, region) pairs forwarded to peers), the candidates' outstanding requests, and the
requests asked about in order; the expected targets are the ones the policy picks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from skylb.core import Request, make_policy
from skylb.core.state import PeerState, ReplicaState

__all__ = ["replicas", "peers", "picks", "peer_picks"]


def replicas(loads: Mapping[str, int]) -> list[ReplicaState]:
    """Healthy, probed replica states with ``loads`` (id -> outstanding requests)."""
    return [ReplicaState(id=rid, url=f"sim://{rid}", healthy=True, probed_at=0.0, outstanding=n)
            for rid, n in loads.items()]


def peers(free: Mapping[str, int]) -> list[PeerState]:
    """Healthy peer states with ``free`` (region -> available replicas reported)."""
    return [PeerState(region=region, url=f"sim://{region}", healthy=True, probed_at=0.0, available_replicas=n,
                      replicas=4) for region, n in free.items()]


def _policy(name: str, options: Mapping, members: Sequence[str], peer_regions: Sequence[str],
            history: Sequence[tuple[str, str]], *, to_peers: bool):
    policy = make_policy(name, **options)
    policy.set_members(list(members), list(peer_regions))
    for i, (text, target) in enumerate(history):
        r = Request(id=f"h{i}", text=text, arrived_at=0.0)
        policy.routed(r, **({"peer": target} if to_peers else {"replica": target}))
    return policy


def picks(name: str, options: Mapping, history: Sequence[tuple[str, str]], loads: Mapping[str, int],
          asks: Sequence[tuple[str, str | None]], *, learn: bool = True) -> list[str]:
    """The replicas ``name`` picks for ``asks`` ((prompt, session key) pairs) in order, learning from each pick
    when ``learn`` (as the router does), with the candidates' loads fixed at ``loads``."""
    policy = _policy(name, options, list(loads), [], history, to_peers=False)
    out = []
    for i, (text, key) in enumerate(asks):
        request = Request(id=f"q{i}", text=text, arrived_at=0.0, session_key=key)
        chosen = policy.local.pick(request, replicas(loads)).id
        if learn:
            policy.routed(request, replica=chosen)
        out.append(chosen)
    return out


def peer_picks(name: str, options: Mapping, history: Sequence[tuple[str, str]], free: Mapping[str, int],
               asks: Sequence[tuple[str, str | None]]) -> list[str]:
    """The peer regions ``name`` picks for ``asks`` in order (learning from each), peers reporting ``free``."""
    policy = _policy(name, options, [], list(free), history, to_peers=True)
    out = []
    for i, (text, key) in enumerate(asks):
        request = Request(id=f"q{i}", text=text, arrived_at=0.0, session_key=key)
        chosen = policy.peer.pick(request, peers(free)).region
        policy.routed(request, peer=chosen)
        out.append(chosen)
    return out
