"""The candidates of one placement, after the router's filters: what a policy chooses among.

The filters (the Gateway API inference extension's endpoint picker shape: filter -> score -> pick) are the router's:
serves the request's model and dialect, healthy and fresh, not drained, not ejected by outlier detection, the Ollama
fleet rules, the retry's exclusions, the one-hop rule for forwarded requests, and room (selective pushing); peers
with room are only the siblings (balancers of this region) when a sibling has room, so overflow stays in the
region, at a local round trip, before it crosses to another. What is
filtered out for want of room only is kept apart (``busy``, ``reachable``), computed on first use, so a policy that
prices a push into a full batch or a forward to a peer with a queue can see it and one that does not pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["Candidates"]


@dataclass
class Candidates:
    """One request's candidates at one moment.

    Attributes:
        request: the request; now: the decision's time, s.
        local: local replicas that may take it now (with room under selective pushing, usable under blind).
        peers: peers available for it now (empty for a request that was itself forwarded).
        queued: requests in this balancer's queue, this one included.
        replicas: how many local replicas exist (draining ones included).
        dispatch_rate: requests this balancer placed per second lately (None before two placements).
        rule: set by ``Profile.choose``: the name of the plugin that placed the request or held it (None: none did).
    """

    request: Request
    now: float
    local: list[ReplicaState]
    peers: list[PeerState]
    queued: int
    replicas: int
    dispatch_rate: float | None = None
    rule: str | None = None
    _busy: Callable[[], list[ReplicaState]] = field(repr=False, default=list)
    _reachable: Callable[[], list[PeerState]] = field(repr=False, default=list)
    _cache: dict = field(repr=False, default_factory=dict)

    @property
    def busy(self) -> list[ReplicaState]:
        """Usable local replicas serving the request's model that are not in ``local`` (full now)."""
        if "busy" not in self._cache:
            self._cache["busy"] = self._busy()
        return self._cache["busy"]

    @property
    def reachable(self) -> list[PeerState]:
        """Peers reachable and not ejected that serve the request's model, room or not (empty for a request that
        was itself forwarded)."""
        if "reachable" not in self._cache:
            self._cache["reachable"] = self._reachable()
        return self._cache["reachable"]
