"""Placement by one cost: the predicted time to first token of every candidate (skylb/core/cost.py), a rule of the
default policy (``skylb`` with ``placement: predicted-ttft``; not its default yet, README "Predicted-TTFT placement").

Candidates, from the router's filters (skylb/core/candidates.py): local replicas with room, local replicas whose
batch is full (a push into the engine's waiting queue), peers (with room or with a queue), and, when no local replica
has room, holding the request in this balancer's queue. Each is priced in seconds by skylb/core/cost.py; the
cheapest wins, ties going to (in order) a local replica with room, holding, a push into a full batch, a peer. A push
or a peer with room must beat the best so far by ``forward_margin_ms``, a peer without room by
``queue_forward_margin_ms`` (the prediction's error is not free: a forwarded request pays its round trip for certain,
a pushed one loses the choice of the replica that frees first, and under saturation every region's queue looks
alike). With outstanding requests imbalanced (the guard the caller passes), only the least loaded local replica is
priced.

What the prices learn from (every response, not only lone ones): each replica's prefill line (fixed + per token,
skylb/core/prefill_model.py) from its responses' TTFT against the tokens it had to prefill up to theirs, for the
responses that found room when they were sent (one pushed into a full batch also waited for a slot); each replica's
mean service time from the responses' end-to-end times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from skylb.core.candidates import Candidates
from skylb.core.cost import ServiceTimes, peer_ttft_s, slot_wait_s
from skylb.core.estimate import WaitModel, prompt_tokens
from skylb.core.prefill_model import PrefillBook, PrefillLine
from skylb.core.prefix_trie import Match
from skylb.core.rates import RateBook, ReplicaRates, Usage
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PredictedTTFT", "LearningRateBook", "replica_class"]


def replica_class(replica: ReplicaState) -> tuple:
    """A replica's class for pooling its prefill fit: its engine and the models it serves."""
    return replica.engine, replica.models


class PredictedTTFT:
    """The prices and what they learn from, for one balancer.

    Args:
        wait: the backlog model (prompt tokens queued ahead on a replica; skylb/core/estimate.py).
        prior: the configured prefill line every replica class starts from.
        forward_margin_s: how much a peer or a push into a full batch must beat the alternatives by, s.
        learn_capacity: whether the batch limit is the learned admission capacity (AvailabilityRules).
        queue_margin_s: how much a peer with no room must beat the alternatives by, s.
        kv_high_watermark: KV usage at which a push counts as waiting for a request to finish (1: never).
    """

    def __init__(self, *, wait: WaitModel, prior: PrefillLine, forward_margin_s: float, learn_capacity: bool = True,
                 kv_high_watermark: float = 1.0, queue_margin_s: float = 2.0):
        self.wait = wait
        self.queue_margin_s = queue_margin_s
        self.kv_high_watermark = kv_high_watermark
        self.prefill = PrefillBook(prior)
        self.service = ServiceTimes()
        self.forward_margin_s = forward_margin_s
        self.learn_capacity = learn_capacity
        #: request id -> (replica id, class, backlog tokens ahead, uncached tokens expected, had room) at dispatch.
        self._flights: dict[str, tuple[str, tuple, float, float, bool]] = {}
        #: The latest choice's (request id, uncached tokens at the chosen replica, had room), for ``dispatched``.
        self._last: tuple[str, float, bool] = ("", 0.0, False)

    # -- prices ---------------------------------------------------------------------------------------------------
    def line(self, replica: ReplicaState) -> PrefillLine:
        """``replica``'s fitted prefill line."""
        return self.prefill.line(replica.id, replica_class(replica))

    def local_s(self, replica: ReplicaState, uncached: float) -> float:
        """Predicted TTFT on local ``replica`` if it had room now, s."""
        return self.line(replica).seconds(self.wait.backlog_tokens(replica) + uncached)

    def slot_wait_s(self, replica: ReplicaState) -> float:
        """Seconds until ``replica``'s full batch frees a place for one more request (0 with room); a replica whose
        KV cache is at the high watermark waits at least for one request to finish (a push would be preempted)."""
        service = self.service.seconds(replica.id)
        wait = slot_wait_s(replica, service, self.learn_capacity)
        if replica.kv_usage is not None and self.kv_high_watermark < 1 and replica.kv_usage >= self.kv_high_watermark:
            wait = max(wait, service / max(1, replica.outstanding or 1))
        return wait

    def choose(self, c: Candidates, match: Callable[[Sequence[str]], Match],
               peer_fractions: Callable[[Sequence[PeerState]], dict[str, float]],
               threshold: float, default_prompt_tokens: int,
               guard: Callable[[Sequence[ReplicaState]], ReplicaState | None] | None = None,
               ) -> tuple[str, ReplicaState | PeerState | None]:
        """The cheapest candidate of ``c``: ("local", replica), ("push", replica), ("peer", peer) or ("hold",
        None). ``match(ids)``: the replica trie's match of the request among replica ids, a match below
        ``threshold`` of the prompt counting as none; ``peer_fractions(peers)``: {region: fraction of the prompt
        cached there} for the peers that hold any (PrefixLocality.peer_fractions: the region summaries of
        KV-cache blocks, else the regional snapshot)."""
        request = c.request
        tokens = prompt_tokens(request)
        busy = c.busy
        m = match([r.id for r in (*c.local, *busy)])
        hit = m.targets if m.targets and m.ratio >= threshold else frozenset()

        def uncached(rid: str) -> float:
            return tokens * (1.0 - m.ratio) if rid in hit else tokens

        best_kind, best_target, best_s = "hold", None, float("inf")
        # The load guard: TTFT alone does not see that a larger batch decodes slower for everyone in it, so a
        # replica holding popular prefixes would take ever more; with outstanding requests imbalanced, only the
        # least loaded local replica is priced (and pushes beside it are not).
        pick = guard(c.local) if guard is not None and len(c.local) > 1 else None
        if pick is not None:
            busy = []
        for r in ([pick] if pick is not None else c.local):
            s = self.local_s(r, uncached(r.id))
            if s < best_s - 1e-9:
                best_kind, best_target, best_s = "local", r, s
        margin = self.forward_margin_s
        if busy:
            first = min(busy, key=lambda r: (self.slot_wait_s(r), r.id))
            # Held, the request goes when the next place frees here: priced as a peer's queue is (its turn at
            # this balancer's dispatch rate), so holding and forwarding are weighed on one scale.
            turn_s = 1.0 / c.dispatch_rate if c.dispatch_rate else self.slot_wait_s(first)
            hold_s = turn_s + self.local_s(first, uncached(first.id))
            if not c.local:
                best_kind, best_target, best_s = "hold", None, hold_s
            for r in busy:
                # A request whose prefix the replica holds adds only its uncached tokens to the KV cache: where the
                # engine reports KV room and queues nothing, the batch's request count does not bound it (shared
                # blocks), so it is admitted at its next step.
                kv_room = (r.id in hit and r.pending == 0 and r.kv_usage is not None
                           and r.kv_usage < self.kv_high_watermark)
                s = (0.0 if kv_room else self.slot_wait_s(r)) + self.local_s(r, uncached(r.id))
                if s + margin < best_s:
                    best_kind, best_target, best_s = "push", r, s + margin
        peers = c.reachable if request.may_forward else []
        if peers:
            held = peer_fractions(peers)
            age = c.now - request.queued_since
            fallback = self.line(c.local[0]) if c.local else (self.line(busy[0]) if busy else self.prefill.prior)
            for p in sorted(peers, key=lambda p: p.region):
                un = tokens * (1.0 - held.get(p.region, 0.0))
                s = peer_ttft_s(p, uncached_tokens=un, age_s=age, default_prompt_tokens=default_prompt_tokens,
                                fallback=fallback)
                # A peer without room only takes a request whose turn comes sooner there by a wider margin: under
                # saturation every region's queue looks alike and forwarding would only move requests around.
                m_s = margin if p.available_replicas > p.sent_since_probe and p.queue_len == 0 else self.queue_margin_s
                if s is not None and s + m_s < best_s:
                    best_kind, best_target, best_s = "peer", p, s + m_s
        self._last = (request.id, uncached(best_target.id) if best_kind in ("local", "push") else 0.0,
                      best_kind == "local")
        return best_kind, best_target

    def dispatched(self, request: Request, replica: ReplicaState) -> None:
        """``request`` goes to local ``replica`` as ``choose`` just chose: note what the fit will learn from (the
        backlog ahead, its expected uncached tokens, whether it found room)."""
        rid, uncached, had_room = self._last if self._last[0] == request.id else (request.id, 0.0, False)
        self._flights[request.id] = (replica.id, replica_class(replica), self.wait.backlog_tokens(replica), uncached,
                                     had_room)

    # -- status ---------------------------------------------------------------------------------------------------
    def advertised(self, available: Sequence[ReplicaState], replicas: Sequence[ReplicaState]) -> dict:
        """The PeerStatus fields that let a peer price this balancer (tokens and its fitted line, ms)."""
        pool = available or replicas
        if not pool:
            return {}
        best = min(pool, key=lambda r: self.wait.backlog_tokens(r))
        line = self.prefill.class_line(replica_class(best))
        return {"backlog_tokens": round(self.wait.backlog_tokens(best), 1),
                "prefill_fixed_ms": round(line.fixed_s * 1e3, 4),
                "prefill_ms_per_token": round(line.s_per_token * 1e3, 6)}

    # -- learning ---------------------------------------------------------------------------------------------------
    def observe(self, request_id: str, usage: Usage, *, ttft_s: float | None, e2e_s: float) -> None:
        """Learn from a response placed by ``choose``: the prefill fit (TTFT against tokens prefilled up to its
        own, when it found room) and the service time."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        rid, klass, ahead, expected, had_room = flight
        self.service.observe(rid, e2e_s)
        if ttft_s is None or not had_room:
            return
        own = usage.prefilled_tokens if usage.prefilled_tokens is not None else expected
        self.prefill.observe(rid, klass, ahead + own, ttft_s)

    def released(self, request_id: str) -> None:
        """The request ended (any outcome): forget its dispatch record."""
        self._flights.pop(request_id, None)

    def forget(self, replica_id: str) -> None:
        """``replica_id`` left membership."""
        self.prefill.forget_replica(replica_id)
        self.service.forget(replica_id)


class LearningRateBook(RateBook):
    """The OllamaRouter RateBook (skylb/core/rates.py), also feeding a PredictedTTFT with every response."""

    def __init__(self, ttft: PredictedTTFT, **kwargs):
        super().__init__(**kwargs)
        self.ttft = ttft

    def observe(self, rates: ReplicaRates, request_id: str, usage: Usage, *, ttft_s: float | None,
                e2e_s: float) -> bool:
        self.ttft.observe(request_id, usage, ttft_s=ttft_s, e2e_s=e2e_s)
        return super().observe(rates, request_id, usage, ttft_s=ttft_s, e2e_s=e2e_s)

    def released(self, rates: ReplicaRates, request_id: str):
        self.ttft.released(request_id)
        return super().released(rates, request_id)
