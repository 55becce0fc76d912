"""Adaptive probing: a target whose probe answers this balancer could foresee is probed less often.

A probe is worth its CPU (about 1 ms of the balancer's and the engine's per probe: bench/results/probe_cost.md)
only when its answer can change a decision. Two kinds of answer cannot:

* a local replica whose running and waiting requests are exactly this balancer's own requests there (it counts
  them as it sends them and as they end, skylb/core/state.py), when the answer cannot move its learned admission
  capacity (skylb/core/capacity.py: not a batch at the limit in slow start, not a retest being decided, not
  requests waiting beside a batch below the limit; a batch at the limit with the one request
  ``pending_allowance`` lets wait is what the balancer sent, and confirms the limit) and no request failed there;
* a peer whose status says what its previous one said (available replicas, queue, models, backlog, prefixes) and
  to which nothing was forwarded since.

Each foreseen answer doubles that target's interval, up to ``max_factor`` probe intervals; any other answer (a
replica with requests this balancer did not send, a changed peer, a failure) brings it back to one interval, and
so does a request forwarded to a peer. The precedent is Envoy's active health checking, which probes a cluster
with no traffic at ``no_traffic_interval`` instead of ``interval`` (Envoy docs, "Health checking",
``config.core.v3.HealthCheck``); the doubling is the usual exponential backoff. While a target's interval is
longer than one, its state stays fresh for the extra time (``stale_grace_s`` on ReplicaState / PeerState, read by
the availability rules), so a replica probed every 800 ms is not "probe stale" at 500 ms.

``max_factor`` 1 probes every target every interval, as the SkyLB paper's prototype does (Algorithm 1,
MONITORAVAILABILITY; every 100 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

from skylb.core import PeerState, ReplicaState

__all__ = ["ProbeBackoff", "replica_foreseen", "peer_summary"]


def replica_foreseen(state: ReplicaState, outstanding_at_send: int, limit_before: int) -> bool:
    """True when ``state``'s latest probe (already recorded) only said what this balancer knew: its requests
    (waiting + running; waiting alone when the engine does not report its batch) lie between this balancer's
    requests in flight there when the probe left (``outstanding_at_send``) and now, less one (a request that ended
    in the engine whose last bytes are still on their way, or one sent that the engine has not parsed yet), and
    the probe cannot teach the admission capacity anything (see the module docstring); ``limit_before``: the
    learned capacity before the probe was recorded (slow start raises it as it records a batch at the limit)."""
    # ``ejected_until`` keeps the end of the latest ejection: only one still running (at this answer) counts.
    ejected = state.ejected_until is not None and state.ejected_until > (state.probed_at or 0.0)
    if not state.healthy or state.gateway_failures or state.consecutive_5xx or ejected or state.draining:
        return False
    capacity, running = state.capacity, state.running
    if running is not None:
        if not capacity.saturated and running >= limit_before:
            return False  # slow start: each probe that shows the batch at the limit raises it
        if capacity.trial_from is not None and running >= capacity.trial_from:
            return False  # a retest of a higher limit, with the batch at the old one: the next probe decides it
        if state.pending > 0 and running < capacity.limit:
            return False  # the engine holds requests back below the limit (its KV cache): the limit may fall
    low, high = sorted((outstanding_at_send, state.outstanding))
    seen = state.pending + (state.running or 0)
    return low - 1 <= seen <= high


def peer_summary(state: PeerState) -> tuple:
    """What of a peer's status a routing decision reads, to compare one status with the next."""
    return (state.healthy, state.available_replicas, state.replicas, state.queue_len, state.models,
            state.backlog_tokens, state.prefixes.seq if state.sibling else None)


@dataclass
class ProbeBackoff:
    """Per-target probe intervals, in multiples of the probe interval.

    Args:
        interval_s: the probe interval, s. max_factor: the longest interval, in probe intervals (1: no backoff).
    """

    interval_s: float
    max_factor: int = 8

    def __post_init__(self) -> None:
        #: target key -> (factor, when its next probe is due, s).
        self._due: dict[tuple[str, str], tuple[int, float]] = {}

    def due(self, key: tuple[str, str], now: float) -> bool:
        """True when target ``key`` should be probed at ``now`` (s): never probed, or its interval has passed
        (less half an interval: rounds are ``interval_s`` apart and a probe due just after one waits no longer)."""
        entry = self._due.get(key)
        return entry is None or now >= entry[1] - 0.5 * self.interval_s

    def factor(self, key: tuple[str, str]) -> int:
        """Target ``key``'s current interval in probe intervals (1 when unknown)."""
        entry = self._due.get(key)
        return 1 if entry is None else entry[0]

    def answered(self, key: tuple[str, str], sent_at: float, *, foreseen: bool) -> float:
        """Record the answer to the probe of ``key`` sent at ``sent_at`` (s): double its interval when the answer
        was ``foreseen``, else back to one. Returns the staleness grace its state needs until the next probe, s."""
        factor = min(self.max_factor, 2 * self.factor(key)) if foreseen else 1
        self._due[key] = (factor, sent_at + factor * self.interval_s)
        return (factor - 1) * self.interval_s

    def reset(self, key: tuple[str, str]) -> None:
        """Probe ``key`` at the next round (a request was forwarded to it, or it joined)."""
        self._due.pop(key, None)

    def forget(self, kind: str, keys: set[tuple[str, str]]) -> None:
        """Drop every target of ``kind`` ("replica", "peer") not in ``keys`` (it left)."""
        for key in [k for k in self._due if k[0] == kind and k not in keys]:
            del self._due[key]
