"""The quota gate: a request waits here until every bucket it draws on has room, then holds its slot until it ends.

Flow (parse -> ... -> quota gate -> queue): the quota stage (skylb/balancer/stages/quota.py) calls
``admit_request`` before the dispatcher's queue. The gate reads the quotas in force (``Balancer.quotas``) on every
request, so a change at runtime applies at once, and asks
the limit backend (``Balancer.limits``: in-process, or Redis shared by every balancer) for all the request's buckets
at once (all or nothing). A refusal is not an error yet: the request waits, counted as waiting (metrics, status),
asleep until the refusing bucket refills (its ``wait_s``, jittered) or a slot is released here (an asyncio event
set by ``release``), re-checking at least every ``MAX_SLEEP_S`` (a slot freed by another balancer, a quota raised);
never a busy loop. At its deadline (``quota.wait_s`` after arrival, capped by ``queue_timeout_s``) it raises
``QuotaExceeded`` carrying a Retry-After.

Retry-After (LLM-Load-Balancer, "Iteration 2": "Smarter waits" and "Smoothed Retry Timing"): the time until the refusing
bucket refills enough for this request, or, for a concurrency cap, until a slot is expected to free (the oldest request
in flight on that bucket here ends after the bucket's recent mean duration; ``DEFAULT_DURATION_S`` before any has
ended), jittered by +-10 % so clients told to come back do not return together, rounded up to whole seconds (the
header's unit), at least 1 s.

Every admission is released exactly once (``release``; idempotent), also when the request failed, was cancelled or
its client left; a release to a remote backend runs as its own task so a cancelled handler cannot skip it.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from skylb.quota.buckets import Grant, LimitBackend
from skylb.quota.estimate import is_embedding_path, request_tokens
from skylb.quota.limits import Limit, Quotas
from skylb.quota.metrics import QuotaMetrics

__all__ = ["QuotaGate", "QuotaExceeded", "Admission", "retry_after_s", "MAX_SLEEP_S", "DEFAULT_DURATION_S"]

#: The longest a waiting request sleeps before it asks its buckets again, s (slots freed by other balancers and
#: quotas changed at runtime are seen within this).
MAX_SLEEP_S = 1.0
#: The shortest sleep, s (a refill due in microseconds still yields the event loop).
MIN_SLEEP_S = 0.01
#: The duration assumed for a request on a bucket none of whose requests has ended yet, s.
DEFAULT_DURATION_S = 5.0

log = structlog.get_logger("skylb.quota")


class QuotaExceeded(Exception):
    """A request found no room in its quota within its wait.

    Attributes: tenant, model; key: the refusing bucket (``tenant/<t>/<m>`` or ``model/<m>``); reason: the limit
    (tokens_per_minute, requests_per_minute, max_concurrent); retry_after_s: whole seconds, >= 1.
    """

    def __init__(self, tenant: str, model: str, key: str, reason: str, retry_after_s: int):
        self.tenant, self.model, self.key, self.reason, self.retry_after_s = tenant, model, key, reason, retry_after_s
        what = {"tokens_per_minute": "tokens per minute", "requests_per_minute": "requests per minute",
                "max_concurrent": "concurrent requests"}.get(reason, reason)
        super().__init__(f"rate limit reached for {key}: {what}; retry after {retry_after_s} s")


@dataclass(eq=False)
class Admission:
    """A request admitted through the gate: what to release when it ends.

    Attributes: tenant, model, buckets (the (key, Limit) pairs charged), tokens (charged), admitted_at (balancer
    clock, s), grant (the backend's answer; a Redis grant names its slot).
    """

    tenant: str
    model: str
    buckets: Sequence[tuple[str, Limit]]
    tokens: int
    admitted_at: float
    grant: Grant
    released: bool = field(default=False)


def retry_after_s(base_s: float, rng: random.Random) -> int:
    """A Retry-After value from ``base_s`` (seconds until capacity): jittered +-10 %, rounded up, at least 1."""
    return max(1, math.ceil(base_s * rng.uniform(0.9, 1.1)))


class QuotaGate:
    """Admission by quotas, for one balancer.

    Args:
        quotas: returns the quotas in force (read on every request); limits: returns the limit backend;
        now: the balancer's clock (s); metrics: where to count (None: not counted); region: its label;
        wait_s: how long a request waits for room (s; the caller caps it by the queue timeout);
        default_max_tokens: output tokens of a request that sets no cap; rng: jitter source.
    """

    def __init__(self, *, quotas: Callable[[], Quotas], limits: Callable[[], LimitBackend],
                 now: Callable[[], float], metrics: QuotaMetrics | None = None, region: str = "",
                 wait_s: float = 30.0, default_max_tokens: int = 256, rng: random.Random | None = None):
        self.quotas, self.limits, self.now = quotas, limits, now
        self.wait_s, self.default_max_tokens = wait_s, default_max_tokens
        self.metrics, self.region = metrics, region
        self.rng = rng or random.Random()
        #: {tenant: requests waiting for room now}.
        self.waiting: dict[str, int] = defaultdict(int)
        self._released = asyncio.Event()
        self._durations: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=32))
        self._in_flight: dict[str, dict[int, float]] = defaultdict(dict)  # key -> {id(admission): admitted_at}
        self._tasks: set[asyncio.Task] = set()

    def wake_all(self, *_args) -> None:
        """Make every waiting request ask its buckets again now (a slot freed, quotas changed)."""
        self._released.set()
        self._released = asyncio.Event()

    def waiting_now(self) -> dict[str, int]:
        """{tenant: requests waiting} with the tenants that have none left out."""
        return {t: n for t, n in self.waiting.items() if n}

    async def admit_request(self, *, tenant: str, model: str, text: str, max_tokens: int | None, path: str,
                            arrived_at: float, forwarded: bool) -> Admission | None:
        """``admit`` for one parsed client request: its tokens estimated (skylb/quota/estimate.py), its deadline
        ``wait_s`` after ``arrived_at``. A request a peer forwarded (``forwarded``) was charged where it arrived
        and passes (None). Raises QuotaExceeded."""
        if forwarded:
            return None
        tokens = request_tokens(text, max_tokens, embedding=is_embedding_path(path),
                                default_max_tokens=self.default_max_tokens)
        return await self.admit(tenant, model, tokens, deadline=arrived_at + self.wait_s)

    async def admit(self, tenant: str, model: str, tokens: int, *, deadline: float) -> Admission | None:
        """Wait until ``tenant``'s request for ``model`` costing ``tokens`` tokens fits every bucket it draws on,
        and charge them. Returns the Admission (release it when the request ends), or None when no limit applies.

        Raises QuotaExceeded at ``deadline`` (balancer clock, s) when there is still no room.
        """
        buckets = self.quotas().limits_for(tenant, model)
        if not buckets:
            return None
        started = self.now()
        counted = False
        try:
            while True:
                now = self.now()
                limits = self.limits()
                grant = await self._acquire(limits, buckets, tokens, now)
                if grant.ok:
                    admission = Admission(tenant, model, buckets, tokens, self.now(), grant)
                    for key, _ in buckets:
                        self._in_flight[key][id(admission)] = admission.admitted_at
                    self._count_admitted(admission, started)
                    return admission
                now = self.now()
                if now >= deadline:
                    self._count_rejected(tenant, model, grant, started)
                    raise QuotaExceeded(tenant, model, grant.key or "", grant.reason or "",
                                        retry_after_s(self._capacity_in_s(grant, buckets, now), self.rng))
                if not counted:
                    self.waiting[tenant] += 1
                    counted = True
                await self._sleep(min(self._sleep_s(grant, limits), deadline - now))
                buckets = self.quotas().limits_for(tenant, model)  # quotas may have changed meanwhile
                if not buckets:
                    return None
        finally:
            if counted:
                self.waiting[tenant] -= 1

    def release(self, admission: Admission | None, *, refund_tokens: int = 0) -> None:
        """``admission``'s request ended (answered, failed, cancelled, client gone): free its slot and give back
        ``refund_tokens`` tokens it did not use. None and a second call do nothing. Never raises; a backend that
        does I/O releases in a task of its own (``flush`` waits for those)."""
        if admission is None or admission.released:
            return
        admission.released = True
        now = self.now()
        for key, _ in admission.buckets:
            self._in_flight[key].pop(id(admission), None)
            if not self._in_flight[key]:
                del self._in_flight[key]
            self._durations[key].append(max(0.0, now - admission.admitted_at))
        self._free(admission.buckets, admission.grant, now, refund_tokens)

    def _free(self, buckets, grant: Grant, now: float, refund_tokens: int) -> None:
        """Give the slot of ``grant`` on ``buckets`` back to the backend (at once in-process, else in a task)."""
        limits = self.limits()
        release_now = getattr(limits, "release_now", None)
        if release_now is not None:  # in-process: at once, so the next request sees the slot free
            release_now(buckets, now, refund_tokens=refund_tokens)
            self.wake_all()
            return
        task = asyncio.get_running_loop().create_task(self._release(limits, buckets, grant, now, refund_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Wait for the releases still in progress (a test, or the balancer's stop)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _release(self, limits: LimitBackend, buckets, grant: Grant, now: float, refund_tokens: int) -> None:
        try:
            if getattr(limits, "takes_grant", False):
                await limits.release(buckets, now, refund_tokens=refund_tokens, grant=grant)
            else:
                await limits.release(buckets, now, refund_tokens=refund_tokens)
        except Exception:  # the backend falls back on its own; a slot it could not free expires with its lease
            log.exception("quota_release_failed", buckets=[key for key, _ in buckets])
        finally:
            self.wake_all()

    async def _acquire(self, limits: LimitBackend, buckets, tokens: int, now: float) -> Grant:
        """``limits.acquire``, shielded: if the waiting handler is cancelled while a remote backend answers, a
        grant that arrives anyway is released instead of leaking its slot."""
        task = asyncio.ensure_future(limits.acquire(buckets, tokens, now))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def undo(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None and t.result().ok:
                    self._free(buckets, t.result(), self.now(), 0)
            task.add_done_callback(undo)
            raise

    async def _sleep(self, seconds: float) -> None:
        event = self._released
        try:
            async with asyncio.timeout(max(MIN_SLEEP_S, seconds)):
                await event.wait()
        except TimeoutError:
            pass

    def _sleep_s(self, grant: Grant, limits: LimitBackend) -> float:
        """How long to sleep after ``grant`` refused: until the refill (jittered +-10 %), or until a release here
        (bounded by MAX_SLEEP_S either way)."""
        if grant.wait_s is None:
            return MAX_SLEEP_S
        return min(MAX_SLEEP_S, max(MIN_SLEEP_S, grant.wait_s * self.rng.uniform(0.9, 1.1)))

    def _capacity_in_s(self, grant: Grant, buckets, now: float) -> float:
        """Seconds until the refusing bucket has room: its refill time, or a slot's expected release."""
        if grant.wait_s is not None:
            return grant.wait_s
        return self.expected_release_s(grant.key or "", now)

    def expected_release_s(self, key: str, now: float) -> float:
        """Seconds until a slot of bucket ``key`` is expected to free: the oldest request in flight on it here ends
        after the mean of the bucket's recent durations (at least 0.1 s); without one here (slots held elsewhere),
        that mean."""
        durations = self._durations.get(key)
        mean = statistics.fmean(durations) if durations else DEFAULT_DURATION_S
        held = self._in_flight.get(key)
        if not held:
            return mean
        return max(0.1, min(at for at in held.values()) + mean - now)

    def _count_admitted(self, admission: Admission, started: float) -> None:
        if self.metrics is not None:
            tenant = self.metrics.tenant_label(admission.tenant)
            self.metrics.admitted.labels(self.region, tenant, admission.model).inc()
            self.metrics.wait.labels(self.region, tenant).observe(max(0.0, admission.admitted_at - started))

    def _count_rejected(self, tenant: str, model: str, grant: Grant, started: float) -> None:
        if self.metrics is not None:
            label = self.metrics.tenant_label(tenant)
            self.metrics.rejected.labels(self.region, label, model, grant.reason or "").inc()
            self.metrics.wait.labels(self.region, label).observe(max(0.0, self.now() - started))
