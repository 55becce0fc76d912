"""Most room: the peer region with the most available replicas left after its queue and what this balancer sent
since its status (the paper's peer choice without prefix affinity)."""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.plugins.scoring import most_room
from skylb.core.request import Request
from skylb.core.state import PeerState

__all__ = ["MostRoom"]


class MostRoom:
    """PeerPicker: scoring.most_room (then fewest in flight there, then region name)."""

    def pick(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """The peer of ``candidates`` (non-empty) with the most room."""
        return most_room(candidates)
