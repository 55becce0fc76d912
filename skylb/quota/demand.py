"""Per-bucket demand a balancer records and reports to the controller, which moves unused share of every limit to
the regions that need it (controller/shares.py; the embedded default without Redis).

For each bucket key (``tenant/<t>/<m>``, ``model/<m>``), over the last ``window_s`` seconds (default 60: the limits
are per minute): tokens asked for (every acquire attempt, so a request that waits and tries again counts each try),
tokens and requests admitted, refusals (attempts this bucket refused), and the peak of requests in flight. Counts
are kept in one-second slots, so memory is bounded by keys x window seconds. Time ``now`` is the caller's clock in
seconds (the balancer's monotonic clock); only differences matter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from skylb.quota.limits import Limit

__all__ = ["DEMAND_WINDOW_S", "BucketDemand"]

#: The window demand is reported over (s): one minute, the period of every rate limit.
DEMAND_WINDOW_S = 60.0


@dataclass
class _Slot:
    second: int
    asked_tokens: float = 0.0
    admitted_tokens: float = 0.0
    admitted_requests: int = 0
    refused: int = 0
    peak_in_flight: int = 0


class BucketDemand:
    """Demand per bucket key over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = DEMAND_WINDOW_S):
        self.window_s = window_s
        self._slots: dict[str, deque[_Slot]] = {}
        self._limits: dict[str, Limit] = {}

    def record(self, key: str, limit: Limit, now: float, *, asked_tokens: float = 0.0, admitted_tokens: float = 0.0,
               admitted: bool = False, refused: bool = False, in_flight: int = 0) -> None:
        """Count one acquire attempt on ``key`` (under ``limit``): what it asked, what was admitted, whether this
        bucket refused it, and the requests in flight on it afterwards."""
        self._limits[key] = limit
        slots = self._slots.setdefault(key, deque())
        second = int(now)
        if not slots or slots[-1].second != second:
            slots.append(_Slot(second))
        slot = slots[-1]
        slot.asked_tokens += asked_tokens
        slot.admitted_tokens += admitted_tokens
        slot.admitted_requests += int(admitted)
        slot.refused += int(refused)
        slot.peak_in_flight = max(slot.peak_in_flight, in_flight)
        self._prune(key, now)

    def _prune(self, key: str, now: float) -> None:
        slots = self._slots[key]
        while slots and slots[0].second <= now - self.window_s:
            slots.popleft()
        if not slots:
            del self._slots[key]

    def report(self, now: float) -> dict:
        """What the heartbeat carries: {"window_s": the window (also just after start: a burst in the first seconds
        is not extrapolated to a minute; a region short of share shows it by refusals),
        "buckets": {key: {"asked_tokens", "admitted_tokens", "admitted_requests", "refused", "peak_in_flight",
        "limit": {the Limit's fields that are set}}}}; keys with nothing in the window are left out."""
        buckets = {}
        for key in list(self._slots):
            self._prune(key, now)
            slots = self._slots.get(key)
            if not slots:
                continue
            buckets[key] = {
                "asked_tokens": round(sum(s.asked_tokens for s in slots), 3),
                "admitted_tokens": round(sum(s.admitted_tokens for s in slots), 3),
                "admitted_requests": sum(s.admitted_requests for s in slots),
                "refused": sum(s.refused for s in slots),
                "peak_in_flight": max(s.peak_in_flight for s in slots),
                "limit": self._limits[key].model_dump(exclude_none=True),
            }
        return {"window_s": self.window_s, "buckets": buckets}
