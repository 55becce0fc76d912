"""Placement by estimated time to first token among local replicas with room (the default profile's picker).

For each candidate: its estimated wait (skylb/core/estimate.py WaitModel: prompt tokens queued ahead of it, at its
measured prefill rate once measured, else the configured one) plus the prefill of the part of the prompt it is not
expected to have cached. A prefix match of ratio m (at least the locality's threshold; the replica trie's match at
the deepest node) saves m x prompt tokens of prefill; that is how locality is weighed against queueing. The load
guard (``abs_threshold``, ``rel_threshold``: SGLang's imbalance test, scoring.loads_imbalanced) wins when outstanding
requests are imbalanced; for a cache hit (some candidate holds at least the locality's threshold of the prompt) only
past ``hit_abs_threshold`` and ``hit_rel_threshold`` when those are given (the default profile's option
``cache_hit_guard``), unless, with ``burst_aware``, a holder is still prefilling another request that shares the
matched prefix and did not find all of it cached (then the load guard's). With the tight guard for every request, a
tenant's next request went to the least loaded replica whenever its holder had 8 more in flight, which prefilled the
whole prefix again there and kept a second copy (150 tenants behind 6,000-token prefixes at 1x: each tenant on 1-4
replicas, 68% hits, where one SGLang router kept every tenant on one replica); a loose guard for every hit piles a
tree's branches onto one replica instead, whose batch then decodes slowest. A burst (requests behind one prefix that
arrive together, which the holder is still computing) is the tree's case; a prefix reused one request after another
is the tenant's (bench/results/cache_hit_guard.md), also while the previous request, which found the prefix cached,
prefills its own question (bench/results/real_hit_guard.md: against counting every request that shares the prefix,
every matrix cell). Among candidates left tied (estimates within a millisecond), those with the best prefix match,
then, with ``tie_break`` "estimated-wait", OllamaRouter's least estimated wait from measured time per token
(estimated_wait.py), then least load: a slower replica gets less of the work than a faster one.

Holdings (``holdings``). "deepest": the prefix priced as cached is the deepest match's, on the replicas holding
that node, and nothing on the others (below the locality's threshold nothing anywhere). "own": while every
candidate has room (nothing waiting in its engine at its probe, its KV cache below ``holdings_kv_below`` full),
each replica is priced with its own deepest node along the prompt (a replica holding a shorter prefix, such as a
tree's parent prompt on the replica of the parent's sibling, is credited with it), less what a holder is still
computing for another request of the same prefix (the ``_burst`` test): an engine that admits the request at once
batches its prefill beside that other one's and computes the shared part again (SGLang's and vLLM's prefix caches
share only blocks already computed when a step is scheduled). With a request waiting in an engine or a KV cache
filling up, a request sent to the holder waits and finds the prefix computed by then, and blocks shared on one
replica are what keep the cache from evicting, so the deepest match's pricing holds there.

Speed classes (``speed_ratio``). The load guard counts requests in flight, which on mixed hardware is not load: a
replica 4x slower than its neighbours runs fewer requests because it gets fewer, and the guard then sends it the next
one whatever the estimate says, which lands that request in the deployment's slowest tail. With ``speed_ratio`` r
the guard balances only over the candidates not measured r times slower than the fastest measured one, in time per
token and in decode time per output token both (``hold_for_faster.faster``'s test, each against the fastest
measured figure; decode per output token does not depend on the mix of requests a replica happened to serve, so
identical replicas seldom split: under saturation a replica's decode time follows its batch, and 5 of the 32
simulated matrix cells without mixed hardware moved by 0.8-1.6%, bench/results/speed_classes.md); a slower replica
is then taken when the estimate, at its measured rates, prefers it. Unmeasured replicas are balanced as before.

Generation stalls (``stall_weight``). An engine step that prefills a prompt also decodes one token of every
request in its running batch, so each of them waits the prefill's time for its next token (Sarathi-Serve, Agrawal
et al., OSDI 2024, section 3.2 "generation stalls"; chunked prefill spreads the same time over several steps). The
estimate above prices only the request's own first token; with ``stall_weight`` w > 0 the pick adds w x (the batch's
requests) x (the request's uncached prefill time there) to each candidate, so a prompt goes where it stalls the
fewest decodes unless a cache hit saves more. The forwarding rule still compares first-token estimates alone.
On mixed hardware (with ``speed_ratio``) the stall term may not take a request to a slower class of replica when the
estimate alone prefers a faster one: a slow replica's batch is smaller (it gets fewer requests), so its stall term
was lower, and the term sent requests there that then waited 3-4 times longer for their first token (simulated,
replicas 4x apart at half load: 12% of the requests, P90 TTFT 0.55 s against 0.17-0.32 on the fast ones). Its
measured prefill rate does not tell: a replica that is never alone under load has none (the wait model then prices
it by its pace, skylb/core/estimate.py). The class here is told by pace measured from every streamed response (time
per token and the inter-token latency, ``ModelRates.itl_s``) at ``PACE_CLASS_RATIO`` (skylb/core/estimate.py),
wider than the load guard's ratio because a replica's inter-token latency also grows with its batch.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from skylb.core.estimate import PACE_CLASS_RATIO, WaitModel, pace_classes_apart, pace_slowdowns, prompt_tokens
from skylb.core.plugins.estimated_wait import pick_by_estimated_wait
from skylb.core.plugins.hold_for_faster import faster
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.scoring import least_loaded, loads_imbalanced
from skylb.core.profile import Estimator, Turns
from skylb.core.rates import ModelRates, RateBook
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["EstimatedTTFT", "PrefillEstimate"]

#: Placements remembered per replica for ``burst_aware`` (a replica prefills far fewer at once).
_PLACED_KEPT = 256


class EstimatedTTFT:
    """ReplicaPicker: least estimated seconds to first token (module docstring).

    Args:
        abs_threshold, rel_threshold: the load guard (outstanding requests; scoring.loads_imbalanced).
        hit_abs_threshold, hit_rel_threshold: the guard of a cache hit (None: the load guard's).
        burst_aware: a cache hit whose holder still prefills another request of the same prefix (the router's
            ``ReplicaState.unprefilled`` record) is guarded by the load guard's thresholds, not the hit's.
        holdings: "deepest" or "own", and holdings_kv_below: the KV usage (0-1) below which every candidate must be
            for "own" to apply (module docstring, "Holdings").
        tie_break: "estimated-wait" or "least-load" (module docstring).
        stall_weight: the weight of the generation stall the request's prefill causes the other requests of a
            candidate's batch (module docstring, "Generation stalls"; 0: not priced).
        speed_ratio: the load guard balances only over the candidates no other is measured this many times faster
            than (module docstring, "Speed classes"); None: over all of them.
    """

    def __init__(self, *, wait: WaitModel, locality: PrefixLocality, rates: RateBook, turns: Turns,
                 abs_threshold: int, rel_threshold: float, tie_break: str = "estimated-wait",
                 hit_abs_threshold: int | None = None, hit_rel_threshold: float | None = None,
                 burst_aware: bool = False, holdings: str = "deepest", holdings_kv_below: float = 0.5,
                 stall_weight: float = 0.0, speed_ratio: float | None = None):
        self.stall_weight, self.speed_ratio = stall_weight, speed_ratio
        self.wait, self.locality, self.rates, self.turns = wait, locality, rates, turns
        self.holdings, self.holdings_kv_below = holdings, holdings_kv_below
        self.abs_threshold, self.rel_threshold, self.tie_break = abs_threshold, rel_threshold, tie_break
        self.hit_abs_threshold = hit_abs_threshold
        self.hit_rel_threshold = rel_threshold if hit_rel_threshold is None else hit_rel_threshold
        self.burst_aware = burst_aware
        # replica id -> its latest placements (request id -> request), weakly held: a request still prefilling is
        # in flight and alive, and a finished one (a prompt may be hundreds of KB) is not kept alive by this
        self._placed: dict[str, weakref.WeakValueDictionary[str, Request]] = {}
        # (request, candidate list, least cost) of the latest pricing: the forwarding rule compares a peer with it
        self._priced: tuple[Request, Sequence[ReplicaState], float] | None = None
        # (request, {replica id: uncached tokens priced}) of the latest pricing by own holdings, for the placement's
        # backlog record (by the deepest match, the record is the decision's kept match, as before)
        self._uncached: tuple[Request, dict[str, float]] | None = None

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Learner: remember ``request`` on ``replica`` while it may still wait for its prefill (``burst_aware``;
        the latest ``_PLACED_KEPT`` per replica: a request still prefilling is among a replica's latest)."""
        if self.burst_aware and replica is not None:
            placed = self._placed.get(replica)
            if placed is None:
                placed = self._placed[replica] = weakref.WeakValueDictionary()
            placed[request.id] = request
            if len(placed) > _PLACED_KEPT:
                del placed[next(iter(placed))]

    def _burst(self, request: Request, holder: ReplicaState, fraction: float) -> bool:
        """True when ``holder`` is still prefilling another request that shares ``request``'s matched prefix and
        did not find all of that prefix cached when it was sent (it is computing part of it now), so the match is
        not a cache hit yet: requests that arrive together behind a new prefix (a tree's branches). Another
        request that found the whole prefix cached (``ReplicaState.unprefilled``: its prompt tokens not expected
        cached) is a prefix reused one request after another, which stays a hit (a tenant's or an agent's next
        request while its previous one prefills its own question)."""
        return self._computed_chars(request, holder, fraction) is not None

    def _computed_chars(self, request: Request, holder: ReplicaState, fraction: float) -> int | None:
        """When ``holder`` is computing part of ``request``'s matched prefix (``fraction`` of its text) for
        another request (``_burst``): the characters of that prefix it has cached already (the least any such
        request found cached); else None."""
        placed = self._placed.get(holder.id)
        if not placed or not holder.unprefilled:
            return None
        matched = int(fraction * len(request.text))  # the matched prefix, characters (the match's ratio of the text)
        head = request.text[:matched]
        held = None
        for rid, uncached in holder.unprefilled.items():
            other = placed.get(rid)
            if other is None or other is request or not other.text.startswith(head):
                continue
            tokens = prompt_tokens(other)
            chars_per_token = len(other.text) / tokens
            # Its cached part in characters, with a token of slack: its uncached tokens were rounded.
            cached = (tokens - uncached) * chars_per_token + chars_per_token
            if cached < matched:
                held = int(cached) if held is None else min(held, int(cached))
        return held

    def cheapest_s(self, request: Request, candidates: Sequence[ReplicaState]) -> float:
        """The least estimated seconds to first token among ``candidates`` (non-empty), the costs of the latest
        ``pick`` when it priced the same request over the same list (the profile passes one list to both)."""
        last = self._priced
        if last is not None and last[0] is request and last[1] is candidates:
            return last[2]
        return min(self._costs(request, candidates)[0])

    def local_costs(self, request: Request, candidates: Sequence[ReplicaState]) -> dict[str, float]:
        """Candidate id -> estimated seconds to its first token (wait + uncached prefill)."""
        costs, _ = self._costs(request, candidates)
        return {c.id: cost for c, cost in zip(candidates, costs)}

    def _costs(self, request: Request, candidates: Sequence[ReplicaState],
               stalls: list[float] | None = None) -> tuple[list[float], list[float]]:
        """Each candidate's estimated seconds to first token and matched prefix fraction, in order (the least of
        them kept for ``cheapest_s``); with ``stalls`` (an empty list), each estimate plus its generation stall is
        appended to it in the same pass (module docstring, "Generation stalls")."""
        fractions = self.locality.fractions(request, candidates, {c.id for c in candidates})
        tokens = prompt_tokens(request)
        held = self._held(request, candidates, fractions)
        uncached = [tokens * (1.0 - f) for f in held] if any(held) else [tokens * 1.0] * len(held)
        costs = self.wait.ttft_among_s(candidates, uncached, stalls, self.stall_weight)
        self._priced = (request, candidates, min(costs))
        self._uncached = (request, {c.id: u for c, u in zip(candidates, uncached)}) if held is not fractions else None
        return costs, fractions

    def _held(self, request: Request, candidates: Sequence[ReplicaState], fractions: list[float]) -> list[float]:
        """The fraction of the prompt priced as cached on each candidate (module docstring, "Holdings"):
        ``fractions`` (the deepest match's, at least the threshold) unless ``holdings`` is "own" and every
        candidate has room (no request waiting in its engine, KV cache below ``holdings_kv_below``); then each
        replica's own match, less what a holder is still computing for another request."""
        if self.holdings != "own" or any(c.pending or (c.kv_usage or 0.0) >= self.holdings_kv_below
                                         for c in candidates):
            return fractions
        held = self.locality.held_fractions(request, candidates)
        if self.burst_aware and any(fractions):
            text = len(request.text)
            for i, (c, f) in enumerate(zip(candidates, held)):
                if f > 0.0 and c.unprefilled and (done := self._computed_chars(request, c, f)) is not None:
                    held[i] = min(f, done / text)
        return held

    def priced_uncached(self, request: Request, replica_id: str) -> float | None:
        """The uncached tokens the latest pricing of ``request`` by own holdings gave ``replica_id`` (None: not
        priced there, or priced by the deepest match)."""
        last = self._uncached
        return last[1].get(replica_id) if last is not None and last[0] is request else None

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The pick among ``candidates`` (non-empty)."""
        stalls = [] if self.stall_weight else None
        if len(candidates) > 1 and loads_imbalanced(candidates, self.abs_threshold, self.rel_threshold):
            guarded = self._guarded(request, candidates)
            if guarded is not candidates and not loads_imbalanced(guarded, self.abs_threshold, self.rel_threshold):
                costs, fractions = self._costs(request, candidates, stalls)  # only slower replicas were less loaded
            elif self.hit_abs_threshold is None:
                return least_loaded(guarded, self.turns.next())
            else:
                costs, fractions = self._costs(request, candidates, stalls)
                top = max(fractions)
                if top <= 0.0 or loads_imbalanced(guarded, self.hit_abs_threshold, self.hit_rel_threshold):
                    return least_loaded(guarded, self.turns.next())
                if self.burst_aware and any(self._burst(request, c, top) for c, f in zip(candidates, fractions)
                                            if f == top):
                    return least_loaded(guarded, self.turns.next())
        else:
            costs, fractions = self._costs(request, candidates, stalls)
        if stalls:
            costs = self._stall_within_class(request, candidates, costs, stalls)
        # Within a millisecond is a tie: spread over the tied ones by load rather than by list order.
        limit = min(costs) + 1e-3
        tied = [c for c, cost in zip(candidates, costs) if cost <= limit]
        if len(tied) > 1 and self.tie_break == "estimated-wait":
            if any(fractions):  # some candidate holds a prefix of it: of the tied, those holding the most
                held = [f for f, cost in zip(fractions, costs) if cost <= limit]
                top = max(held)
                tied = [c for c, f in zip(tied, held) if f == top]
            return least_loaded(pick_by_estimated_wait(self.rates, request, tied), self.turns.next())
        return least_loaded(tied, self.turns.next())

    def _stall_within_class(self, request: Request, candidates: Sequence[ReplicaState], costs: list[float],
                            stalls: list[float]) -> list[float]:
        """``stalls`` (each candidate's estimate plus its generation stall, in the order of ``candidates``; ``costs``
        the estimates alone), with the candidates of a slower class (``PACE_CLASS_RATIO``) set to infinity when
        the least estimate alone is a faster one's (module docstring, "Generation stalls"). Unchanged without
        ``speed_ratio`` or with fewer than two candidates whose pace is measured."""
        if not self.speed_ratio or len(candidates) < 2:
            return stalls
        model = request.model
        # ReplicaRates.for_model written out: one call per candidate was most of this pass at 200 replicas.
        paces = [m if (m := c.rates.models.get(model)) is not None and m.samples and m.time_per_token_s is not None
                 else None for c in candidates]
        if not pace_classes_apart(paces, PACE_CLASS_RATIO):
            return stalls
        slowdowns = pace_slowdowns(paces)
        slow = {c.id for c, x in zip(candidates, slowdowns) if x is not None and x >= PACE_CLASS_RATIO}
        if not slow or candidates[costs.index(min(costs))].id in slow:
            return stalls
        return [math.inf if c.id in slow else s for c, s in zip(candidates, stalls)]

    def _guarded(self, request: Request, candidates: Sequence[ReplicaState]) -> Sequence[ReplicaState]:
        """The candidates the load guard balances over (module docstring, "Speed classes"): with ``speed_ratio``,
        those no candidate is measured ``speed_ratio`` x faster than (in time per token and in decode time per
        output token, each against the fastest measured: ``hold_for_faster.faster``'s test), else all of them
        (the same list object)."""
        ratio = self.speed_ratio
        if not ratio:
            return candidates
        model = request.model
        measured = [(c, r) for c in candidates if (r := c.rates.for_model(model)) is not None
                    and r.decode_s_per_token is not None]
        if len(measured) < 2:
            return candidates
        # The fastest figures measured, each from whichever replica has it: one comparison per candidate, not n^2.
        fastest = ModelRates(time_per_token_s=min(r.time_per_token_s for _, r in measured),
                             decode_s_per_token=min(r.decode_s_per_token for _, r in measured))
        slow = {c.id for c, r in measured if faster(fastest, r, ratio)}
        if not slow:
            return candidates
        return [c for c in candidates if c.id not in slow]


class PrefillEstimate(Estimator):
    """Estimator of the default profile: the wait model's wait, the prompt tokens its prefix match leaves to
    prefill, and (with the predicted-TTFT placement) the figures peers price this balancer with."""

    def __init__(self, wait: WaitModel, locality: PrefixLocality, advertise=None, priced: EstimatedTTFT | None = None):
        self.wait, self.locality, self._advertise, self._priced = wait, locality, advertise, priced

    def estimated_wait_s(self, replica: ReplicaState) -> float | None:
        """Seconds before a new request's prefill starts on ``replica`` (WaitModel.wait_s)."""
        return self.wait.wait_s(replica)

    def uncached_tokens(self, request: Request, replica_id: str) -> int:
        """``request``'s prompt tokens less the fraction matched at ``replica_id`` (the decision's kept match), or
        what the placement's pricing counted uncached there when it priced it."""
        if self._priced is not None and (priced := self._priced.priced_uncached(request, replica_id)) is not None:
            return round(priced)
        fraction = self.locality.matched_fraction(request, replica_id, self.locality.replicas)
        return round(prompt_tokens(request) * (1.0 - fraction))

    def advertised(self, available: Sequence[ReplicaState], replicas: Sequence[ReplicaState]) -> dict:
        """PredictedTTFT.advertised when the placement prices peers by it, else nothing."""
        return self._advertise(available, replicas) if self._advertise is not None else {}
