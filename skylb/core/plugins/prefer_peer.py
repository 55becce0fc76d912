"""Forwarding on the estimate (a then Rule of the default profile): a request goes to an available peer when that
peer's estimated wait (from its status), plus the measured round trip, plus the prefill of the part it is not
expected to hold (its region summary of KV-cache blocks, else the snapshot match), beats the local estimate
(estimated_ttft.py) by ``forward_margin_s``, even though a local replica has room. Both sides are priced at the
local replica's rate: pricing the local prefill at its measured rate (TTFT / prompt tokens, which holds each step's
fixed cost) and a peer's at the configured one sent short prompts abroad with every local queue empty (43% of
Arena's requests forwarded under symmetric load).

The local estimate is the cheapest of the local replicas with room, the pick among them (``against_cheapest``), not
the pick alone: past the load guard the picker takes the least loaded replica whatever its estimate, and one
holding a burst's other requests then looked slower than a peer although another local replica was as fast (a tree's
branches, sent together: 12-20% of closed-loop Tree of Thoughts' requests went abroad at 0.5x-2x, each paying a
round trip and prefilling its prefix again there; bench/results/forward_against.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.candidates import Candidates
from skylb.core.estimate import WaitModel, prompt_tokens
from skylb.core.plugins.estimated_ttft import EstimatedTTFT
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PreferFasterPeer"]


class PreferFasterPeer:
    """Rule: the peer with room that is cheapest by more than the margin, over the local estimate; else no opinion.

    Args:
        estimate: the local picker, whose ``local_costs`` prices the local pick and ``cheapest_s`` the cheapest
            local replica with room.
        locality: the tries and summaries (``peer_fractions``: a peer's region summary of KV-cache blocks, else
            the regional snapshot's match, prices its cached prefix).
        wait: the wait model (prefill seconds of tokens). forward_margin_s: the margin, s.
        default_prompt_tokens: the length assumed for each request forwarded to a peer since its status, tokens.
        against_cheapest: compare a peer with the cheaper of the pick and the cheapest local replica with room
            (module docstring); False: with the pick alone (the rule before).
    """

    def __init__(self, *, estimate: EstimatedTTFT, locality: PrefixLocality, wait: WaitModel,
                 forward_margin_s: float, default_prompt_tokens: int, against_cheapest: bool = True):
        self.estimate, self.locality, self.wait = estimate, locality, wait
        self.forward_margin_s, self.default_prompt_tokens = forward_margin_s, default_prompt_tokens
        self.against_cheapest = against_cheapest

    def decide(self, c: Candidates, picked: ReplicaState | None) -> PeerState | None:
        """The peer to forward ``c.request`` to instead of ``picked``, or None."""
        if not c.peers or picked is None:
            return None
        # cheapest_s first: it reads the pick's own pricing of c.local, which pricing the pick alone replaces
        cheapest = (self.estimate.cheapest_s(c.request, c.local) if self.against_cheapest and len(c.local) > 1
                    else float("inf"))
        if not self._may_beat(c.peers, cheapest - self.forward_margin_s):
            return None  # no peer beats the cheapest local replica: pricing the pick alone cannot change that
        local_s = min(cheapest, self.estimate.local_costs(c.request, [picked])[picked.id])
        return self.cheaper_peer(c, local_s, picked)

    @staticmethod
    def _may_beat(peers: Sequence[PeerState], best_s: float) -> bool:
        """Whether some peer's round trip plus wait is below ``best_s`` (s): its cost (``peer_cost_s``) is at least
        that, the prefill terms being never negative, so otherwise no peer can cost less than ``best_s``."""
        return not all(p.wait_s is None or p.rtt_s is None or p.rtt_s + p.wait_s >= best_s for p in peers)

    def cheaper_peer(self, c: Candidates, local_s: float, replica: ReplicaState, *,
                     holders_only: bool = False) -> PeerState | None:
        """The cheapest peer with room (``c.peers``) whose estimated seconds to first token (``peer_cost_s``,
        prefill priced at ``replica``'s rate) beat ``local_s`` (s) by ``forward_margin_s``; None when none does."""
        if not c.peers:
            return None
        best, best_s = None, local_s - self.forward_margin_s
        if not self._may_beat(c.peers, best_s):  # the usual case with room here: no peer's cached prefix looked up
            return None
        request = c.request
        held = self.locality.peer_fractions(request, c.peers)
        for p in sorted(c.peers, key=lambda p: p.region):
            if holders_only and p.region not in held:
                continue
            cost = self.peer_cost_s(request, p, held.get(p.region, 0.0), replica)
            if cost is not None and cost < best_s:
                best, best_s = p, cost
        return best

    def peer_cost_s(self, request: Request, peer: PeerState, ratio: float,
                    replica: ReplicaState | None = None) -> float | None:
        """Estimated seconds to ``request``'s first token through ``peer`` (its status's wait, the round trip, the
        requests forwarded there since that status spread over its available replicas, and the prefill of the
        part of the prompt it is not expected to hold (``ratio`` held: PrefixLocality.peer_fractions)); None when the peer gave no wait or
        its round trip is not measured yet. Prefill is priced at ``replica``'s measured rate when given (the local
        replica it is compared with: the same model, so the same rate there), else at the configured rate."""
        if peer.wait_s is None or peer.rtt_s is None:
            return None
        queued = peer.sent_since_probe * self.default_prompt_tokens / max(1, peer.available_replicas)
        return (peer.rtt_s + peer.wait_s + self.wait.prefill_s(queued, replica)
                + self.wait.prefill_s(prompt_tokens(request) * (1.0 - ratio), replica))
