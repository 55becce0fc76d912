"""``skylb``: prefix trie + selective pushing on estimated wait, forwarding when a peer is faster (the default).

Builds on the paper's rule (``skylb-paper``, prefix.py) with what measurements on real load showed
(the busiest region's TTFT under the Mooncake trace):

* Availability sees prefill backlog and KV pressure. Besides 0 pending at the latest probe, a replica must have less
  than ``backlog_budget_tokens`` of this balancer's prompt tokens still waiting for their first token (about one
  chunked-prefill step: vLLM's ``max_num_batched_tokens`` default is 2048), and, when the engine reports it, KV
  usage below ``kv_high_watermark``. Under chunked prefill an engine admits long prompts into its running batch
  (0 pending) while every request on it slows down; the backlog clause stops piling more prompts there.
* A finished request frees its replica's place at once (``reuse_freed_slots``); probes correct the estimate.
* Placement by estimated time to first token: for each candidate, its estimated wait (skylb/core/estimate.py) plus
  the prefill of the part of the prompt it is not expected to have cached. A prefix match of ratio m (at least
  ``match_threshold``; the trie's match at the deepest node) saves m x prompt tokens of prefill, converted to
  seconds at ``prefill_tokens_per_s``; that is how locality is weighed against queueing. The load guard
  (``balance_*_threshold``) still wins when outstanding requests are imbalanced.
* Measured speed (OllamaRouter; skylb/core/rates.py): once a replica's responses have been measured, its own prefill
  seconds per token replace ``prefill_tokens_per_s`` in its wait and prefill estimates (``measured_prefill``), and
  among candidates left tied (estimates within a millisecond, equal prefix matches) the one with the least
  estimated wait from measured time per token goes first (``tie_break``: OllamaRouter's Algorithm 1,
  measured_wait.py ``pick_by_estimated_wait``), so a slower replica gets less of the work than a faster one.
* Forwarding on the estimate: a request goes to an available peer when that peer's estimated wait (from its status),
  plus the measured round trip, plus the prefill of the part its snapshot match does not cover (at the local
  replica's rate, so both sides are priced alike), beats the best local replica's estimate by
  ``forward_margin_ms``, even when a local replica has room. With no local replica
  available it goes to a peer as in the paper. The one-hop rule is the router's and is unchanged.
* First come, first served across regions (``forward_queued``): with no room here or at any peer, the oldest
  request goes to a peer whose oldest queued request is younger than it by more than the round trip, the prefill
  its cached prefix would have saved here, and ``queue_forward_margin_ms``; it keeps its age there
  (``Request.waited_s``, the ``X-SkyLB-Queue-Ms`` header), so it queues ahead of younger requests. Without this, a
  busy region's requests wait tens of seconds while its peers serve requests that arrived a moment ago (Mooncake
  trace at 2x: us P90 TTFT 50 s, eu and asia 15-17 s; a single scheduler with a global queue, 31 s everywhere).
* Waiting for a faster replica (``hold_for_faster``): on mixed hardware, a request the only replica with room would
  finish later than a busy, faster replica would finish the whole queue (this request included) waits here for the
  faster one: with n queued requests, a replica with room takes the head only if its service time for it (measured
  time per token, OllamaRouter's W^ without a queue) is below the faster one's backlog plus n of its service
  times. This is OllamaRouter's choice (a slow host gets a request once the fast one's queue is long enough, its
  Algorithm 1) made with the requests held here instead of pushed into the engines' queues: on one host 4x slower
  than the other, selective pushing alone gave the slow host every request that arrived while the fast one was
  busy, and the last of them finished long after the fast host would have.
* Look-ahead (``queue_lookahead``): when a replica has room, the first of the next ``queue_lookahead`` queued
  requests whose prefix that replica holds goes there before a head that has no match on it (SGLang's scheduler
  orders its waiting queue by longest prefix match for the same reason: under load, each cache hit is prefill
  saved). The head is passed over at most ``max_bypass`` times, so nobody starves.
* Cache hits go to their replica (``push_to_prefix_holder``): a request whose prefix a local replica holds (replica
  trie, at least ``match_threshold``) while no replica with room holds it is pushed into the holder's full batch, as
  SGLang's cache-aware router (sgl-router ``cache_aware``) sends every matched request, unless a batch's worth
  already waits there, the holder's bound is stated rather than learned (llama.cpp's slots, ``max_concurrency``),
  or the local replicas' outstanding requests are imbalanced (``holder_balance_*_threshold``, SGLang's 64 and 1.5).
  Selective pushing sent such a hit to a replica with room, which prefilled the whole prefix and kept a second
  copy of it; under load those copies evicted other prefixes, misses grew the load, and the load made more misses
  (150 tenants behind 6,000-token prefixes at 2x: each tenant's requests spread over 3.3 replicas and 67% hits,
  where one SGLang router kept each tenant on one replica for 83%). Requests without a match keep selective pushing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.estimate import WaitModel, prompt_tokens
from skylb.core.policies.predicted_ttft import LearningRateBook, PredictedTTFT
from skylb.core.prefill_model import PrefillLine
from skylb.core.policies.base import OPTIONS_CONFIG
from skylb.core.policies.skylb_paper import SkyLBPaperOptions, SkyLBPaperPolicy
from skylb.core.policies.estimated_wait import pick_by_estimated_wait
from skylb.core.policies.scoring import loads_imbalanced, prefix_lookahead
from skylb.core.rates import request_chars

__all__ = ["SkyLBPolicy", "SkyLBOptions"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SkyLBOptions(SkyLBPaperOptions):
    """Options of ``skylb``: those of ``skylb-paper`` (SkyLBPaperOptions) and:

    Attributes:
        prefill_tokens_per_s: one replica's prefill throughput, tokens/s (default: Llama-3.1-8B on an L4, about
            2000; set it for your engine and GPU: it converts token backlogs and cached prefixes to seconds).
        backlog_budget_tokens: a replica with this many of this balancer's prompt tokens not yet prefilled takes
            no more (0: no such clause).
        kv_high_watermark: a replica whose engine reports KV usage at or above this fraction takes no more (1: off).
        forward_margin_ms: a peer must beat the best local estimate by this much to get a request a local replica
            could take, ms.
        default_prompt_tokens: the length assumed for a pending request this balancer did not send, tokens.
        queue_forward_margin_ms: with no room anywhere, a peer's oldest queued request must be younger than ours by
            this much (beyond the round trip and the prefill lost) for ours to go there, ms.
        queue_lookahead: how many queued requests, from the head, are searched for one whose prefix a free
            replica holds (0 or 1: strict first come, first served).
        max_bypass: how many times the head may be passed over for a later request before it goes first.
        tie_break: among available replicas left tied by the estimate above with equal prefix matches:
            "estimated-wait" (OllamaRouter's least estimated wait from measured time per token, then the smaller queue,
            then turns) or "least-load" (fewest in flight, then turns: the behaviour before measured speeds).
        measured_prefill: use a replica's measured prefill rate in place of ``prefill_tokens_per_s`` once it is
            measured (skylb/core/estimate.py WaitModel).
        hold_for_faster: keep a request queued for a busy replica that would finish the queue sooner (above).
        faster_ratio: a replica counts as faster when its measured time per token is below the picked one's
            divided by this (identical replicas differ by noise, and then nothing is held).
        placement: "estimate" (default): the rule above (pick by estimate, the load guard, ``prefer_peer``,
            ``forward_queued``); "predicted-ttft": every candidate (local replica with room, push into a full
            batch, peer, holding here) priced by one cost, the predicted time to first token
            (skylb/core/policies/predicted_ttft.py, skylb/core/cost.py). Not yet the default: it wins on the
            unsaturated cells measured so far but loses P90 on the saturated Mooncake trace at 2x (README).
        prefill_fixed_ms: the prefill model's prior fixed part per request, ms (with ``prefill_tokens_per_s``, the
            prior every replica's fitted line starts from; default 50: about one engine step's weight read, 53.5
            ms for Llama-3.1-8B on an L4).
        push_to_prefix_holder: push a cache hit into its holder's full batch (above).
        holder_balance_abs_threshold, holder_balance_rel_threshold: no push while the local replicas' outstanding
            requests differ by more than abs and the most loaded has more than rel x the least (SGLang's test and
            defaults, 64 and 1.5: chosen on the development split, where the ``balance_*`` pair below (8) kept the
            150-tenant workload at 2x at 4.1 s P90 instead of 0.5 s).
        ttft_balance_abs_threshold: with ``predicted-ttft``, the load guard's absolute threshold (outstanding
            requests; the relative one is ``balance_rel_threshold``): past it only the least loaded local replica is
            priced. The cost is the time to first token, which does not see that a larger batch decodes slower for
            all in it, so without a guard replicas holding popular prefixes took ever more (closed-loop Tree of
            Thoughts: throughput -17%). 16 was chosen on the development split (seeds 0-1; 8 lost the low-reuse
            cell's gain, 32 lost 3-8% throughput on the closed-loop workloads): bench/results/predicted_ttft.md.
        balance_abs_threshold: as in ``skylb-paper``, but 8 rather than the prototype's 32: with 4 replicas of
            about 20 outstanding requests each, a gap of 32 never triggers the load guard, and prefix affinity
            piled sessions and popular prompts onto one replica (simulated Arena and WildChat, seeds 0-1: variance
            of outstanding requests 177 -> 14 and 110 -> 21, throughput +7% and +11%, P90 TTFT equal or lower).
        balance_rel_threshold: 1.5 rather than the prototype's 1.0001 (SGLang's): with batches of 50-70 a gap of 8
            is noise, and the guard then sent prefix hits to the least loaded replica (development split, seed 0:
            the 150-tenant workload at 2x 2.77 -> 0.50 s P90 with the push above, closed-loop throughput unchanged).
    """

    balance_abs_threshold: int = Field(8, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    hold_for_faster: bool = True
    faster_ratio: float = Field(1.5, ge=1)
    prefill_tokens_per_s: float = Field(2000.0, gt=0)
    backlog_budget_tokens: int = Field(2048, ge=0)
    kv_high_watermark: float = Field(0.95, gt=0, le=1)
    forward_margin_ms: float = Field(50.0, ge=0)
    default_prompt_tokens: int = Field(512, ge=1)
    queue_forward_margin_ms: float = Field(2000.0, ge=0)
    queue_lookahead: int = Field(64, ge=0)
    max_bypass: int = Field(64, ge=0)
    tie_break: Literal["estimated-wait", "least-load"] = "estimated-wait"
    measured_prefill: bool = True
    placement: Literal["estimate", "predicted-ttft"] = "estimate"
    push_to_prefix_holder: bool = True
    holder_balance_abs_threshold: int = Field(64, ge=0)
    holder_balance_rel_threshold: float = Field(1.5, ge=1)
    prefill_fixed_ms: float = Field(50.0, ge=0)
    ttft_balance_abs_threshold: int = Field(16, ge=0)


class SkyLBPolicy(SkyLBPaperPolicy, name="skylb"):
    """Prefix-aware placement by estimated time to first token, locally and across regions."""

    Options = SkyLBOptions
    reuse_freed_slots = True
    holds_for_faster = True

    def __init__(self, options: SkyLBOptions | None = None):
        super().__init__(options)
        o = self.options
        self.wait = WaitModel(prefill_tokens_per_s=o.prefill_tokens_per_s,
                              default_prompt_tokens=o.default_prompt_tokens, measured=o.measured_prefill)
        # One decision needs the prompt's replica-trie match three times (pick, forward check, backlog accounting);
        # the trie changes only in ``routed``, so the pick's match is kept until then.
        self._memo: tuple[object, object] | None = None
        self.queue_lookahead = o.queue_lookahead
        self.max_bypass = o.max_bypass
        self.ttft = PredictedTTFT(wait=self.wait, prior=PrefillLine(o.prefill_fixed_ms / 1e3,
                                                                     1.0 / o.prefill_tokens_per_s),
                                  forward_margin_s=o.forward_margin_ms / 1e3, kv_high_watermark=o.kv_high_watermark,
                                  queue_margin_s=o.queue_forward_margin_ms / 1e3)
        self.rates = LearningRateBook(self.ttft)

    def choose(self, c):
        """With ``placement: predicted-ttft`` the cheapest candidate by predicted TTFT (predicted_ttft.py); else a
        cache hit's full holder (``push_to_prefix_holder``, ``_busy_holder``) or, without one, the estimate rule."""
        if self.options.placement != "predicted-ttft":
            holder = self._busy_holder(c) if self.options.push_to_prefix_holder else None
            return holder if holder is not None else super().choose(c)
        request = c.request
        kind, target = self.ttft.choose(
            c, match=lambda ids: self._replica_match(request, ids),
            snapshot=lambda regions: self.snapshot_trie.match(self._key(request), regions),
            threshold=self.options.match_threshold, default_prompt_tokens=self.options.default_prompt_tokens,
            guard=self._ttft_guard)
        if (kind == "local" and len(c.local) < c.replicas and c.busy
                and self.hold_for_faster(request, target, c.busy, c.queued)):
            return None
        if kind in ("local", "push"):
            self.ttft.dispatched(request, target)  # recorded only once it is sent: a held request leaves nothing
        return target

    def _busy_holder(self, c):
        """The least loaded full local replica holding ``c.request``'s prefix (replica-trie match of at least
        ``match_threshold``) when no replica with room holds it and the local replicas' outstanding requests are
        not imbalanced at ``holder_balance_*_threshold``; else None (the rest of the rule decides)."""
        busy = c.busy
        if not busy:
            return None
        everyone = [*c.local, *busy]
        # Not the memoised match: that one is over the replicas with room, which the rest of the rule prices.
        m = self.replica_trie.match(self._key(c.request), {r.id for r in everyone})
        if not m.targets or m.ratio < self.options.match_threshold or any(r.id in m.targets for r in c.local):
            return None
        holders = [r for r in busy if r.id in m.targets and _queue_shorter_than_batch(r)]
        if not holders:
            return None
        holder = self.least_loaded(holders)
        o = self.options
        imbalanced = loads_imbalanced(everyone, o.holder_balance_abs_threshold, o.holder_balance_rel_threshold)
        return None if imbalanced else holder

    def _ttft_guard(self, local):
        """The least loaded of ``local`` when their loads are imbalanced at ``ttft_balance_abs_threshold``, else
        None (scoring.loads_imbalanced; 0: never)."""
        o = self.options
        if o.ttft_balance_abs_threshold and loads_imbalanced(local, o.ttft_balance_abs_threshold,
                                                            o.balance_rel_threshold):
            return self.least_loaded(local)
        return None

    def advertised(self, available, replicas):
        return self.ttft.advertised(available, replicas) if self.options.placement == "predicted-ttft" else {}

    def set_members(self, replicas, peers):
        replicas = set(replicas)
        for gone in self._replicas - replicas:
            self.ttft.forget(gone)
        super().set_members(replicas, peers)

    # -- availability and estimates -----------------------------------------------------------------------------
    def replica_unavailable_reason(self, replica):
        o = self.options
        if o.backlog_budget_tokens and replica.unprefilled and replica.backlog_tokens >= o.backlog_budget_tokens:
            return "prefill backlog"
        if replica.kv_usage is not None and o.kv_high_watermark < 1 and replica.kv_usage >= o.kv_high_watermark:
            return "KV cache full"
        return None

    def estimated_wait_s(self, replica):
        return self.wait.wait_s(replica)

    def _matched(self, request, trie, members) -> tuple[frozenset[str], float]:
        """(targets with the deepest match, matched fraction), the fraction 0 below ``match_threshold``."""
        m = trie.match(self._key(request), members)
        if not m.targets or m.ratio < self.options.match_threshold:
            return frozenset(), 0.0
        return m.targets, m.ratio

    def _replica_match(self, request, members):
        """``request``'s replica-trie match among ``members`` (replica ids), computed once per decision: the
        first call (the pick, over the available candidates) is reused until ``routed``. A request the queue's
        look-ahead walked while it waited is answered from that walk while it holds (no second walk)."""
        if self._memo is None or self._memo[0] is not request:
            kept = request.kept_match
            found = (kept.match(members) if kept is not None and kept.holds(self.replica_trie)
                     else self.replica_trie.match(self._key(request), members))
            self._memo = (request, found)
        return self._memo[1]

    def _matched_fraction(self, request, replica_id, members) -> float:
        """The fraction of ``request``'s prompt expected cached at ``replica_id``: the match ratio when the replica
        holds the deepest match among ``members`` and the ratio reaches ``match_threshold``, else 0."""
        m = self._replica_match(request, members)
        if replica_id not in m.targets or m.ratio < self.options.match_threshold:
            return 0.0
        return m.ratio

    def uncached_tokens(self, request, replica_id):
        return round(prompt_tokens(request) * (1.0 - self._matched_fraction(request, replica_id, self._replicas)))

    def routed(self, request, *, replica=None, peer=None):
        self._memo = None
        super().routed(request, replica=replica, peer=peer)

    def next_in_queue(self, window, local, peers, replicas):
        """scoring.prefix_lookahead over the replica trie (a free replica takes a request whose prefix it holds;
        with only peers free, one whose cache is not here goes first)."""
        return prefix_lookahead(window, local, replicas, self.replica_trie, self.options.match_threshold)

    # -- placement ------------------------------------------------------------------------------------------------
    def _local_costs(self, request, candidates) -> dict[str, float]:
        """Candidate id -> estimated seconds to its first token (wait + uncached prefill)."""
        tokens = prompt_tokens(request)
        members = {c.id for c in candidates}
        prior = self.wait.prior_s_per_token(candidates)
        return {c.id: self.wait.wait_s(c, prior) + self.wait.prefill_s(
                    tokens * (1.0 - self._matched_fraction(request, c.id, members)), c, prior)
                for c in candidates}

    def pick_replica(self, request, candidates):
        if len(candidates) > 1 and self.imbalanced(candidates):
            return self.least_loaded(candidates)
        costs = self._local_costs(request, candidates)
        best = min(costs.values())
        # Within a millisecond is a tie: spread over the tied ones by load rather than by dict order.
        tied = [c for c in candidates if costs[c.id] <= best + 1e-3]
        if len(tied) > 1 and self.options.tie_break == "estimated-wait":
            members = {c.id for c in candidates}
            ratio = {c.id: self._matched_fraction(request, c.id, members) for c in tied}
            top = max(ratio.values())
            tied = pick_by_estimated_wait(self.rates, request, [c for c in tied if ratio[c.id] == top])
        return self.least_loaded(tied)

    def hold_for_faster(self, request, replica, busy, queued):
        """True when a measured replica of ``busy`` at least ``faster_ratio`` x faster than ``replica`` would
        finish its backlog plus ``queued`` requests of this one's size before ``replica`` finished this one."""
        if not self.options.hold_for_faster:
            return False
        model = request.model
        mine = replica.rates.for_model(model)
        if mine is None:
            return False
        tokens = request_chars(request) * self.rates.token_factor
        own_s = tokens * mine.time_per_token_s
        for other in busy:
            theirs = other.rates.for_model(model)
            if theirs is None or not _faster(theirs, mine, self.options.faster_ratio):
                continue
            backlog_s = self.rates.queue_wait_s(other.rates, model) or 0.0
            if own_s > backlog_s + queued * tokens * theirs.time_per_token_s:
                return True
        return False

    def peer_cost_s(self, request, peer, ratio: float, replica=None) -> float | None:
        """Estimated seconds to ``request``'s first token through ``peer`` (its status's wait, the round trip, the
        requests forwarded there since that status spread over its available replicas, and the prefill of the
        part of the prompt not matched (``ratio``) in the regional snapshot); None when the peer gave no wait or
        its round trip is not measured yet. Prefill is priced at ``replica``'s measured rate when given (the local
        replica it is compared with: the same model, so the same rate there, and a measured rate holds a step's
        fixed cost that the configured one lacks), else at ``prefill_tokens_per_s``."""
        if peer.wait_s is None or peer.rtt_s is None:
            return None
        queued = peer.sent_since_probe * self.options.default_prompt_tokens / max(1, peer.available_replicas)
        return (peer.rtt_s + peer.wait_s + self.wait.prefill_s(queued, replica)
                + self.wait.prefill_s(prompt_tokens(request) * (1.0 - ratio), replica))

    def forward_queued(self, request, now, peers):
        """The peer whose queue head is youngest relative to ``request``'s age, by more than the round trip, the
        prefill lost (local match ratio less the peer's snapshot match, at ``prefill_tokens_per_s``) and
        ``queue_forward_margin_ms``; None when none is (or none reports its queue age and dispatch rate)."""
        # Global first come, first served, approximately: a peer whose queue head is younger than this request
        # (by more than the round trip, the prefix cache lost and the margin) would serve younger requests first.
        # The forwarded request keeps its age there (Request.waited_s), so it queues ahead of them. Requests
        # already forwarded since the peer's status sit ahead too, for sent_since_probe / dispatch_rate seconds.
        age = now - request.queued_since
        tokens = prompt_tokens(request)
        local = self._replica_match(request, self._replicas)
        local_ratio = local.ratio if local.targets and local.ratio >= self.options.match_threshold else 0.0
        targets, ratio = self._matched(request, self.snapshot_trie, {p.region for p in peers})
        best, best_gain = None, 0.0
        for p in sorted(peers, key=lambda p: p.region):
            if p.queue_age_s is None or not p.dispatch_rate or p.rtt_s is None or p.probed_at is None:
                continue
            ahead_s = p.queue_age_s + (now - p.probed_at) + p.sent_since_probe / p.dispatch_rate
            lost = max(0.0, local_ratio - (ratio if p.region in targets else 0.0))
            gain = (age - ahead_s - p.rtt_s - self.wait.prefill_s(tokens * lost)
                    - self.options.queue_forward_margin_ms / 1e3)
            if gain > best_gain:
                best, best_gain = p, gain
        return best

    def prefer_peer(self, request, replica, peers):
        local_s = self._local_costs(request, [replica])[replica.id]
        margin_s = self.options.forward_margin_ms / 1000.0
        targets, ratio = self._matched(request, self.snapshot_trie, {p.region for p in peers})
        best, best_s = None, local_s - margin_s
        for p in sorted(peers, key=lambda p: p.region):
            # Both sides at the local replica's rate: pricing the local prefill at its measured rate (TTFT / prompt
            # tokens, which holds each step's fixed cost) and a peer's at the configured one sent short prompts
            # abroad with every local queue empty (43% of Arena's requests forwarded under symmetric load).
            cost = self.peer_cost_s(request, p, ratio if p.region in targets else 0.0, replica)
            if cost is not None and cost < best_s:
                best, best_s = p, cost
        return best


def _queue_shorter_than_batch(replica) -> bool:
    """True when ``replica``'s batch is bounded only by its learned admission capacity (skylb/core/capacity.py)
    and fewer requests wait for it than that capacity, so a request pushed there starts within about one turnover
    of the batch. False for an engine that reports its slots (llama.cpp) or a replica with ``max_concurrency``:
    those bounds are stated, not estimated, and are never exceeded."""
    if replica.slots is not None or replica.max_concurrency is not None or replica.running is None:
        return False
    limit = replica.capacity.limit
    # The probe's running and waiting, plus what this balancer sent since; its own in-flight count never errs low.
    waiting = max(replica.running + replica.pending + replica.sent_since_probe, replica.outstanding) - limit
    return waiting < limit


def _faster(theirs, mine, ratio: float) -> bool:
    """True when rates ``theirs`` are at least ``ratio`` x faster than ``mine`` (skylb/core/rates.py ModelRates):
    in time per token (prompt and output together), and in decode time per output token where both measured it.
    The first alone follows the mix of requests each replica happened to serve (a long prompt makes a replica look
    fast per token, a long answer slow): identical replicas serving the conversation trace at real prompt lengths
    differed by more than 1.5x, and requests waited for the "faster" one while a replica had room (simulated, P90
    TTFT 26.4 s against 17.9 s without holding). Decode per output token does not depend on the mix."""
    if theirs.time_per_token_s * ratio > mine.time_per_token_s:
        return False
    if theirs.decode_s_per_token is not None and mine.decode_s_per_token is not None:
        return theirs.decode_s_per_token * ratio <= mine.decode_s_per_token
    return True
