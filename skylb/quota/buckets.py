"""Token buckets and concurrency counts behind quotas: the interface every backend implements, and the in-process
one (one balancer, or each balancer enforcing its region's share).

A request draws on several buckets at once (its tenant's limits and its model's: ``Quotas.limits_for``). ``acquire``
is all or nothing: every bucket has room, then every one is charged; else nothing is, and the answer says how long
until the tightest bucket will have room (LLM-Load-Balancer's "minimal wait": the token refill for tokens and requests;
a slot's release is not predictable from the bucket alone, so ``wait_s`` is None for it and the caller estimates).

Bucket arithmetic (LLM-Load-Balancer, "Iteration 1"): a bucket starts full, refills continuously at ``per_minute / 60``
per second up to ``per_minute``; a charge larger than the whole bucket is admitted when the bucket is full (it is cut to
the capacity, so a huge request is slow, never impossible). Units: tokens, requests, seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from skylb.quota.demand import BucketDemand
from skylb.quota.limits import Limit

__all__ = ["Grant", "LimitBackend", "LocalLimits", "BucketState"]


@dataclass(frozen=True)
class Grant:
    """The answer of ``acquire``.

    Attributes:
        ok: True when every bucket was charged (the caller must ``release`` once the request ends).
        key: when not ok, the bucket that refused (``tenant/<t>/<m>`` or ``model/<m>``); reason: which of its
            limits ("tokens_per_minute", "requests_per_minute", "max_concurrent").
        wait_s: when not ok, seconds until that bucket refills enough; None when the refusal is a concurrency cap
            (it frees when a request ends, which the bucket cannot predict).
    """

    ok: bool
    key: str | None = None
    reason: str | None = None
    wait_s: float | None = None


class LimitBackend(Protocol):
    """Where bucket levels live: this process (LocalLimits) or Redis shared by every balancer."""

    async def acquire(self, buckets: Sequence[tuple[str, Limit]], tokens: int, now: float) -> Grant:
        """Charge ``tokens`` tokens, one request and one concurrent slot to every bucket, or none (see Grant)."""

    async def release(self, buckets: Sequence[tuple[str, Limit]], now: float, *, refund_tokens: int = 0) -> None:
        """A request admitted by ``acquire`` on ``buckets`` ended: free its slot; give back ``refund_tokens``
        (charged but not used: an abandoned lease, a smaller answer than estimated)."""

    def levels(self) -> dict[str, dict[str, float]]:
        """Per bucket key: ``tokens``, ``requests`` (levels now, as last computed) and ``in_flight`` (metrics)."""


@dataclass
class BucketState:
    """One bucket key's levels at ``updated_at`` (s)."""

    tokens: float
    requests: float
    in_flight: int
    updated_at: float

    def refill(self, limit: Limit, share: float, now: float) -> None:
        """Refill both buckets for the time since ``updated_at``, up to their capacity."""
        dt = max(0.0, now - self.updated_at)
        if limit.tokens_per_minute is not None:
            cap = limit.tokens_per_minute * share
            self.tokens = min(cap, self.tokens + dt * cap / 60.0)
        if limit.requests_per_minute is not None:
            cap = limit.requests_per_minute * share
            self.requests = min(cap, self.requests + dt * cap / 60.0)
        self.updated_at = max(self.updated_at, now)


def share_of(limit: Limit, share: float) -> tuple[float | None, float | None, int | None]:
    """``limit``'s capacities at ``share`` of it: (tokens, requests, concurrent). A concurrency cap is cut down
    but never below 1, so every share can serve; with N shares the total may exceed the cap by up to N - 1."""
    tokens = None if limit.tokens_per_minute is None else limit.tokens_per_minute * share
    requests = None if limit.requests_per_minute is None else limit.requests_per_minute * share
    concurrent = None if limit.max_concurrent is None else max(1, math.floor(limit.max_concurrent * share + 1e-9))
    return tokens, requests, concurrent


class LocalLimits:
    """Buckets in this process. ``share`` (0 < share <= 1): the fraction of every limit this balancer enforces
    (1: it is the only balancer; with N regions and no Redis, each gets its region's share; ``set_share`` moves
    it at runtime). ``set_shares`` gives single buckets a share of their own, as the controller moves unused share
    to busy regions (controller/shares.py); ``demand`` records what each bucket was asked for, which the balancer
    reports in its heartbeat (skylb/quota/demand.py)."""

    def __init__(self, share: float = 1.0):
        self.share = share
        #: Per bucket key, a share other than ``share`` (from the controller).
        self.shares: dict[str, float] = {}
        self.demand = BucketDemand()
        self._states: dict[str, BucketState] = {}

    def set_share(self, share: float) -> None:
        """Enforce ``share`` of every limit from now on (levels above the new capacity are cut at the next use)."""
        self.share = share

    def set_shares(self, shares: dict[str, float], default: float) -> None:
        """Enforce ``shares[key]`` of each listed bucket's limit and ``default`` of every other one, from now on
        (levels above a new capacity are cut at the next use; a larger share refills faster at once). Shares are
        fractions in (0, 1]."""
        self.shares = dict(shares)
        self.share = default

    def share_for(self, key: str) -> float:
        """The fraction of ``key``'s limit this balancer enforces."""
        return self.shares.get(key, self.share)

    def _state(self, key: str, limit: Limit, now: float) -> BucketState:
        state = self._states.get(key)
        share = self.share_for(key)
        tokens_cap, requests_cap, _ = share_of(limit, share)
        if state is None:
            state = self._states[key] = BucketState(tokens=tokens_cap or 0.0, requests=requests_cap or 0.0,
                                                    in_flight=0, updated_at=now)
        state.refill(limit, share, now)
        return state

    async def acquire(self, buckets: Sequence[tuple[str, Limit]], tokens: int, now: float) -> Grant:
        """See LimitBackend.acquire."""
        return self.acquire_now(buckets, tokens, now)

    def acquire_now(self, buckets: Sequence[tuple[str, Limit]], tokens: int, now: float) -> Grant:
        """``acquire``, synchronously (the in-process backend never waits on I/O)."""
        refusals: list[Grant] = []
        for key, limit in buckets:
            state = self._state(key, limit, now)
            tokens_cap, requests_cap, concurrent_cap = share_of(limit, self.share_for(key))
            if concurrent_cap is not None and state.in_flight >= concurrent_cap:
                refusals.append(Grant(False, key, "max_concurrent", None))
            if tokens_cap is not None:
                need = min(float(tokens), tokens_cap)
                if state.tokens < need:
                    refusals.append(Grant(False, key, "tokens_per_minute",
                                          (need - state.tokens) / (tokens_cap / 60.0)))
            if requests_cap is not None:
                need = min(1.0, requests_cap)
                if state.requests < need:
                    refusals.append(Grant(False, key, "requests_per_minute",
                                          (need - state.requests) / (requests_cap / 60.0)))
        if refusals:
            refused = {g.key for g in refusals}
            for key, limit in buckets:
                self.demand.record(key, limit, now, asked_tokens=tokens, refused=key in refused,
                                   in_flight=self._states[key].in_flight)
            # The refusal that lasts longest decides the wait; a slot (unknown wait) outranks any refill.
            return max(refusals, key=lambda g: math.inf if g.wait_s is None else g.wait_s)
        for key, limit in buckets:
            state = self._states[key]
            tokens_cap, requests_cap, _ = share_of(limit, self.share_for(key))
            if tokens_cap is not None:
                state.tokens -= min(float(tokens), tokens_cap)
            if requests_cap is not None:
                state.requests -= min(1.0, requests_cap)
            state.in_flight += 1
            self.demand.record(key, limit, now, asked_tokens=tokens, admitted_tokens=tokens, admitted=True,
                               in_flight=state.in_flight)
        return Grant(True)

    async def release(self, buckets: Sequence[tuple[str, Limit]], now: float, *, refund_tokens: int = 0) -> None:
        """See LimitBackend.release."""
        self.release_now(buckets, now, refund_tokens=refund_tokens)

    def release_now(self, buckets: Sequence[tuple[str, Limit]], now: float, *, refund_tokens: int = 0) -> None:
        """``release``, synchronously."""
        for key, limit in buckets:
            state = self._state(key, limit, now)
            state.in_flight = max(0, state.in_flight - 1)
            tokens_cap, _, _ = share_of(limit, self.share_for(key))
            if refund_tokens and tokens_cap is not None:
                state.tokens = min(tokens_cap, state.tokens + refund_tokens)

    def levels(self) -> dict[str, dict[str, float]]:
        """See LimitBackend.levels."""
        return {key: {"tokens": s.tokens, "requests": s.requests, "in_flight": float(s.in_flight)}
                for key, s in self._states.items()}
