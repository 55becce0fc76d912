"""Placement by one cost (a first Rule, the default profile with ``placement: predicted-ttft``): every candidate (a
local replica with room, a push into a full batch, a peer, holding here) priced by its predicted time to first token
(skylb/core/predicted_ttft.py, skylb/core/cost.py); the cheapest wins.

The load guard: the cost is the time to first token, which does not see that a larger batch decodes slower for
everyone in it, so with local outstanding requests imbalanced at ``abs_threshold`` / ``rel_threshold`` only the least
loaded local replica is priced. A local choice may still be held for a faster busy replica (hold_for_faster.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.candidates import Candidates
from skylb.core.plugins.hold_for_faster import HoldForFaster
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.scoring import least_loaded, loads_imbalanced
from skylb.core.predicted_ttft import PredictedTTFT
from skylb.core.profile import HOLD, Turns
from skylb.core.state import ReplicaState

__all__ = ["PredictedTTFTPlacement"]


class PredictedTTFTPlacement:
    """Rule and Learner: the cheapest candidate by predicted TTFT (always a verdict: a target or HOLD).

    Args:
        ttft: the prices and what they learn from. locality: the tries (cached prefixes). turns: shared turns.
        hold: the hold-for-faster rule, or None. abs_threshold (0: no guard), rel_threshold: the load guard.
        default_prompt_tokens: the length assumed for a request forwarded to a peer since its status, tokens.
    """

    def __init__(self, *, ttft: PredictedTTFT, locality: PrefixLocality, turns: Turns, hold: HoldForFaster | None,
                 abs_threshold: int, rel_threshold: float, default_prompt_tokens: int):
        self.ttft, self.locality, self.turns, self.hold = ttft, locality, turns, hold
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.default_prompt_tokens = default_prompt_tokens
        self._replicas: set[str] = set()

    def decide(self, c: Candidates, picked: ReplicaState | None):
        """The cheapest target for ``c.request``, or HOLD."""
        request, loc = c.request, self.locality
        kind, target = self.ttft.choose(
            c, match=lambda ids: loc.replica_match(request, ids),
            peer_fractions=lambda peers: loc.peer_fractions(request, peers),
            threshold=loc.threshold, default_prompt_tokens=self.default_prompt_tokens, guard=self._guard)
        if (kind == "local" and self.hold is not None and len(c.local) < c.replicas and c.busy
                and self.hold.holds(request, target, c.busy, c.queued)):
            return HOLD
        if kind in ("local", "push"):
            self.ttft.dispatched(request, target)  # recorded only once it is sent: a held request leaves nothing
        return HOLD if target is None else target

    def _guard(self, local: Sequence[ReplicaState]) -> ReplicaState | None:
        """The least loaded of ``local`` when their loads are imbalanced, else None (0: never)."""
        if self.abs_threshold and loads_imbalanced(local, self.abs_threshold, self.rel_threshold):
            return least_loaded(local, self.turns.next())
        return None

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """Forget the fits of replicas that left."""
        for gone in self._replicas - replicas:
            self.ttft.forget(gone)
        self._replicas = set(replicas)
