"""A balancer's side of the region shares (no Redis): the demand its heartbeat carries and the shares the
controller answers (controller/shares.py has the rule). Both apply only to in-process buckets (``LocalLimits``);
with buckets shared through Redis there are no shares to compute."""

from __future__ import annotations

from skylb.quota.buckets import LimitBackend, LocalLimits

__all__ = ["demand_report", "apply_shares"]


def demand_report(limits: LimitBackend, now: float) -> dict | None:
    """What each bucket of ``limits`` was asked for over the last minute (skylb/quota/demand.py ``report`` shape),
    at ``now`` (s, the balancer's clock); None when ``limits`` is not in-process."""
    if not isinstance(limits, LocalLimits):
        return None
    return limits.demand.report(now)


def apply_shares(limits: LimitBackend, answer: dict) -> bool:
    """Enforce the shares of the controller's heartbeat answer (``{"default": f, "buckets": {key: f}}``, fractions
    in (0, 1]) on in-process ``limits``; True when applied, False (nothing changed) when ``limits`` is not
    in-process or the answer is malformed."""
    default, buckets = answer.get("default"), answer.get("buckets")
    if not isinstance(limits, LocalLimits) or not isinstance(buckets, dict):
        return False
    fractions = [default, *buckets.values()]
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in fractions):
        return False
    limits.set_shares(buckets, default)
    return True
