"""What a balancer knows about its targets (local replicas and peer balancers), and the availability rules.

Source: SkyLB paper §3.3 and Algorithm 1 (MONITORAVAILABILITY, lines 1-16).
- A replica is available when it is healthy, its latest probe is fresh and showed 0 pending requests (with a
  learned admission capacity, below: when its running batch, the requests waiting in it and those sent since the
  probe are fewer than the capacity).
- A peer is available when its latest status is fresh, it reports at least one available replica and its queue is
  no longer than tau.

One refinement beyond the paper: a probe is a snapshot, and between two probes the balancer could push any number of
requests onto a replica that looked empty. Each replica's admission capacity (the requests it runs at once) is
learned from its probes (skylb/core/capacity.py) or read from the engine (llama.cpp's slots), and a replica whose
running batch plus the requests sent since its probe reaches it is full ("batch full"), so a burst spreads over
the replicas with room and a large batch is not throttled; ``pending_allowance`` (default 1) lets that many more wait
in the engine's own queue, ready for the next freed slot. A peer gets at most one request per available replica
it reported until its next status. ``max_dispatch_per_probe`` is an optional ceiling on requests sent to one
replica between two of its probes (0, the default: none). Each unavailable target carries a reason, shown in
status and metrics.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from skylb.core.capacity import AdmissionCapacity
from skylb.core.held_prefixes import MAX_STATUS_PREFIXES, SiblingPrefixes
from skylb.core.prefill_model import PrefillLine
from skylb.core.rates import ReplicaRates
from skylb.core.fleet_rules import FleetView

__all__ = ["ReplicaState", "ReplicaTable", "PeerState", "PeerStatus", "AvailabilityRules",
           "load_from_outstanding"]


def load_from_outstanding(outstanding: int, slots: int) -> tuple[int, int]:
    """(pending, running) of a replica that reports no load, from this balancer's in-flight requests there and the
    replica's parallel ``slots``: requests beyond the slots wait in the engine. The one rule for Ollama and
    generic OpenAI servers (skylb/engines/ollama.py, openai.py) and for the simulator's SP-O replicas."""
    return max(0, outstanding - slots), min(outstanding, slots)


@dataclass
class ReplicaState:
    """A local replica as this balancer sees it.

    Attributes:
        id: the replica id from the controller; url: its base URL.
        healthy: the latest probe succeeded (and the engine said it is up).
        pending: pending requests in the latest probe (accepted by the engine, not yet in its running batch).
        running: requests in the engine's running batch in the latest probe, or None if not reported.
        probed_at: time of the latest probe answer, s (None: never probed).
        outstanding: requests this balancer sent there that have not finished (never negative).
        sent_since_probe: requests sent there that the latest probe may not have seen (sent after it was sent).
        slots: the engine's parallel slots when the engine says (llama.cpp ``total_slots``); a replica whose
            latest probe shows ``running`` at its slots is full even before a request is pending.
        draining: removed from membership; gets no new requests while its in-flight ones finish.
        max_concurrency: the replica's parallel slots when configured: this balancer sends no more at once, and
            the learned admission capacity starts there and stays at or below it.
        models: the model ids it serves (None until learned from the replica); apis: the API dialects it speaks.
        model_cards: model id -> the replica's own entry for it in its model list (a JSON object: vLLM's
            ``max_model_len``, ``root``, ``parent``, ...), passed on by the balancer's ``GET /v1/models``.
        error: why the latest probe failed, if it did.
        kv_usage: the fraction of the engine's KV cache in use (0-1) at the latest probe, when the engine says.
        kv_capacity_tokens: the tokens the engine's KV cache holds in all, when it says (vLLM ``num_gpu_blocks`` x
            ``block_size`` of ``vllm:cache_config_info``, SGLang ``sglang:max_total_num_tokens``).
        output_reserve_tokens: the most output tokens its engine reserves in the KV cache for a request it admits
            (SGLang's 4096), or None when it admits on the prompt alone (vLLM) (skylb/engines/base.py ProbeResult).
        output_reserve_ratio: the share of its running requests' remaining output that such an engine keeps reserved
            against new admissions (SGLang's ``new_token_ratio``), as its probe said; None for other engines.
        reserved: request id -> the output tokens the engine reserves for it (``max_tokens`` clipped at
            ``output_reserve_tokens``), for this balancer's requests in flight here, on engines that reserve output.
        unprefilled: request id -> prompt tokens not expected from the prefix cache, for this balancer's requests
            sent here that have not yet produced a first token (the prefill backlog it knows exactly).
        capacity: the admission capacity learned from this replica's probes (skylb/core/capacity.py).
        unsupported: request kind ("embeddings", "generation": ``Request.kind``) -> until when (s) no request of
            that kind goes here, after the replica answered one with 501 Not Implemented (llama-server without
            ``--embeddings``); a replica restarted with the feature gets such requests again after that.
    """

    id: str
    url: str
    engine: str = "vllm"
    healthy: bool = False
    pending: int = 0
    running: int | None = None
    probed_at: float | None = None
    outstanding: int = 0
    dispatch_times: deque = field(default_factory=deque, repr=False)
    draining: bool = False
    error: str | None = None
    served: int = 0
    max_concurrency: int | None = None
    models: frozenset[str] | None = None
    apis: frozenset[str] = frozenset({"openai"})
    model_cards: dict[str, dict] = field(default_factory=dict, repr=False)
    slots: int | None = None
    #: Consecutive gateway failures and 5xx answers, ejections so far and the end of the current or latest
    #: ejection, s (outlier detection: skylb/core/outlier.py).
    gateway_failures: int = 0
    consecutive_5xx: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    output_reserve_tokens: int | None = None
    output_reserve_ratio: float | None = None
    reserved: dict[str, int] = field(default_factory=dict, repr=False)
    #: The sum of ``reserved``, kept up to date as ``backlog_tokens`` is.
    reserved_tokens: int = field(default=0, repr=False)
    #: request id -> when its first token came back, s, for those of ``reserved`` asking for at most the clip that
    #: have started generating; the sum of those times and of their ``reserved`` (``decode_reserve_tokens``, O(1)).
    decoding_since: dict[str, float] = field(default_factory=dict, repr=False)
    decoding_from_s: float = field(default=0.0, repr=False)
    decoding_tokens: int = field(default=0, repr=False)
    unprefilled: dict[str, int] = field(default_factory=dict, repr=False)
    #: The sum of ``unprefilled``, kept up to date so that reading it is O(1) on every routing decision.
    backlog_tokens: int = field(default=0, repr=False)
    #: Measured speed (EMAs of time per token per model) and this balancer's requests in flight (skylb/core/rates.py).
    rates: ReplicaRates = field(default_factory=ReplicaRates, repr=False)
    #: Ollama replicas: models on disk and loaded, recent loads (skylb/core/fleet_rules.py); None for other engines.
    fleet: FleetView | None = field(default=None, repr=False)
    capacity: AdmissionCapacity = field(default_factory=AdmissionCapacity, repr=False)
    unsupported: dict[str, float] = field(default_factory=dict, repr=False)
    #: Seconds its probe stays fresh beyond the rules' ``stale_after_s``: the time its probe interval is longer than
    #: the base one while the balancer's adaptive probing backs off (skylb/balancer/probe_backoff.py); 0 otherwise.
    stale_grace_s: float = 0.0
    #: A routing rule waits on this replica's next probe (the spread cap, skylb/core/plugins/spread_cap.py: it
    #: lifts when a probe has seen the requests sent here): the balancer probes it at the next round whatever its
    #: adaptive probing's interval. Cleared by a probe that leaves nothing sent since it.
    probe_wanted: bool = False
    #: The router's memo of this replica's availability (skylb/core/router.py ``Router._available``): (the
    #: router's settings token, ``probed_at``, the capacity's limit, ``sent_since_probe``, the reason or None,
    #: whether it has a free slot). Any write to another field clears it.
    availability_memo: tuple | None = field(default=None, repr=False, compare=False)
    #: (dispatched at, freed at), s, of this balancer's requests that finished here since the latest probe left:
    #: an answer to a probe sent between the two may still count the request (``observe_probe``).
    freed: list = field(default_factory=list, repr=False)
    #: This balancer's requests that ended here so far (AdmissionCapacity.observe's ``ended``), counted by
    #: ``slot_freed``, which the router calls only for policies that reuse freed slots (``reuse_freed_slots``): under
    #: the paper's rule (``skylb-paper``) it stays 0 and ``AdmissionCapacity.full_at`` is never set.
    ended: int = 0

    #: Writes of ``models`` or ``apis`` to any replica so far: what it serves changed (``ReplicaTable.serving``).
    serves_changes: ClassVar[int] = 0

    def __setattr__(self, name: str, value) -> None:
        # Every field but the memo is an input of availability, or cheap to count as one: a write clears the memo,
        # so that a routing decision re-checks only the replicas that changed since the last one.
        object.__setattr__(self, name, value)
        if name != "availability_memo":
            object.__setattr__(self, "availability_memo", None)
            if name == "models" or name == "apis":
                ReplicaState.serves_changes += 1

    def supports(self, kind: str, now: float) -> bool:
        """False while this replica is known not to serve requests of ``kind`` (``unsupported``) at ``now``."""
        until = self.unsupported.get(kind)
        return until is None or now >= until

    def add_unprefilled(self, request_id: str, tokens: int) -> None:
        """Request ``request_id`` was sent here with ``tokens`` prompt tokens to prefill (not expected cached)."""
        self.backlog_tokens += tokens - self.unprefilled.get(request_id, 0)
        self.unprefilled[request_id] = tokens

    def prefilled(self, request_id: str) -> None:
        """Request ``request_id``'s first token came back (or it ended): it no longer waits for prefill here."""
        self.backlog_tokens -= self.unprefilled.pop(request_id, 0)

    def add_reserved(self, request_id: str, max_tokens: int | None) -> None:
        """Request ``request_id``, asking for at most ``max_tokens`` output tokens (None: no limit), was sent here:
        on an engine that reserves output (``output_reserve_tokens``), remember what it reserves for it."""
        clip = self.output_reserve_tokens
        if clip:
            tokens = min(max_tokens, clip) if max_tokens is not None and max_tokens > 0 else clip
            self.reserved_tokens += tokens - self.reserved.get(request_id, 0)
            self.reserved[request_id] = tokens

    def reserve_started(self, request_id: str, now: float, max_tokens: int | None = None) -> None:
        """Request ``request_id`` (asking for at most ``max_tokens`` output tokens; None: no limit) had its first
        token come back at ``now`` (s): from then on it generates, and the engine's reserve for it, its tokens still
        to come clipped at ``output_reserve_tokens``, shrinks by each token once fewer than the clip are left
        (``decode_reserve_tokens``). Only a request asking for at most the clip is followed: one asking for more (or
        for no limit) keeps the whole clip reserved for all but its last clip's worth of tokens."""
        tokens = self.reserved.get(request_id)
        if tokens is not None and max_tokens is not None and max_tokens <= tokens \
                and request_id not in self.decoding_since:
            self.decoding_since[request_id] = now
            self.decoding_from_s += now
            self.decoding_tokens += tokens

    def release_reserved(self, request_id: str) -> None:
        """Request ``request_id`` finished here: its output reservation is released."""
        if self.reserved:
            tokens = self.reserved.pop(request_id, 0)
            self.reserved_tokens -= tokens
            since = self.decoding_since.pop(request_id, None)
            if since is not None:
                self.decoding_from_s -= since
                self.decoding_tokens -= tokens

    def decode_reserve_bound(self) -> float:
        """``decode_reserve_tokens`` before any token generated is counted off: its upper bound."""
        ratio, own = self.output_reserve_ratio, len(self.reserved)
        if not ratio or not own:
            return 0.0
        return ratio * self.reserved_tokens * max(1.0, self.in_engine / own)

    def decode_reserve_tokens(self, now: float | None = None) -> float:
        """KV-cache tokens the engine keeps reserved for the outputs of the requests it runs at ``now`` (s), beyond
        the tokens they hold (``kv_usage``), as far as this balancer can tell: ``output_reserve_ratio`` x what is
        left of the reservations of its own requests here (their ``max_tokens``, clipped, less the tokens generated
        since each one's first token at the replica's measured inter-token latency ``ModelRates.itl_s``, in all at
        most what they reserve), the engine's other requests (``in_engine`` beyond its own) counted at their mean;
        0 on an engine that reserves nothing. Without ``now`` or a measured latency, nothing is counted off
        (``decode_reserve_bound``). O(1): the tokens generated are counted from the sum of the first tokens' times,
        so a request that ran past its reserve by the measured pace (it would have ended) is not capped alone.

        Source: SGLang's ``PrefillAdder`` (``managers/schedule_policy.py``): a waiting request is admitted only when
        its prompt and reserve fit in the free and evictable tokens less ``sum(min(max_new_tokens - generated,
        clip)) x new_token_ratio`` over the running batch."""
        bound = self.decode_reserve_bound()
        itl = self.rates.overall.itl_s
        following = len(self.decoding_since)
        if not bound or now is None or not itl or not following or self.reserved_tokens <= 0:
            return bound
        generated = (following * now - self.decoding_from_s) / itl
        if generated <= 0.0:
            return bound
        generated = min(generated, self.decoding_tokens)
        return bound * (self.reserved_tokens - generated) / self.reserved_tokens

    @property
    def sent_since_probe(self) -> int:
        """Requests sent here after the latest probe was sent (so possibly unseen by it)."""
        return len(self.dispatch_times)

    @property
    def in_engine(self) -> int:
        """Requests in the engine now, as far as this balancer knows (a count): running and waiting at the latest
        probe plus those sent since, or this balancer's own in flight there when more (a probe may be stale)."""
        return max((self.running or 0) + self.pending + len(self.dispatch_times), self.outstanding)

    def serves(self, model: str, api: str) -> bool:
        """True when this replica serves ``model`` ("" = any model) in dialect ``api``."""
        return api in self.apis and (not model or (self.models is not None and model in self.models))

    def observe_probe(self, *, now: float, healthy: bool, pending: int = 0, running: int | None = None,
                      error: str | None = None, slots: int | None = None,
                      probe_sent_at: float | None = None, kv_usage: float | None = None,
                      kv_capacity_tokens: int | None = None, output_reserve_tokens: int | None = None,
                      output_reserve_ratio: float | None = None) -> None:
        """Record one probe answer received at ``now`` (s).

        ``probe_sent_at`` (s): when the probe left; requests dispatched after that may be missing from the answer,
        so they stay counted in ``sent_since_probe`` (None: the answer covers everything sent before ``now``).
        """
        self.healthy = healthy
        self.pending = max(0, int(pending)) if healthy else self.pending
        self.running = running if healthy else self.running
        if slots is not None:
            self.slots = slots
        if healthy:
            self.kv_usage = None if kv_usage is None else min(1.0, max(0.0, float(kv_usage)))
            if kv_capacity_tokens is not None and kv_capacity_tokens > 0:
                self.kv_capacity_tokens = int(kv_capacity_tokens)
            self.output_reserve_tokens = output_reserve_tokens
            self.output_reserve_ratio = output_reserve_ratio if output_reserve_tokens else None
            if running is not None:
                self.capacity.observe(now, self.pending, running, self.ended)
        self.error = None if healthy else (error or "probe failed")
        self.probed_at = now
        cutoff = now if probe_sent_at is None else probe_sent_at
        while self.dispatch_times and self.dispatch_times[0] < cutoff:
            self.dispatch_times.popleft()
        if self.probe_wanted and not self.dispatch_times:
            self.probe_wanted = False
        # Requests the answer may still count that finished after the probe left (their last event came in while it
        # was on its way): their places are free, as slot_freed said when they finished.
        if self.freed:
            raced = sum(1 for dispatched, freed in self.freed if dispatched < cutoff < freed)
            self.freed = [f for f in self.freed if f[1] > cutoff]
            for _ in range(raced if healthy else 0):
                self._free_one()

    def slot_freed(self, dispatched_at: float, now: float | None = None) -> None:
        """A request sent here at ``dispatched_at`` (s) finished at ``now`` (s): its place in the engine is free now,
        before the next probe says so (pushing without idle slots, where the SkyLB paper's §3.3 waits for the next
        probe). Sent after the latest probe: it no longer counts as unseen. Seen by it: the engine admits one of its
        pending requests, or, with none pending, one more slot of its running batch is free. The next probe corrects
        any error, except one that left before ``now`` and still counts the request: its answer is corrected the
        same way when it comes (``observe_probe``; measured live, closed loop on batches of 4: such an answer, read
        after the request's last event, hid the free slot, and the next request went to another replica's batch as
        its fifth and waited 4 s there). An answer the engine wrote after the request ended is then one low until
        the next probe: the error the other way, one request at most, for one probe interval."""
        self.ended += 1
        if now is not None:
            self.freed.append((dispatched_at, now))
        try:
            self.dispatch_times.remove(dispatched_at)
            self.availability_memo = None  # a change in place: __setattr__ does not see it
            return
        except ValueError:
            pass
        self._free_one()

    def _free_one(self) -> None:
        if self.pending > 0:
            self.pending -= 1
        elif self.running:
            self.running -= 1


class ReplicaTable(dict):
    """A balancer's local replicas by id (a dict of ReplicaState) that keeps the list of those serving each model in
    each dialect (``serving``) until membership or what a replica serves changes: a routing decision starts from
    that list, and building it anew from 200 replicas took about a tenth of each decision (cProfile)."""

    #: (model, dialect) pairs kept at most: requests name models, and an unknown one must not grow this.
    MAX_KEPT = 64

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._serving: dict[tuple[str, str], tuple[int, list[ReplicaState]]] = {}

    def serving(self, model: str, api: str) -> list[ReplicaState]:
        """The replicas with ``serves(model, api)``, in the table's order; the same list object until a change
        (callers must not modify it)."""
        key, changes = (model, api), ReplicaState.serves_changes
        kept = self._serving.get(key)
        if kept is None or kept[0] != changes:
            if len(self._serving) >= self.MAX_KEPT:
                self._serving.clear()
            kept = self._serving[key] = (changes, [r for r in self.values() if r.serves(model, api)])
        return kept[1]

    # Every way a dict changes its members forgets the lists.
    def __setitem__(self, key, value):
        self._serving.clear()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._serving.clear()
        super().__delitem__(key)

    def pop(self, *args):
        self._serving.clear()
        return super().pop(*args)

    def popitem(self):
        self._serving.clear()
        return super().popitem()

    def clear(self):
        self._serving.clear()
        super().clear()

    def update(self, *args, **kwargs):
        self._serving.clear()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._serving.clear()
        return super().setdefault(key, default)

    def __ior__(self, other):
        self._serving.clear()
        return super().__ior__(other)


@dataclass(frozen=True)
class PeerStatus:
    """What a balancer tells its peers (SkyLB paper Algorithm 1 line 10, PROBELB), produced by ``Router.status``
    and consumed by ``Router.observe_peer``; on the wire it is msgpack (skylb/balancer/protocol.py).

    Attributes:
        region: the reporting balancer's region.
        available_replicas: its replicas available now; replicas: all its replicas (draining ones excluded).
        queue_len: requests waiting in its queue.
        models: per API dialect ("openai", "ollama"), model id -> how many of its replicas serving that model
            are available now (0 included: the model is served there, all busy); None when the peer did not say.
        wait_ms: the reporting balancer's estimated wait before a new request's prefill starts on its best
            available replica, ms (skylb/core/estimate.py); None when it has no estimate (no available replica,
            or a policy without one, or an older peer).
        queue_age_ms: how long the oldest request in its queue has waited, ms (0: the queue is empty; None: an
            older peer that does not say).
        dispatch_rate: requests it placed per second lately (its last 32 placements), None before two.
        backlog_tokens: prompt tokens queued for prefill on its least backlogged replica, among those with room
            when it has any (skylb/core/cost.py), None when it does not say; prefill_fixed_ms, prefill_ms_per_token: its replicas'
            fitted prefill model (skylb/core/prefill_model.py), ms and ms per token, None when not said. With
            these a sender prices the peer on its own scale (design decision 10).
        model_cards: model id -> what its replicas' engines say of it (``created``, ``owned_by``,
            ``max_model_len``, ``root``, ``parent``, ...: skylb/core/model_cards.py ``peer_card``), for the models
            whose replicas gave any; None when the peer did not say (an older one) or they gave none.
        prefixes: 64-bit hashes of the prompt prefixes it placed on its own replicas lately, oldest first, at most
            ``MAX_STATUS_PREFIXES``; prefix_seq: how many it added ever (skylb/core/held_prefixes.py). Said only by
            a balancer that has a sibling, else None (an older peer says neither).
        blocks: its region summary of KV-cache blocks (skylb/core/kv_index.py ``BlockIndex.summary``): hashes of
            blocks its replicas hold now, one in ``SUMMARY_STRIDE`` of them, at most ``MAX_SUMMARY_BLOCKS``;
            block_size: their tokens per block. Said only by a balancer following its engines' KV-cache events,
            else None.
        load_per_replica: the mean over its usable replicas (healthy, not draining) of the requests in each one's
            engine (``ReplicaState.in_engine``), requests; None when it has none usable or did not say (an older
            peer). A sender compares it with its own region's (skylb/core/plugins/home_new_prefix.py).
    """

    region: str
    available_replicas: int
    replicas: int
    queue_len: int
    models: dict[str, dict[str, int]] | None = None
    wait_ms: float | None = None
    queue_age_ms: float | None = None
    dispatch_rate: float | None = None
    backlog_tokens: float | None = None
    prefill_fixed_ms: float | None = None
    prefill_ms_per_token: float | None = None
    model_cards: dict[str, dict[str, str | int | float | bool | None]] | None = None
    prefixes: tuple[int, ...] | None = None
    prefix_seq: int | None = None
    blocks: tuple[int, ...] | None = None
    block_size: int | None = None
    load_per_replica: float | None = None


@dataclass
class PeerState:
    """A peer balancer (another region) as this balancer sees it, from its msgpack status.

    Attributes:
        region: the peer's region; url: how this balancer reaches it.
        available_replicas: available replicas the peer reported; replicas: all its replicas.
        queue_len: the peer's queue length; probed_at: time of the latest status, s.
        sent_since_probe: requests forwarded there since the latest status.
        models: per API dialect, model -> the peer's available replicas serving it (every model it serves is a
            key, with 0 when none is available); None when the peer did not report models.
        model_cards: model id -> what the peer's engines say of it (``PeerStatus.model_cards``), empty when it did
            not say; ``GET /v1/models`` lists a model only peers serve with these fields.
        wait_s: the peer's estimated wait (s) from its latest status, None when it gave none.
        load_per_replica: its usable replicas' mean requests in their engines at its latest status
            (``PeerStatus.load_per_replica``), None when it gave none.
        rtt_s: the round trip to the peer, s: a moving average of status probe round trips (None: not measured).
        queue_age_s: how long the oldest request in its queue had waited at its latest status, s (None: not said).
        dispatch_rate: requests it placed per second at its latest status (None: not said).
        backlog_tokens: its best available replica's prefill backlog, tokens; prefill_line: its fitted prefill
            model (None: not said).
        sibling: True for a balancer of this balancer's own region (a sibling: it owns others of the region's
            replicas, at a local round trip), to be tried before any other region's; set by the balancer after
            ``Router.set_peers`` from its membership.
        prefixes: for a sibling, the prompt prefixes its statuses said its own replicas hold (bounded:
            skylb/core/held_prefixes.py); empty for another region's balancer, whose statuses' are not kept.
        blocks, block_size: the region summary of KV-cache blocks of its latest status (``PeerStatus.blocks``,
            replaced by each status, so blocks its engines evicted leave it), and their tokens per block; None when
            its latest status had none (its engines publish no events, or an older peer).
    """

    region: str
    url: str
    healthy: bool = False
    available_replicas: int = 0
    replicas: int = 0
    queue_len: int = 0
    probed_at: float | None = None
    sent_since_probe: int = 0
    outstanding: int = 0
    error: str | None = None
    #: Forwards answered from there (``Router.forward_answered``): a forward retried before its first byte counts only
    #: where it was answered, once.
    forwarded: int = 0
    models: dict[str, dict[str, int]] | None = None
    model_cards: dict[str, dict] = field(default_factory=dict, repr=False)
    #: Consecutive gateway failures and 5xx answers, ejections so far and the end of the current or latest
    #: ejection, s (outlier detection: skylb/core/outlier.py).
    gateway_failures: int = 0
    consecutive_5xx: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    wait_s: float | None = None
    load_per_replica: float | None = None
    rtt_s: float | None = None
    queue_age_s: float | None = None
    dispatch_rate: float | None = None
    backlog_tokens: float | None = None
    prefill_line: PrefillLine | None = None
    sibling: bool = False
    prefixes: SiblingPrefixes = field(default_factory=SiblingPrefixes, repr=False)
    blocks: frozenset[int] | None = field(default=None, repr=False)
    block_size: int | None = None
    #: Seconds its status stays fresh beyond the rules' staleness, while adaptive probing backs off (see
    #: ``ReplicaState.stale_grace_s``).
    stale_grace_s: float = 0.0

    #: Weight of the newest round trip in ``rtt_s`` (an exponential moving average, as TCP's SRTT uses 1/8).
    RTT_WEIGHT = 0.125

    def observe_status(self, *, now: float, status: PeerStatus | None, error: str | None = None,
                       rtt_s: float | None = None) -> None:
        """Record one status answer taken at ``now`` (s), or its failure (``status`` None, ``error`` why);
        ``rtt_s``: the round trip of the probe that brought it (s)."""
        self.healthy = status is not None
        if status is not None:
            self.available_replicas = max(0, int(status.available_replicas))
            self.replicas = max(0, int(status.replicas))
            self.queue_len = max(0, int(status.queue_len))
            self.models = status.models
            self.model_cards = dict(status.model_cards or {})
            self.wait_s = None if status.wait_ms is None else max(0.0, float(status.wait_ms)) / 1000.0
            self.load_per_replica = (None if status.load_per_replica is None
                                     else max(0.0, float(status.load_per_replica)))
            self.queue_age_s = None if status.queue_age_ms is None else max(0.0, float(status.queue_age_ms)) / 1000.0
            self.dispatch_rate = None if status.dispatch_rate is None else max(0.0, float(status.dispatch_rate))
            self.backlog_tokens = None if status.backlog_tokens is None else max(0.0, float(status.backlog_tokens))
            self.prefill_line = (PrefillLine(max(0.0, status.prefill_fixed_ms) / 1e3,
                                             max(0.0, status.prefill_ms_per_token) / 1e3)
                                 if status.prefill_fixed_ms is not None and status.prefill_ms_per_token is not None
                                 else None)
            if status.blocks is not None and status.block_size:
                self.blocks, self.block_size = frozenset(status.blocks), status.block_size
            else:
                self.blocks = self.block_size = None
            if self.sibling and status.prefixes is not None:
                self.prefixes.merge(status.prefixes[-MAX_STATUS_PREFIXES:], status.prefix_seq)
            if rtt_s is not None and rtt_s >= 0:
                self.rtt_s = rtt_s if self.rtt_s is None else self.rtt_s + self.RTT_WEIGHT * (rtt_s - self.rtt_s)
        self.error = None if status is not None else (error or "status probe failed")
        self.probed_at = now
        self.sent_since_probe = 0


@dataclass
class AvailabilityRules:
    """The availability rules of Algorithm 1, with their parameters.

    Args:
        tau: the largest peer queue length at which a peer is still available (Algorithm 1, line 12).
        stale_after_s: a probe older than this (s) makes its target unavailable: stale state is not trusted.
        max_dispatch_per_probe: optional ceiling on requests sent to one replica between two probes (0 = none).
        learn_capacity: bound each replica whose engine reports its running batch by the admission capacity learned
            from its probes (skylb/core/capacity.py), its waiting requests counted in the batch; False: only 0
            pending requests and the engine's reported slots (llama.cpp) bound it (the paper's rule).
        peer_stale_after_s: a peer's status older than this plus two of its round trips (s) is stale, when sooner
            than ``stale_after_s``: a partitioned peer is unavailable within a few probe intervals (0: not used).
        pending_allowance: with a learned capacity, requests that may wait in a replica's own queue beyond it
            (requests): one waiting there starts at the engine's next step after a slot frees, without a round trip
            through this balancer (not added to slots an engine reports: llama.cpp queues nothing beyond them, nor
            to a limit that slow start or a retest raised and no probe has proved yet).
    """

    tau: int = 2
    stale_after_s: float = 0.5
    max_dispatch_per_probe: int = 0
    peer_stale_after_s: float = 0.0
    learn_capacity: bool = True
    pending_allowance: int = 1

    def peer_stale_s(self, p: PeerState) -> float:
        """How old peer ``p``'s latest status may be before it is stale, s."""
        if not self.peer_stale_after_s:
            return self.stale_after_s + p.stale_grace_s
        return min(self.stale_after_s, self.peer_stale_after_s + 2.0 * (p.rtt_s or 0.0)) + p.stale_grace_s

    def replica_unavailable_reason(self, r: ReplicaState, now: float) -> str | None:
        """None when ``r`` is available at ``now``; otherwise why not (a short phrase for status and metrics)."""
        if r.draining:
            return "draining"
        if r.probed_at is None:
            return "not probed yet"
        if now - r.probed_at > self.stale_after_s + r.stale_grace_s:
            return "probe stale"
        if not r.healthy:
            return r.error or "unhealthy"
        # The engine's slots when it says (llama.cpp), else the learned capacity (None: the paper's rule alone).
        limit = (r.slots if r.slots is not None else
                 r.capacity.limit if self.learn_capacity and r.running is not None else None)
        # Requests waiting in an engine whose batch is learned count as part of it: a request sent a moment ago
        # waits for the engine's next step, and a probe that catches it would otherwise keep the replica from the
        # next request for a whole probe interval (1-2% of sequential requests waited 100 ms for that).
        if r.pending > 0 and (limit is None or r.slots is not None):
            return "pending requests"
        if r.running is not None and limit is not None:
            # The probe may miss a request that raced it on another connection; this balancer's own in-flight count
            # never does (it only errs high, by responses still draining).
            # No allowance on top of slots a retest or slow start added and no probe proved (the guess is the
            # one request beyond the batch already), nor while a request waits beside the batch before that growth
            # (AdmissionCapacity.allowance_ok).
            allowance = self.pending_allowance if r.slots is None and r.capacity.allowance_ok else 0
            if max(r.running + r.pending + r.sent_since_probe, r.outstanding) >= limit + allowance:
                return "batch full"
        # Engines without a pending metric: the balancer's own in-flight count is exact and live, no probe needed.
        if r.max_concurrency is not None and r.outstanding >= r.max_concurrency:
            return "at max concurrency"
        # Only requests still in flight count against the ceiling: one that already finished cannot fill the batch.
        if self.max_dispatch_per_probe and min(r.sent_since_probe, r.outstanding) >= self.max_dispatch_per_probe:
            return "awaiting probe"
        return None

    def has_free_slot(self, r: ReplicaState) -> bool:
        """True when ``r``'s batch has a slot free by what is known of it: its load (the probe's running and waiting
        plus the requests sent since, or this balancer's in flight there) below the engine's reported slots or the
        learned capacity the probes proved (``AdmissionCapacity.proven_limit``: what a retest or slow start added
        is not known to exist yet). Always True without a known bound. A replica available only through
        ``pending_allowance``, a retest or slow start has none: a request sent there may wait in the engine's queue
        for a whole turnover of its batch."""
        limit = (r.slots if r.slots is not None else
                 r.capacity.proven_limit if self.learn_capacity and r.running is not None else None)
        return limit is None or max(r.running + r.pending + r.sent_since_probe, r.outstanding) < limit

    def below_waited_batch(self, r: ReplicaState, untried: bool = False) -> bool:
        """True unless ``r``'s load (as in ``has_free_slot``) has reached the batch a probe last showed a request
        waiting beside after slow start grew the limit past it (``AdmissionCapacity.waited_at``): until a probe
        shows the engine running more, the place above that batch is counted as proven but may not exist (the
        request may have waited for the engine's next step, or for a slot); after a probe with nothing waiting, the
        same batch while the engine has not run more (``AdmissionCapacity.full_at``). Among replicas with a free
        slot, those below such a batch go first (Router._local_candidates): measured live, 4 replicas of batch 4
        under 16 closed-loop streams, two replicas each had a "free" slot by a limit of 5 and the full one took the
        request, which waited 4 s for its batch to turn over; later, the same with the waiting cleared by a probe
        that showed nothing waiting after a request of the batch ended (bench/results/concurrency.md). Also the
        batch whose place above was left untried (``AdmissionCapacity.untried_at``), with ``untried`` (the profile's
        ``untried_last``), while a request's measured time
        there (``ModelRates.service_s``, every model together; unmeasured counts as long) is at least ``settle_s``
        times that batch."""
        capacity = r.capacity
        waited = capacity.waited_at if capacity.waited_at is not None else capacity.full_at
        if waited is None and untried and capacity.untried_at is not None:
            # A request sent to a place that does not exist waits for the batch's next turnover: about a request's
            # time in the engine over the batch (a batch of 4 streaming 64 tokens: over a second). Under
            # ``settle_s``, a wait the capacity learner itself takes for a step's, the place is worth trying
            # (simulated batches of 53-154 did, and ranking them last cost P90 TTFT 1.06-1.13x in saturated cells).
            service_s = r.rates.overall.service_s
            if service_s is None or service_s >= capacity.settle_s * capacity.untried_at:
                waited = capacity.untried_at
        return (waited is None or not self.learn_capacity or r.slots is not None or r.running is None
                or max(r.running + r.pending + r.sent_since_probe, r.outstanding) < waited)

    def replica_available(self, r: ReplicaState, now: float) -> bool:
        """True when ``r`` may take a request now (selective pushing)."""
        return self.replica_unavailable_reason(r, now) is None

    def replica_usable(self, r: ReplicaState, now: float) -> bool:
        """True when ``r`` may take a request under blind pushing: healthy, fresh, not draining; pending ignored."""
        return (not r.draining and r.healthy and r.probed_at is not None
                and now - r.probed_at <= self.stale_after_s + r.stale_grace_s)

    def peer_unreachable_reason(self, p: PeerState, now: float, model: str = "", api: str = "openai") -> str | None:
        """None when peer ``p`` is healthy at ``now`` with a fresh status and serves ``model`` in dialect ``api``
        (it may still have no room); otherwise why not."""
        if p.probed_at is None:
            return "not probed yet"
        if now - p.probed_at > self.peer_stale_s(p):
            return "status stale"
        if not p.healthy:
            return p.error or "unreachable"
        if model and p.models is not None and model not in p.models.get(api, {}):
            return f"does not serve {model}"
        return None

    def peer_unavailable_reason(self, p: PeerState, now: float, model: str = "", api: str = "openai") -> str | None:
        """None when peer ``p`` is available at ``now`` (for ``model`` in dialect ``api``); otherwise why not."""
        reason = self.peer_unreachable_reason(p, now, model, api)
        if reason is not None:
            return reason
        available = p.available_replicas
        if model and p.models is not None:
            available = p.models.get(api, {})[model]
        if available < 1:
            return "no available replica"
        if p.queue_len > self.tau:
            return "queue longer than tau"
        # Each available replica there can take at least one request before the next status says more.
        if (self.learn_capacity or self.max_dispatch_per_probe) and min(p.sent_since_probe, p.outstanding) >= available:
            return "awaiting status"
        return None

    def peer_available(self, p: PeerState, now: float, model: str = "", api: str = "openai") -> bool:
        """True when requests (for ``model`` in dialect ``api``) may be forwarded to ``p`` now."""
        return self.peer_unavailable_reason(p, now, model, api) is None
