"""``estimated-wait``: blind pushing to the replica with the least estimated wait from measured speed (OllamaRouter,
skylb/core/plugins/estimated_wait.py). Blind pushing, like OllamaRouter (each Ollama instance queues what it cannot
run yet): every healthy replica serving the model is a candidate, busy or not, and W^ decides.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.plugins.estimated_wait import EstimatedWait, QueueWait
from skylb.core.plugins.most_room import MostRoom
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.profile import Profile, Turns
from skylb.core.rates import RateBook

__all__ = ["EstimatedWaitOptions", "estimated_wait"]


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


def estimated_wait(options: EstimatedWaitOptions) -> Profile:
    """Least estimated wait from measured per-replica, per-model speed (OllamaRouter); blind pushing."""
    rates = RateBook(alpha=options.alpha, gamma=options.gamma, token_factor=options.token_factor)
    return Profile("estimated-wait", options, local=EstimatedWait(rates, Turns()), peer=MostRoom(), selective=False,
                   rates=rates, estimator=QueueWait(rates))


register("estimated-wait", EstimatedWaitOptions, estimated_wait)
