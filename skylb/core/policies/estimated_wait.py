"""``estimated-wait``: blind pushing to the replica with the least estimated wait from measured speed (OllamaRouter).

Source: the OllamaRouter paper ("Adaptive Load Balancing for Distributed LLM Inference Using Ollama") §3 Algorithm 1
and §4.3. Each replica's
speed is learned from its responses (skylb/core/rates.py: EMAs of time per token per model, the token-estimation
factor, the queue weight gamma); a request goes to the candidate with the least W^ = (gamma x q x f + p x f) x t^.

* Candidates (CHOOSEINSTANCE / FILTERCANDIDATEINSTANCES): when some replica is measured for the request's model,
  the measured ones and the unmeasured ones with nothing in flight from this balancer; otherwise all.
* An unmeasured candidate counts W^ = 0, so an idle unmeasured replica is tried first (the paper's exploration: its
  JavaScript multiplies by a null estimate, which is 0).
* Ties on W^ go to the smaller queue (q x f tokens), then take turns (``Policy.least_loaded``).

Blind pushing, like OllamaRouter (each Ollama instance queues what it cannot run yet): the router offers every healthy
replica serving the model, busy or not, and W^ decides. ``pick_by_estimated_wait`` is shared with the default
``skylb`` policy, which uses it as the tie-breaker among replicas its own estimate leaves equal.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.policies.base import OPTIONS_CONFIG, Policy
from skylb.core.rates import RateBook, request_chars
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["EstimatedWaitPolicy", "EstimatedWaitOptions", "pick_by_estimated_wait"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class EstimatedWaitOptions:
    """Options of ``estimated-wait``.

    Attributes:
        alpha: EMA smoothing factor in (0, 1], the weight of the newest response in every learned value
            (t^, prefill and decode rates, f, gamma).
        gamma: the queue weight: None (default) learns it per replica from measured against estimated waits,
            starting at 1; a number in [0, 2] fixes it (0: queues ignored, 2: each queued token counts double).
        token_factor: ``f``, tokens (prompt + output) per prompt character: None (default) learns it, starting at
            0.25; a positive number fixes it.
    """

    alpha: float = Field(0.3, gt=0, le=1)
    gamma: float | None = Field(None, ge=0, le=2)
    token_factor: float | None = Field(None, gt=0)


def pick_by_estimated_wait(book: RateBook, request: Request,
                           candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The candidates (non-empty) tied best by OllamaRouter's Algorithm 1: least W^ (unmeasured ones counting 0, and
    admitted only with nothing in flight when some candidate is measured), then the smallest queue. Returns a
    non-empty sub-list, in the candidates' order; the caller breaks what ties remain."""
    model = request.model
    measured = [c for c in candidates if c.rates.for_model(model) is not None]
    pool = ([c for c in candidates if c.rates.for_model(model) is not None or not c.rates.inflight]
            if measured else list(candidates))
    chars = request_chars(request)
    # Total time = queue wait + inference (W^) + the time to load the model there (RateBook.load_s; 0 for now).
    keyed = [((book.estimate_s(c.rates, model, chars) or 0.0) + book.load_s(c, model), book.queue_tokens(c.rates), c)
             for c in pool]
    best = min(k[:2] for k in keyed)
    # Within a microsecond of wait and a token of queue is a tie (float noise).
    return [c for w, q, c in keyed if w <= best[0] + 1e-6 and q <= best[1] + 1.0]


class EstimatedWaitPolicy(Policy, name="estimated-wait"):
    """Least estimated wait from measured per-replica, per-model speed (OllamaRouter); blind pushing."""

    Options = EstimatedWaitOptions
    selective = False

    def __init__(self, options: EstimatedWaitOptions | None = None):
        super().__init__(options)
        o = self.options
        self.rates = RateBook(alpha=o.alpha, gamma=o.gamma, token_factor=o.token_factor)

    def pick_replica(self, request, candidates):
        return self.least_loaded(pick_by_estimated_wait(self.rates, request, candidates))

    def estimated_wait_s(self, replica):
        """gamma x q x f x t^ over every model (s): the wait behind this balancer's requests in flight there."""
        return self.rates.queue_wait_s(replica.rates)
