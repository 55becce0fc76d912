"""The admission API's state, pure (time is an argument): leases and the backpressure window.

Source: the LLM-Load-Balancer README, "Iteration 2": A (adaptive backpressure and parallelism advice,
"Pseudocode — computing advice"), B (leases, heartbeats and reclaim, "Pseudocode — lease lifecycle").
The HTTP endpoints are in skylb/balancer/lease_api.py.
"""

from __future__ import annotations

import math
import random
import secrets
from collections import deque
from dataclasses import dataclass

from skylb.quota.groups import Admitted

__all__ = ["Lease", "LeaseTable", "AdviceWindow", "Advice", "LeaseBook", "WINDOW_S", "MIN_PARALLELISM"]

#: The rolling window advice is computed over (s; LLM-Load-Balancer README, "Iteration 2" A: "last 60s").
WINDOW_S = 60.0
#: The smallest suggested parallelism (LLM-Load-Balancer README, "Iteration 2" A: ``min=4``).
MIN_PARALLELISM = 4
#: p95 wait normalised between these (ms; "Iteration 2" A: ``normalize(p95_wait_ms, low=25ms, high=1000ms)``).
WAIT_LOW_MS, WAIT_HIGH_MS = 25.0, 1000.0


@dataclass
class Lease:
    """One admission held by a batch client.

    Attributes: id (opaque, unguessable), name (the group or model asked for), tenant, admitted (the model and
    the buckets charged), ttl_s (s), expires_at (balancer clock, s).
    """

    id: str
    name: str
    tenant: str
    admitted: Admitted
    ttl_s: float
    expires_at: float


class LeaseTable:
    """Live leases by id. ``max_leases`` bounds memory (a deployment without concurrency caps could otherwise be
    asked for leases without end)."""

    def __init__(self, max_leases: int = 100_000):
        self.max_leases = max_leases
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def full(self) -> bool:
        """True when no more leases may be created."""
        return len(self._leases) >= self.max_leases

    def add(self, admitted: Admitted, *, name: str, tenant: str, ttl_s: float, now: float) -> Lease:
        """A new lease on ``admitted`` expiring ``ttl_s`` seconds after ``now``."""
        lease = Lease(id="lse_" + secrets.token_hex(16), name=name, tenant=tenant, admitted=admitted, ttl_s=ttl_s,
                      expires_at=now + ttl_s)
        self._leases[lease.id] = lease
        return lease

    def get(self, lease_id: str | None, now: float) -> Lease | None:
        """The live lease ``lease_id`` (not expired at ``now``), else None."""
        lease = self._leases.get(lease_id) if lease_id else None
        return lease if lease is not None and lease.expires_at > now else None

    def heartbeat(self, lease_id: str, now: float) -> Lease | None:
        """Extend live lease ``lease_id`` to ``now + ttl``; None when it is unknown or expired."""
        lease = self.get(lease_id, now)
        if lease is not None:
            lease.expires_at = now + lease.ttl_s
        return lease

    def pop(self, lease_id: str, now: float) -> Lease | None:
        """Remove and return live lease ``lease_id`` (None when unknown or expired: the reclaimer owns those)."""
        lease = self.get(lease_id, now)
        if lease is not None:
            del self._leases[lease_id]
        return lease

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease expired at ``now`` (to be reclaimed: slot freed, tokens refunded)."""
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.id]
        return gone


@dataclass(frozen=True)
class Advice:
    """GET /skylb/v1/advice: ``backpressure_score`` in [0, 1], ``suggested_parallelism`` (workers), and the inputs:
    p95 wait (ms), admit rate, in-flight admissions and the total concurrency cap (None: no cap configured)."""

    backpressure_score: float
    suggested_parallelism: int
    p95_wait_ms: float
    admit_rate: float
    in_flight: int
    capacity: int | None


def _clamp(x: float, low: float, high: float) -> float:
    return max(low, min(high, x))


class AdviceWindow:
    """The outcomes of schedule calls over the last ``window_s`` seconds: admitted, or told to wait ``wait_ms``.
    At most ``max_samples`` are kept (the oldest dropped first)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = 200_000):
        self.window_s = window_s
        self._samples: deque[tuple[float, int | None]] = deque(maxlen=max_samples)

    def record(self, now: float, wait_ms: int | None) -> None:
        """One schedule call at ``now``: ``wait_ms`` None when it admitted, else the wait it returned (ms)."""
        self._samples.append((now, wait_ms))

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()

    def advice(self, now: float, *, in_flight: int, capacity: int | None) -> Advice:
        """The LLM-Load-Balancer README, "Iteration 2" A, exactly:

        ``score = clamp(0.5 * normalize(p95_wait_ms, 25, 1000) + 0.5 * (1 - admit_rate), 0, 1)``;
        ``suggested = clamp(in_flight + round((capacity - in_flight) * (1 - score)), 4, capacity)``.
        ``capacity``: the sum of the models' concurrency caps; without any (None), the headroom is taken as
        ``max(in_flight, 4)`` (grow by up to double while there is no pressure) and there is no upper clamp.
        No call in the window: p95 0 ms and admit rate 1 (no pressure)."""
        self._trim(now)
        waits = sorted(w for _, w in self._samples if w is not None)
        calls = len(self._samples)
        admit_rate = 1.0 if calls == 0 else (calls - len(waits)) / calls
        # Nearest-rank percentile.
        p95 = 0.0 if not waits else float(waits[max(0, math.ceil(0.95 * len(waits)) - 1)])
        normalized = _clamp((p95 - WAIT_LOW_MS) / (WAIT_HIGH_MS - WAIT_LOW_MS), 0.0, 1.0)
        score = _clamp(0.5 * normalized + 0.5 * (1.0 - admit_rate), 0.0, 1.0)
        if capacity is None:
            headroom = max(in_flight, MIN_PARALLELISM)
            suggested = max(MIN_PARALLELISM, in_flight + round(headroom * (1.0 - score)))
        else:
            headroom = capacity - in_flight
            suggested = int(_clamp(in_flight + round(headroom * (1.0 - score)), MIN_PARALLELISM,
                                   max(MIN_PARALLELISM, capacity)))
        return Advice(round(score, 4), int(suggested), p95, round(admit_rate, 4), in_flight, capacity)


class LeaseBook:
    """One balancer's leases, schedule-outcome window and jitter source, and the counts its metrics report:
    ``reclaimed`` (leases expired and reclaimed), ``admitted`` ({(group or model asked, model chosen, via): n},
    via "schedule" for the lease API, "request" for a generation naming a group)."""

    def __init__(self, rng: random.Random | None = None):
        self.leases = LeaseTable()
        self.window = AdviceWindow()
        self.rng = rng or random.Random()
        self.reclaimed = 0
        self.admitted: dict[tuple[str, str, str], int] = {}

    def count(self, name: str, model: str, via: str) -> None:
        """One admission of ``model`` for ``name`` through ``via``."""
        key = (name, model, via)
        self.admitted[key] = self.admitted.get(key, 0) + 1

    def leased_model(self, lease_id: str | None, *, tenant: str, name: str, now: float) -> str | None:
        """The model of the live lease ``lease_id`` when it was granted to ``tenant`` for ``name`` (the group or
        model it was scheduled for, or the model it chose), else None."""
        if not lease_id:
            return None
        lease = self.leases.get(lease_id, now)
        if lease is None or lease.tenant != tenant or name not in (lease.name, lease.admitted.model):
            return None
        return lease.admitted.model
