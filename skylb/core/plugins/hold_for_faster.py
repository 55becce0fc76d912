"""Waiting for a faster replica (a then Rule of the default profile).

On mixed hardware, a request the only replica with room would finish later than a busy, faster replica would finish
the whole queue (this request included) waits here for the faster one: with n queued requests, a replica with room
takes the head only if its service time for it (measured time per token, OllamaRouter's W^ without a queue) is
below the faster one's backlog plus n of its service times. This is OllamaRouter's choice (a slow host gets a
request once the fast one's queue is long enough, its Algorithm 1) made with the requests held here instead of
pushed into the engines' queues: on one host 4x slower than the other, selective pushing alone gave the slow host
every request that arrived while the fast one was busy, and the last of them finished long after the fast host
would have.
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.candidates import Candidates
from skylb.core.profile import HOLD
from skylb.core.rates import ModelRates, RateBook, request_chars
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["HoldForFaster", "faster"]


class HoldForFaster:
    """Rule: HOLD when a busy replica at least ``ratio`` x faster (``faster``) would finish the queue sooner than
    the picked replica would finish this request; else no opinion. ``rates``: the profile's RateBook."""

    def __init__(self, rates: RateBook, ratio: float):
        self.rates, self.ratio = rates, ratio

    def decide(self, c: Candidates, picked: ReplicaState | None):
        """HOLD or None for ``c.request`` and the local pick ``picked``."""
        # Cheapest tests first: the full replicas are listed only for a measured pick (``holds`` needs one).
        if (picked is not None and len(c.local) < c.replicas and picked.rates.for_model(c.request.model) is not None
                and c.busy and self.holds(c.request, picked, c.busy, c.queued)):
            return HOLD
        return None

    def holds(self, request: Request, replica: ReplicaState, busy: Sequence[ReplicaState], queued: int) -> bool:
        """True when a measured replica of ``busy`` at least ``ratio`` x faster than ``replica`` would finish its
        backlog plus ``queued`` requests of this one's size before ``replica`` finished this one."""
        model = request.model
        mine = replica.rates.for_model(model)
        if mine is None:
            return False
        tokens = request_chars(request) * self.rates.token_factor
        own_s = tokens * mine.time_per_token_s
        for other in busy:
            theirs = other.rates.for_model(model)
            if theirs is None or not faster(theirs, mine, self.ratio):
                continue
            backlog_s = self.rates.queue_wait_s(other.rates, model) or 0.0
            if own_s > backlog_s + queued * tokens * theirs.time_per_token_s:
                return True
        return False


def faster(theirs: ModelRates, mine: ModelRates, ratio: float) -> bool:
    """True when rates ``theirs`` are at least ``ratio`` x faster than ``mine`` (skylb/core/rates.py ModelRates):
    in time per token (prompt and output together), and in decode time per output token, which both must have
    measured. The first alone follows the mix of requests each replica happened to serve (a long prompt makes a
    replica look fast per token, a long answer slow): identical replicas serving the conversation trace at real
    prompt lengths differed by more than 1.5x, and requests waited for the "faster" one while a replica had room
    (simulated, P90 TTFT 26.4 s against 17.9 s without holding). Decode per output token does not depend on the
    mix. Without it on both sides nothing is held: at prompts x1/8 an OpenAI engine's decode is measured only from
    a response that ran alone, rare under load, and identical replicas judged by time per token alone held requests
    for seconds with every replica free (the trace at half its rate: P90 TTFT 2.9 s, 1.9 s without holding)."""
    if theirs.time_per_token_s * ratio > mine.time_per_token_s:
        return False
    if theirs.decode_s_per_token is None or mine.decode_s_per_token is None:
        return False
    return theirs.decode_s_per_token * ratio <= mine.decode_s_per_token
