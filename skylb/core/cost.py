"""One cost for every placement: the predicted time to first token (TTFT) of a request at each candidate, in seconds.

Decision 10 of the design. For a request of ``n`` prompt tokens, with ``m`` of them expected cached at a target:

* a local replica with room:      ``line_r(backlog_r + n - m_r)``
* a local replica whose batch is full (a push into its engine's waiting queue):
                                  ``slot_wait_r + line_r(backlog_r + n - m_r)``
* a peer balancer with room:      ``rtt + line_p(backlog_p + forwarded_since_p + n - m_p)``
* a peer with no room:            ``rtt + (ahead_p + 1) / dispatch_rate_p + line_p(backlog_p + n - m_p)``
* holding it in this balancer's queue (only when no local replica has room): its turn here at this balancer's
  dispatch rate, as a peer's queue is priced (``1 / dispatch_rate``; the slot wait of the replica freeing first
  before two placements), plus ``line_f(backlog_f + n - m_f)`` of that replica ``f``.

where ``line(x) = fixed_s + s_per_token x x`` is the prefill model (skylb/core/prefill_model.py: one per replica,
fitted online from every response; a peer advertises its class's fitted line, so both sides are priced on one
scale), ``backlog`` the prompt tokens queued for prefill ahead of the request (skylb/core/estimate.py
``WaitModel.backlog_tokens``; a peer advertises its least backlogged replica's in tokens, among those with room
when it has any), ``slot_wait_r = (waiting_r
+ 1) x service_s_r / limit_r`` the time until the full batch frees a slot for it (``waiting_r``: requests already
past the batch's limit there, ``limit_r`` its slots or learned admission capacity, ``service_s_r`` its measured
mean time from dispatch to the end of a response), ``ahead_p`` the requests queued at the peer that will go before
this one (all of them, or none when this request is older than the peer's oldest: it keeps its age there), and
``m`` the cached prefix: the replica trie's match locally; for a peer, its region summary of KV-cache blocks, else the regional snapshot's match.

Units: tokens, seconds. Pure: no clock, no I/O.
"""

from __future__ import annotations

from skylb.core.prefill_model import PrefillLine
from skylb.core.state import PeerState, ReplicaState

__all__ = ["ServiceTimes", "slot_wait_s", "batch_limit", "peer_ttft_s"]


class ServiceTimes:
    """Measured mean service time per replica (dispatch to the end of a response, s): an exponential moving
    average with weight ``alpha`` for the newest response; ``default_s`` before any response anywhere, then the mean
    over measured replicas for an unmeasured one."""

    def __init__(self, *, alpha: float = 0.1, default_s: float = 1.0):
        self.alpha = alpha
        self.default_s = default_s
        self._by_replica: dict[str, float] = {}
        self._mean: float | None = None  # of the measured replicas, recomputed after a change

    def observe(self, replica_id: str, seconds: float) -> None:
        """One response of ``replica_id`` took ``seconds`` from dispatch to its end."""
        if seconds < 0:
            return
        old = self._by_replica.get(replica_id)
        self._by_replica[replica_id] = seconds if old is None else old + self.alpha * (seconds - old)
        self._mean = None

    def seconds(self, replica_id: str) -> float:
        """The mean service time of ``replica_id``, s."""
        value = self._by_replica.get(replica_id)
        if value is not None:
            return value
        if self._mean is None:
            self._mean = (sum(self._by_replica.values()) / len(self._by_replica) if self._by_replica
                          else self.default_s)
        return self._mean

    def forget(self, replica_id: str) -> None:
        """Drop ``replica_id`` (it left membership)."""
        self._by_replica.pop(replica_id, None)
        self._mean = None


def batch_limit(replica: ReplicaState, learn_capacity: bool = True) -> int | None:
    """How many requests ``replica`` runs at once: its engine's slots when it reports them, else its learned
    admission capacity (skylb/core/capacity.py) when the engine reports a running count, else its configured
    ``max_concurrency``; None when nothing bounds it."""
    if replica.slots is not None:
        return replica.slots
    if learn_capacity and replica.running is not None:
        return replica.capacity.limit
    return replica.max_concurrency


def slot_wait_s(replica: ReplicaState, service_s: float, learn_capacity: bool = True) -> float:
    """Seconds a request pushed to ``replica`` now waits for a place in its batch: 0 while the batch has room, else
    ``(waiting + 1) x service_s / limit`` (slots free at ``limit / service_s`` per second, and ``waiting`` requests
    are ahead of it). ``service_s``: the replica's mean service time, s."""
    limit = batch_limit(replica, learn_capacity)
    if limit is None:
        # No batch size known: the engine's pending requests are the queue (the paper's signal).
        return (replica.pending * service_s) if replica.pending > 0 else 0.0
    in_engine = replica.in_engine
    if in_engine < limit:
        return 0.0
    return (in_engine - limit + 1) * service_s / max(1, limit)


def peer_ttft_s(peer: PeerState, *, uncached_tokens: float, age_s: float, default_prompt_tokens: int,
                fallback: PrefillLine) -> float | None:
    """Predicted TTFT through ``peer`` (module docstring), s; None when it cannot be priced (no room there and no
    dispatch rate to turn its queue into seconds).

    ``uncached_tokens``: the request's prompt tokens not matched in the regional snapshot for this peer;
    ``age_s``: how long the request has waited (it keeps its age at the peer); ``fallback``: the line used when
    the peer advertises none."""
    # Unmeasured round trip (before the first status probe's): counted as 0, as an unmeasured replica is tried.
    rtt = peer.rtt_s or 0.0
    line = peer.prefill_line or fallback
    room = peer.available_replicas - peer.sent_since_probe
    if room > 0 and peer.queue_len == 0:
        backlog = (peer.backlog_tokens or 0.0) + peer.sent_since_probe * default_prompt_tokens / max(
            1, peer.available_replicas)
        return rtt + line.seconds(backlog + uncached_tokens)
    if not peer.dispatch_rate:
        return None
    older_than_queue = peer.queue_age_s is not None and age_s > peer.queue_age_s + rtt
    ahead = peer.sent_since_probe + (0 if older_than_queue else peer.queue_len)
    # Its turn comes at the peer's dispatch rate, then it meets its least backlogged replica's backlog, as a held
    # request meets a local replica's (the two are priced alike, or every saturated region would look worse than
    # its peers from inside).
    return rtt + (ahead + 1) / peer.dispatch_rate + line.seconds((peer.backlog_tokens or 0.0) + uncached_tokens)
