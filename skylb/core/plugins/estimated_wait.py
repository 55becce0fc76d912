"""Least estimated wait from measured speed (OllamaRouter).

Source: the OllamaRouter paper ("Adaptive Load Balancing for Distributed LLM Inference Using Ollama") §3 Algorithm 1
and §4.3. Each replica's speed is learned from its responses (skylb/core/rates.py: EMAs of time per token per model,
the token-estimation factor, the queue weight gamma); a request goes to the candidate with the least
W^ = (gamma x q x f + p x f) x t^.

* Candidates (CHOOSEINSTANCE / FILTERCANDIDATEINSTANCES): when some replica is measured for the request's model,
  the measured ones and the unmeasured ones with nothing in flight from this balancer; otherwise all.
* An unmeasured candidate counts W^ = 0, so an idle unmeasured replica is tried first (the paper's exploration: its
  JavaScript multiplies by a null estimate, which is 0).
* Ties on W^ go to the smaller queue (q x f tokens), then take turns (least load).

``pick_by_estimated_wait`` is also the default profile's tie-breaker (skylb/core/plugins/estimated_ttft.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.plugins.scoring import least_loaded
from skylb.core.profile import Estimator, Turns
from skylb.core.rates import RateBook, no_load, request_chars
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["EstimatedWait", "QueueWait", "pick_by_estimated_wait"]


def pick_by_estimated_wait(book: RateBook, request: Request,
                           candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The candidates (non-empty) tied best by OllamaRouter's Algorithm 1: least W^ (unmeasured ones counting 0, and
    admitted only with nothing in flight when some candidate is measured), then the smallest queue. Returns a
    non-empty sub-list, in the candidates' order; the caller breaks what ties remain."""
    model = request.model
    chars, f, load_s, fixed_gamma = request_chars(request), book.token_factor, book.load_s, book.fixed_gamma
    loads = load_s is not no_load
    # RateBook.for_model and estimate_measured_s written out in one pass (the same arithmetic, in the same order):
    # the default profile breaks its ties here over every idle replica, 200 on a large balancer, on each decision.
    keyed, any_measured = [], False
    for c in candidates:
        rates = c.rates
        m = rates.models.get(model)
        if m is not None and m.samples and m.time_per_token_s is not None:
            g = fixed_gamma if fixed_gamma is not None else rates.gamma
            w, any_measured = (g * rates.queued_chars * f + chars * f) * m.time_per_token_s, True
        else:
            w, m = 0.0, None
        # Total time = queue wait + inference (W^) + the time to load the model there (RateBook.load_s; 0 for now).
        keyed.append((w + load_s(c, model) if loads else w, rates.queued_chars * f, c, m))
    if any_measured:
        keyed = [k for k in keyed if k[3] is not None or not k[2].rates.inflight]
    best_w, best_q = min((w, q) for w, q, _, _ in keyed)
    # Within a microsecond of wait and a token of queue is a tie (float noise).
    w_limit, q_limit = best_w + 1e-6, best_q + 1.0
    return [c for w, q, c, _ in keyed if w <= w_limit and q <= q_limit]


class EstimatedWait:
    """ReplicaPicker: least W^ over ``rates`` (the profile's RateBook), then the smaller queue, then turns."""

    def __init__(self, rates: RateBook, turns: Turns):
        self.rates, self.turns = rates, turns

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The pick among ``candidates`` (non-empty)."""
        return least_loaded(pick_by_estimated_wait(self.rates, request, candidates), self.turns.next())


class QueueWait(Estimator):
    """Estimator: a replica's wait is gamma x q x f x t^ over every model (s), the wait behind this balancer's
    requests in flight there."""

    def __init__(self, rates: RateBook):
        self.rates = rates

    def estimated_wait_s(self, replica: ReplicaState) -> float | None:
        """gamma x q x f x t^ on ``replica``, s (None before any measurement)."""
        return self.rates.queue_wait_s(replica.rates)
