"""``skylb``: prefix trie + selective pushing on estimated wait, forwarding when a peer is faster (the default).

Builds on the paper's rule (``skylb-paper``, skylb_paper.py) with what measurements on real load showed (the busiest
region's TTFT under the Mooncake trace). The profile, in the order it runs (``skylb`` below; each plugin's module
under skylb/core/plugins/ gives its source and its measurements):

==========================  =========================================  ================================================
stage                       plugin                                     what it does
==========================  =========================================  ================================================
filter                      ``engine_pressure.EnginePressure``         no request to a prefill backlog or a full KV cache
per-request filter          ``kv_admission.KVAdmission``               replicas whose KV cache can admit it, when any
first rule                  ``spread_cap.SpreadCap``                   a burst behind one prefix spread, region light
first rule                  ``sibling_holder.ForwardToSiblingHolder``  a prefix a sibling's replica holds goes there
first rule                  ``push_to_holder.PushToPrefixHolder``      a cache hit goes into its holder's full batch
first rule                  ``home_new_prefix.HomeNewPrefix``          a new prefix group to a less loaded region
local picker                ``estimated_ttft.EstimatedTTFT``           least estimated TTFT, load guard, tie-breaks
then rule                   ``prefer_peer.PreferFasterPeer``           a peer with room that is faster by a margin
then rule                   ``hold_for_faster.HoldForFaster``          wait for a faster busy replica (mixed hardware)
peer picker                 ``prefix_match.SnapshotMatch``             the peer holding the prefix, else most room
no-room rule                ``forward_queued.ForwardQueued``           first come, first served across regions
queue order                 ``prefix_lookahead.PrefixLookahead``       a free replica takes a request it holds
learner                     ``prefix_locality.PrefixLocality``         the replica and regional snapshot tries, and
                                                                       ``kv_locality`` where KV-cache events are live;
                                                                       with a sibling, the prefixes it shares
==========================  =========================================  ================================================

With ``placement: predicted-ttft`` the first rule is ``predicted_ttft.PredictedTTFTPlacement`` instead, which prices
every candidate by one cost and settles every placement (without the sibling rule). In words:

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
  (``balance_*_threshold``) still wins when outstanding requests are imbalanced; for a cache hit only past the push's
  thresholds, unless its holder is still computing the same prefix for another request (``cache_hit_guard``
  "serial": a prefix reused one request after another stays on its replica, a burst behind a new prefix is spread).
* Generation stalls (``stall_weight``): a prompt's prefill holds up the next token of every request decoding on
  its replica (Sarathi-Serve section 3.2), so the local pick adds 0.3 x the replica's batch x the prompt's
  uncached prefill time there to each estimate: a prompt goes where it stalls fewer decodes unless a cache hit
  saves more. The forwarding rule compares first-token estimates alone.
* Speed classes (``speed_classes``): the load guard balances requests in flight only over the replicas no other is
  measured ``faster_ratio`` x faster than (time per token and decode per output token), so on mixed hardware a slow
  replica running fewer requests is not sent the next one by the count; the estimate, at its measured rates, still
  may.
* Measured speed (OllamaRouter; skylb/core/rates.py): once a replica's responses have been measured, its own prefill
  seconds per token replace ``prefill_tokens_per_s`` in its wait and prefill estimates (``measured_prefill``), and
  among candidates left tied (estimates within a millisecond, equal prefix matches) the one with the least
  estimated wait from measured time per token goes first (``tie_break``: OllamaRouter's Algorithm 1,
  measured_wait.py ``pick_by_estimated_wait``), so a slower replica gets less of the work than a faster one.
* Forwarding on the estimate: a request goes to an available peer when that peer's estimated wait (from its status),
  plus the measured round trip, plus the prefill of the part its snapshot match does not cover (at the local
  replica's rate, so both sides are priced alike), beats the best local replica's estimate (the cheapest with room,
  ``forward_against``, whichever replica the load guard picked) by ``forward_margin_ms``, even when a local
  replica has room. With no local replica
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
* Prefix locality across siblings (balancers of one region; skylb/core/held_prefixes.py, plugins/sibling_holder.py):
  a balancer with a sibling puts in its status the 64-bit hashes of the last two chunk boundaries of each prompt it
  placed on its own replicas lately (the newest 1,024: at most about 9.2 KiB per status), and keeps what each
  sibling sent (only what is new since the status before; at most 16,384 hashes per sibling, least recently shared
  evicted first). A request whose prefix (at least ``match_threshold``) a sibling holds deeper than any local
  replica goes to that sibling when it has room and either no local replica has room or its status's wait plus the
  round trip plus the prefill of the part it does not hold beats the cheapest local replica's estimate (no
  ``forward_margin_ms``: the round trip is the region's own, and a second prefill is a second copy of the prefix in
  the region's caches). The sibling routes it to the holding replica by its own trie (one hop). So a session whose
  turns DNS or a Service spreads over the region's balancers stays on one replica; a prefix sessions share only in
  part (a system prompt) is not shared and is cached once per sibling's replica. Without a sibling nothing is
  recorded, sent or matched, and every other rule is unchanged.
* Cache hits go to their replica (``push_to_prefix_holder``): a request whose prefix a local replica holds (replica
  trie, at least ``match_threshold``) while no replica with room holds it is pushed into the holder's full batch, as
  SGLang's cache-aware router (sgl-router ``cache_aware``) sends every matched request, unless a batch's worth
  already waits there, the holder's bound is stated rather than learned (llama.cpp's slots, ``max_concurrency``),
  or the local replicas' outstanding requests are imbalanced (``holder_balance_*_threshold``, SGLang's 64 and 1.5).
  Selective pushing sent such a hit to a replica with room, which prefilled the whole prefix and kept a second
  copy of it; under load those copies evicted other prefixes, misses grew the load, and the load made more misses
  (150 tenants behind 6,000-token prefixes at 2x: each tenant's requests spread over 3.3 replicas and 67% hits,
  where one SGLang router kept each tenant on one replica for 83%). Requests without a match keep selective pushing.
  The push is priced (``price_push``): when a peer whose region holds the prefix is predicted faster than the wait
  for a place in the holder's batch, the request goes there instead (a peer without the prefix is not asked: its
  copy of the prefix would cost the prefill that the push saves, and under load those copies spread as above).
* New prefix groups are homed where the load is (``home_new_prefixes``): a request no region holds a prefix of
  (a new conversation, tenant or tree) goes to the least loaded peer with room, although a local replica has room,
  while at least half the local replicas are full and the local load per replica is above 1.5x that peer's plus 4.
  Its later requests follow it. Every other rule places one request at a time by its time to first token and kept
  each group in its clients' region, so a region whose clients outnumber its replicas grew its groups into full
  batches (regions of 2, 4 and 6 replicas, 150 tenants at 2x: P90 TTFT 1.57 s against one SGLang router's 0.48;
  0.81 s with this rule).
* A burst behind one prefix is spread while the region is light (``spread_cap_below_occupancy``): a request whose
  prompt two or more local replicas hold goes, while the region's mean batch occupancy is below 0.5, only to a
  replica with room that this balancer has sent nothing since its latest probe (else it waits for the next probe),
  so a tree's branches do not queue behind each other's prefill on the one replica the estimate, read between
  probes, keeps finding cheapest (skylb/core/plugins/spread_cap.py).
* A prompt that does not fit in a replica's free KV cache (skylb/core/estimate.py ``kv_wait_s``: its uncached
  tokens against capacity x (1 - usage), where the engine reports both) is priced the replica's measured service
  time more: the engine would keep it waiting however few requests run. When some local replicas can admit it
  now and others cannot (``kv_admission``: its uncached prompt, plus on SGLang the output tokens the engine
  reserves, against the free KV cache, which on SGLang also leaves out what the engine keeps reserved for its
  running requests' outputs), only those that can are candidates: an engine that cannot admit the request also
  stops admitting the requests behind it (SGLang until a running request finishes, vLLM's first-come queue).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from skylb.core.estimate import PACE_CLASS_RATIO, WaitModel
from skylb.core.plugins.engine_pressure import EnginePressure
from skylb.core.plugins.estimated_ttft import EstimatedTTFT, PrefillEstimate
from skylb.core.plugins.forward_queued import ForwardQueued
from skylb.core.plugins.hold_for_faster import HoldForFaster
from skylb.core.plugins.home_new_prefix import HomeNewPrefix
from skylb.core.plugins.kv_admission import KVAdmission
from skylb.core.plugins.predicted_ttft import PredictedTTFTPlacement
from skylb.core.plugins.prefer_peer import PreferFasterPeer
from skylb.core.plugins.prefix_lookahead import PrefixLookahead
from skylb.core.plugins.prefix_match import SnapshotMatch
from skylb.core.plugins.push_to_holder import PushToPrefixHolder
from skylb.core.plugins.sibling_holder import ForwardToSiblingHolder
from skylb.core.plugins.spread_cap import SpreadCap
from skylb.core.policies.base import OPTIONS_CONFIG, register
from skylb.core.policies.skylb_paper import SkyLBPaperOptions, prefix_locality
from skylb.core.predicted_ttft import LearningRateBook, PredictedTTFT
from skylb.core.prefill_model import PrefillLine
from skylb.core.profile import Profile, Turns
from skylb.core.rates import RateBook

__all__ = ["SkyLBOptions", "skylb"]


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class SkyLBOptions(SkyLBPaperOptions):
    """Options of ``skylb``: those of ``skylb-paper`` (SkyLBPaperOptions) and:

    Attributes:
        prefill_tokens_per_s: one replica's prefill throughput, tokens/s (default: Llama-3.1-8B on an L4, about
            2000; set it for your engine and GPU: it converts token backlogs and cached prefixes to seconds).
        backlog_budget_tokens: a replica with this many of this balancer's prompt tokens not yet prefilled takes
            no more (0: no such clause).
        kv_high_watermark: a replica whose engine reports KV usage at or above this fraction takes no more (1: off).
        kv_admission: among local replicas, only those whose KV cache can admit the request now, when any can
            (skylb/core/plugins/kv_admission.py; False: every replica with room, the rule before).
        untried_last: a free slot above a batch whose place above was left untried by a turnover goes after the
            sure free slots while that batch turns over slower than ``settle_s`` (a request sent there may wait a
            whole turnover: skylb/core/capacity.py ``untried_at``), and a sure slot on a replica measured of a
            slower pace class does not go before a doubtful one (False: the rule before;
            bench/results/untried_place.md).
        forward_margin_ms: a peer must beat the best local estimate by this much to get a request a local replica
            could take, ms.
        forward_against: the local estimate a peer is compared with: "cheapest" (default): the least of the local
            pick's and the cheapest local replica's with room; "pick": the local pick's alone (the rule before: past
            the load guard the pick is the least loaded replica, and one holding a burst's other requests sent
            12-20% of closed-loop trees' requests abroad with an as fast local replica free). Every matrix cell,
            "cheapest" against "pick" (bench/results/forward_against.md): P90 TTFT geometric mean 0.996
            (development split) and 0.979 (validation), throughput 1.004 and 1.003, no cell's throughput lower by
            more than 1%.
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
            divided by this (identical replicas differ by noise, and then nothing is held); also the ratio of
            ``speed_classes``.
        placement: "estimate" (default): the rule above (pick by estimate, the load guard, ``prefer_peer``,
            ``forward_queued``); "predicted-ttft": every candidate (local replica with room, push into a full
            batch, peer, holding here) priced by one cost, the predicted time to first token
            (skylb/core/plugins/predicted_ttft.py, skylb/core/cost.py). Not yet the default: it wins on the
            unsaturated cells measured so far but loses P90 on the saturated Mooncake trace at 2x (README).
        prefill_fixed_ms: the prefill model's prior fixed part per request, ms (with ``prefill_tokens_per_s``, the
            prior every replica's fitted line starts from; default 50: about one engine step's weight read, 53.5
            ms for Llama-3.1-8B on an L4).
        push_to_prefix_holder: push a cache hit into its holder's full batch (above).
        price_push: price that push (the wait for a place in the holder's batch, from its measured service time,
            plus its estimate) against the peers whose region holds the prefix, and forward to one that beats it by
            ``forward_margin_ms`` (skylb/core/plugins/push_to_holder.py).
        holder_balance_abs_threshold, holder_balance_rel_threshold: no push while the local replicas' outstanding
            requests differ by more than abs and the most loaded has more than rel x the least (SGLang's test and
            defaults, 64 and 1.5: chosen on the development split, where the ``balance_*`` pair below (8) kept the
            150-tenant workload at 2x at 4.1 s P90 instead of 0.5 s).
        cache_hit_guard: the load guard of a cache hit (some local replica with room holds at least
            ``match_threshold`` of the prompt). "serial" (default): the push's thresholds (``holder_balance_*``,
            SGLang's 64 and 1.5) unless a holder is still prefilling another request of the same prefix that did
            not find it all cached, then the ``balance_*`` pair: a prefix reused one request after another (a
            tenant's or an agent's long shared prompt) stays on the replica holding it, while requests that arrive
            together behind a prefix being computed (a tree's branches) are spread as any request is
            (bench/results/real_hit_guard.md). "holder": the push's thresholds always (piles a tree's branches
            onto one replica: closed-loop trees at 0.5x-2x lost 3-17% of their throughput). "balance": the
            ``balance_*`` pair, as for every request (the rule before: a tenant's next request went to the least
            loaded whenever its holder had 8 more in flight, and prefilled the whole prefix again there). Every
            matrix cell, "serial" against "balance" (bench/results/cache_hit_guard.md): P90 TTFT geometric mean
            0.947 (development split) and 0.965 (validation), throughput 0.997 and 0.997; 150 tenants at 1x-2x
            0.79-0.88x, tool agents at 2x-4x 0.44-0.82x; closed-loop trees -1% to -5% throughput.
        ttft_balance_abs_threshold: with ``predicted-ttft``, the load guard's absolute threshold (outstanding
            requests; the relative one is ``balance_rel_threshold``): past it only the least loaded local replica is
            priced. The cost is the time to first token, which does not see that a larger batch decodes slower for
            all in it, so without a guard replicas holding popular prefixes took ever more (closed-loop Tree of
            Thoughts: throughput -17%). 16 was chosen on the development split (seeds 0-1; 8 lost the low-reuse
            cell's gain, 32 lost 3-8% throughput on the closed-loop workloads): bench/results/predicted_ttft.md.
        trie_kv_bound: bound each local replica's records in the replica trie by its engine's KV-cache capacity
            (the tokens its probe reports, x 4 characters per token: skylb/core/estimate.py CHARS_PER_TOKEN), its
            oldest records evicted past it (prefix_trie.py ``set_target_bound``), so the trie forgets what the
            replica's cache must have dropped (SGLang's router bounds each worker's tree the same way). Where the
            prefixes in play exceed the replicas' KV memory (150 tenants behind 750-token prefixes, KV caches of
            8,192 tokens: bench/sim/kv_routing.py) the unbounded trie kept steering tenants to replicas that had
            evicted them (P90 TTFT 5.1 s at 1x; 0.58 s bounded); where they fit, nothing is evicted and nothing
            changes. Every matrix cell (bench/results/trie_kv_bound.md): P90 TTFT geometric mean 0.998 (development
            split) and 0.993 (validation), throughput 0.999 and 0.999. Off in ``skylb-paper`` (the prototype's
            trie).
        holdings: the prefix the estimate prices as cached on each replica (skylb/core/plugins/estimated_ttft.py,
            "Holdings"): "deepest" (default), the deepest match's on its holders and nothing elsewhere; "own", while
            every local replica with room has nothing waiting and a KV cache below ``holdings_kv_below``, each
            replica's own match, less what a holder still computes for another request of the prefix. Not the
            default: every development cell, seeds 0-2 (bench/results/own_holdings.md), closed-loop trees at
            0.5x-4x P90 TTFT 0.85-0.93x, but tot@4x 1.33x and tot@5x 1.22x, P90 geometric mean 1.001, throughput
            0.996.
        stall_weight: the weight of the generation stall a prompt's prefill causes the requests decoding on a
            candidate (skylb/core/plugins/estimated_ttft.py, "Generation stalls"), added to its estimate in the local
            pick (0: not priced). 0.3 chosen among 0.1, 0.3 and 1 on the development split
            (bench/results/generation_stalls.md): against 0, P90 TTFT geometric mean 0.984 and throughput 1.016
            over every cell, seeds 0-2 (validation, seeds 3-4: 1.011 and 1.012); closed-loop trees 2-5.5% more
            throughput, P90 1.02-1.12x below saturation and 0.65-0.68x at tot@5x; the 150 tenants at 2x 0.91x
            (development) but 1.61x (validation).
        speed_classes: the load guard (``balance_*``, ``holder_balance_*``) balances only over the candidates no
            other is measured ``faster_ratio`` x faster than, in time per token and in decode time per output token
            (skylb/core/plugins/estimated_ttft.py, "Speed classes"); False: over all of them by count, whatever
            their speed. Every matrix cell (bench/results/speed_classes.md): P90 TTFT geometric mean 0.992 on both
            splits, throughput 1.001; replicas of two speeds 4x apart at 0.5x 0.76x / 0.78x P90 (development /
            validation), at 1x 0.92x / 0.95x, at 1.5x 1.04x / 1.04x; identical replicas within 1-2%. The same
            option keeps the stall term to the fastest class and prices a never-measured replica of a slower class
            at its measured slowdown (``PACE_CLASS_RATIO``, skylb/core/estimate.py; bench/results/stall_classes.md).
        home_new_prefixes: a request that starts a new prefix group (no local replica and no peer's region holds
            ``match_threshold`` of its prompt) goes to the least loaded peer with room, although a local replica has
            room, when at least ``home_busy_fraction`` of the local replicas are full and the local mean load per
            replica is above ``home_load_ratio`` x that peer's (its status's ``load_per_replica``) +
            ``home_load_slack`` (skylb/core/plugins/home_new_prefix.py). The group's later requests follow it, so a
            region whose clients outnumber its replicas stops growing groups into its full batches. Measured
            (bench/results/home_new_prefix.md, the matrix's 36 cells): on regions of 2, 4 and 6 replicas P90 TTFT
            geometric mean 0.949, throughput +0.6% (150 tenants at 2x 1.57 -> 0.81 s, tool agents at 1x 0.99 ->
            0.39 s, two speeds at 1x 0.88 -> 0.63 s); on the matrix's even regions 0.996 and +0.1% (development,
            seeds 0-2; Mixed Tree at 8x 0.81x; two speeds at 0.5x 1.18x, 0.27 -> 0.32 s: at low load the round
            trip is most of a TTFT), 0.998 and +0.1% (validation, seeds 3-4).
        home_load_ratio, home_load_slack, home_busy_fraction: the thresholds above (1.5, 4 requests per replica,
            0.5). Without the busy fraction (0) the uneven regions gain more (13 cells: 0.853 against 0.895 with it)
            but two speeds at 0.5x lose 1.38x on even ones: every request of that workload starts a new group, and at low load each one homed
            abroad only pays the round trip.
        spread_cap_below_occupancy: while the region's mean batch occupancy ((running + pending + sent since the
            probe) / learned admission limit, over its usable replicas) is below this, a request whose prompt two or
            more local replicas hold goes only to a replica with room that this balancer sent nothing since its
            latest probe, else waits here for the next probe (skylb/core/plugins/spread_cap.py: a tree's branches
            are spread instead of queued behind each other's prefill on their holder). 0: off. 0.5 chosen among 0.5
            and 0.7 and no gate on the development split and judged on the validation split and with first-come
            engines (bench/results/option_sweep.md): P90 TTFT geometric mean 0.989 / 0.994 / 0.989, throughput
            0.996-0.997, check 1 20 / 22 / 19 cells against 20 / 22 / 18 without it. Only with ``placement:
            estimate``.
        spread_cap_delta: another replica's holding counts toward "two or more hold it" when within this fraction
            of the prompt of the best holding (0.7).
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
    kv_admission: bool = True
    untried_last: bool = True
    forward_margin_ms: float = Field(50.0, ge=0)
    default_prompt_tokens: int = Field(512, ge=1)
    queue_forward_margin_ms: float = Field(2000.0, ge=0)
    queue_lookahead: int = Field(64, ge=0)
    max_bypass: int = Field(64, ge=0)
    tie_break: Literal["estimated-wait", "least-load"] = "estimated-wait"
    measured_prefill: bool = True
    placement: Literal["estimate", "predicted-ttft"] = "estimate"
    push_to_prefix_holder: bool = True
    price_push: bool = True
    holder_balance_abs_threshold: int = Field(64, ge=0)
    holder_balance_rel_threshold: float = Field(1.5, ge=1)
    prefill_fixed_ms: float = Field(50.0, ge=0)
    ttft_balance_abs_threshold: int = Field(16, ge=0)
    cache_hit_guard: Literal["serial", "holder", "balance"] = "serial"
    forward_against: Literal["cheapest", "pick"] = "cheapest"
    trie_kv_bound: bool = True
    holdings: Literal["own", "deepest"] = "deepest"
    holdings_kv_below: float = Field(0.5, ge=0, le=1)
    stall_weight: float = Field(0.3, ge=0)
    speed_classes: bool = True
    home_new_prefixes: bool = True
    home_load_ratio: float = Field(1.5, gt=1)
    home_load_slack: float = Field(4.0, ge=0)
    home_busy_fraction: float = Field(0.5, ge=0, le=1)
    spread_cap_below_occupancy: float = Field(0.5, ge=0)
    spread_cap_delta: float = Field(0.7, ge=0, le=1)


def skylb(options: SkyLBOptions) -> Profile:
    """The default profile (module docstring's table) configured by ``options``."""
    o = options
    turns, loc = Turns(), prefix_locality(o)
    wait = WaitModel(prefill_tokens_per_s=o.prefill_tokens_per_s, default_prompt_tokens=o.default_prompt_tokens,
                     measured=o.measured_prefill, pace_class_ratio=PACE_CLASS_RATIO if o.speed_classes else None)
    predicted = o.placement == "predicted-ttft"
    ttft = PredictedTTFT(wait=wait, prior=PrefillLine(o.prefill_fixed_ms / 1e3, 1.0 / o.prefill_tokens_per_s),
                         forward_margin_s=o.forward_margin_ms / 1e3, kv_high_watermark=o.kv_high_watermark,
                         queue_margin_s=o.queue_forward_margin_ms / 1e3) if predicted else None
    rates = LearningRateBook(ttft) if predicted else RateBook()
    hold = HoldForFaster(rates, o.faster_ratio) if o.hold_for_faster else None
    local = EstimatedTTFT(wait=wait, locality=loc, rates=rates, turns=turns, abs_threshold=o.balance_abs_threshold,
                          rel_threshold=o.balance_rel_threshold, tie_break=o.tie_break,
                          hit_abs_threshold=o.holder_balance_abs_threshold if o.cache_hit_guard != "balance" else None,
                          hit_rel_threshold=o.holder_balance_rel_threshold, burst_aware=o.cache_hit_guard == "serial",
                          holdings=o.holdings, holdings_kv_below=o.holdings_kv_below,
                          stall_weight=o.stall_weight, speed_ratio=o.faster_ratio if o.speed_classes else None)
    if predicted:
        placement = PredictedTTFTPlacement(ttft=ttft, locality=loc, turns=turns, hold=hold,
                                           abs_threshold=o.ttft_balance_abs_threshold,
                                           rel_threshold=o.balance_rel_threshold,
                                           default_prompt_tokens=o.default_prompt_tokens)
        first, then, no_room, learners = (placement,), (), None, (placement, loc)
    else:
        prefer = PreferFasterPeer(estimate=local, locality=loc, wait=wait, forward_margin_s=o.forward_margin_ms / 1000.0,
                                  default_prompt_tokens=o.default_prompt_tokens,
                                  against_cheapest=o.forward_against == "cheapest")
        push = PushToPrefixHolder(loc, turns, abs_threshold=o.holder_balance_abs_threshold,
                                  rel_threshold=o.holder_balance_rel_threshold,
                                  escape=prefer if o.price_push else None, estimate=local)
        sibling = ForwardToSiblingHolder(locality=loc, estimate=local, prefer=prefer,
                                         push_when_busy=o.push_to_prefix_holder)
        first = (sibling, push) if o.push_to_prefix_holder else (sibling,)
        if o.spread_cap_below_occupancy > 0:  # first: it narrows the local candidates every other rule sees
            first = (SpreadCap(loc, below_occupancy=o.spread_cap_below_occupancy, delta=o.spread_cap_delta),) + first
        if o.home_new_prefixes:
            first += (HomeNewPrefix(loc, ratio=o.home_load_ratio, slack=o.home_load_slack,
                                    busy_fraction=o.home_busy_fraction),)
        then = (prefer, hold) if hold is not None else (prefer,)
        no_room, learners = ForwardQueued(loc, wait, o.queue_forward_margin_ms / 1e3), (loc, local)
    estimator = PrefillEstimate(wait, loc, ttft.advertised if predicted else None, local)
    return Profile("skylb", o, local=local, peer=SnapshotMatch(loc), filters=(EnginePressure(
                       backlog_budget_tokens=o.backlog_budget_tokens, kv_high_watermark=o.kv_high_watermark),),
                   admission=KVAdmission(estimator.uncached_tokens) if o.kv_admission else None,
                   first=first, then=then, no_room=no_room,
                   queue=PrefixLookahead(lambda: loc.replica_trie, o.match_threshold), lookahead=o.queue_lookahead,
                   max_bypass=o.max_bypass, learners=learners, rates=rates,
                   estimator=estimator, untried_last=o.untried_last,
                   tries=(loc.replica_trie, loc.snapshot_trie))


register("skylb", SkyLBOptions, skylb)
