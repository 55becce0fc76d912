"""The queue with priority classes: classes strictly in order (with aging), tenants of a class by weighted deficit
round robin, first come, first served inside a tenant.

Sources: "Why I Built a Priority Queue for Ollama" (three strict tiers: embeddings critical by path, then
``X-Priority: high``, then the rest); deficit round robin after Shreedhar and Varghese, "Efficient fair queueing
using deficit round robin" (SIGCOMM 1995), with a tenant's quantum scaled by its weight.

Aging (ours, not the blog's): a request's class rises one step per ``aging_s`` waited (from ``queued_since``), up
to ``critical``. The blog's proxy serves strict tiers because its queue drains in seconds; a balancer shared by
many tenants can be saturated for minutes, and strict tiers would then starve ``low`` (and ``normal``) until the
queue timeout failed them. With aging, a request waits at most about ``aging_s`` per class step before it competes,
oldest first, with the class above. ``aging_s`` 0 keeps strict tiers.

The order of one pick at ``now``:

1. For each non-empty class, its effective class is its own index less one per ``aging_s`` its oldest request has
   waited (at least 0). The class with the lowest effective class goes; ties go to the class with the older
   oldest request.
2. In that class: a retried request first (``requeue``: its target failed before the first byte; it was charged
   when first placed), in age order; then, if the class won by aging, its oldest request (it is the one that aged);
   else the tenant whose deficit round robin turn it is, its oldest request.
3. A request the router cannot place now (``window``'s ``blocked``) is passed over within its deque; a deque with
   nothing else loses its turn for the rest of the dispatch pass (the next tenant in rotation goes, then the next
   class), so a blocked request never holds up a request of another candidate set.

Deficit round robin: tenants with queued requests take turns in a fixed rotation; at the start of its turn a
tenant's deficit grows by ``weight x quantum`` and it places requests while its deficit covers their cost
(``Request.cost``, 1 by default: shares counted in requests); a tenant whose queue empties leaves the rotation
with deficit 0. The quantum grows to the largest ``cost / weight`` seen at a turn's start while the class is busy,
so every turn places at least one request. Under saturation, tenants of weights 2:1 place 2:1.

Pure: no I/O, no clock. Every (class, tenant) deque and every class's retry deque is kept in ``queued_since``
order, and each class keeps a heap of its requests by age, so a pick is O(classes + log n) (plus the turns
skipped, at most one per tenant) and expiry O(classes + expired x log n), never a scan of the queue.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator

from skylb.core.request import PRIORITIES, Request

__all__ = ["ClassQueue"]

_CLASS_INDEX = {name: i for i, name in enumerate(PRIORITIES)}
_NORMAL = _CLASS_INDEX["normal"]


def class_index(priority: str) -> int:
    """The index of ``priority`` in PRIORITIES (0: critical); an unknown name counts as normal."""
    return _CLASS_INDEX.get(priority, _NORMAL)


def _insert_ordered(queue: deque[Request], request: Request) -> None:
    """Insert ``request`` in ``queued_since`` order, after those that joined at the same time (a forwarded or
    retried request is old: its place is near the head, so the scan starts there)."""
    since = request.queued_since
    if not queue or queue[-1].queued_since <= since:
        queue.append(request)
        return
    for i, queued in enumerate(queue):
        if queued.queued_since > since:
            queue.insert(i, request)
            return


class _Class:
    """One priority class: its retried requests, its tenants' deques and their deficit round robin state."""

    __slots__ = ("retries", "tenants", "active", "deficit", "turn_started", "quantum", "size", "ages")

    def __init__(self) -> None:
        self.retries: deque[Request] = deque()
        self.tenants: dict[str, deque[Request]] = {}
        #: Tenants with queued requests, in rotation order; ``active[0]`` is the tenant whose turn it is.
        self.active: deque[str] = deque()
        self.deficit: dict[str, float] = {}
        #: True once ``active[0]`` received its quantum for the current turn.
        self.turn_started = False
        #: Deficit added per unit of weight at a turn's start; grows (never shrinks while the class is busy) to the
        #: largest ``cost / weight`` seen, so every turn places at least one request.
        self.quantum = 1.0
        self.size = 0
        #: Heap of (queued_since, sequence, request) over the class's queued requests (stale entries of requests
        #: that left are dropped when they reach the top): the oldest in O(log n), for aging and expiry. Its size is
        #: bounded by the requests added while the oldest queued one waits, which the queue timeout bounds.
        self.ages: list[tuple[float, int, Request]] = []

    def deques(self) -> Iterator[deque[Request]]:
        if self.retries:
            yield self.retries
        for tenant in self.active:
            yield self.tenants[tenant]

    def add(self, request: Request, *, retry: bool, seq: int) -> None:
        self.size += 1
        heapq.heappush(self.ages, (request.queued_since, seq, request))
        if retry:
            _insert_ordered(self.retries, request)
            return
        tenant = request.tenant
        queue = self.tenants.get(tenant)
        if queue is None:
            queue = self.tenants[tenant] = deque()
        if not queue:
            self.active.append(tenant)
            self.deficit[tenant] = 0.0
        _insert_ordered(queue, request)

    def emptied(self, tenant: str) -> None:
        """``tenant``'s deque became empty: it leaves the rotation with deficit 0."""
        if self.active and self.active[0] == tenant:
            self.active.popleft()
            self.turn_started = False
        else:
            self.active.remove(tenant)
        self.deficit.pop(tenant, None)
        del self.tenants[tenant]

    def wdrr_tenant(self, weight_of: Callable[[str], float],
                    passed: Callable[[str], bool] | None = None) -> str | None:
        """The tenant whose turn it is and whose deficit covers its oldest request's cost (advancing turns as
        needed; the class has tenants queued). A tenant ``passed`` says cannot place anything now loses its turn,
        as an idle flow does in deficit round robin (its deficit is kept); None when every tenant is passed."""
        active = self.active
        if passed is not None and all(passed(t) for t in active):
            return None
        # The quantum lets every turn place its head, so the current turn and the next suffice; the bound only
        # guards against float rounding.
        for _ in range(3 * len(active) + 2):
            tenant = active[0]
            if passed is not None and passed(tenant):
                active.rotate(-1)
                self.turn_started = False
                continue
            if not self.turn_started:
                weight = _weight(weight_of, tenant)
                self.quantum = max(self.quantum, self.tenants[tenant][0].cost / weight)
                self.deficit[tenant] += weight * self.quantum
                self.turn_started = True
            if self.deficit[tenant] + 1e-9 >= self.tenants[tenant][0].cost:
                return tenant
            active.rotate(-1)
            self.turn_started = False
        return active[0]


def _weight(weight_of: Callable[[str], float], tenant: str) -> float:
    """``tenant``'s weight, a positive finite number (anything else counts as 1)."""
    try:
        w = float(weight_of(tenant))
    except (TypeError, ValueError):
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


class ClassQueue:
    """Queued requests by priority class (``Request.priority``) and tenant (``Request.tenant``).

    Args:
        aging_s: a request's class rises one step per this many seconds waited; 0: strict classes, no aging.
        weight_of: a tenant's weight (> 0) for deficit round robin; read when a tenant's turn starts, so changed
            weights apply from the next turn. Default: every tenant 1.

    ``len``, truth and iteration (class by class, retries first, then tenants in rotation order) work as on the
    router's plain FCFS deque. ``head(now)`` is the request to place next; ``window(now, k)`` it and up to ``k - 1``
    later requests of the same tenant (the policy's look-ahead stays inside the class and the tenant); ``take``
    removes the one placed and charges its tenant.
    """

    def __init__(self, *, aging_s: float = 0.0, weight_of: Callable[[str], float] | None = None):
        self.aging_s = aging_s
        self.weight_of: Callable[[str], float] = weight_of or (lambda tenant: 1.0)
        self._classes = [_Class() for _ in PRIORITIES]
        self._size = 0
        #: request id -> (request, retry, sequence): where a queued request is, for ``cancel`` without a scan of
        #: every deque, and which age-heap entry is its live one.
        self._where: dict[str, tuple[Request, bool, int]] = {}
        self._seq = itertools.count()
        #: The last pick: (class index, deque, won by aging), valid until the queue changes.
        self._pick: tuple[int, deque[Request], bool] | None = None
        #: Deques (by id) whose every request the current dispatch pass found blocked: picks pass them over until
        #: ``new_pass``.
        self._passed: set[int] = set()

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for cls in self._classes:
            for queue in cls.deques():
                yield from queue

    # -- changes ------------------------------------------------------------------------------------------------
    def add(self, request: Request, *, retry: bool = False) -> None:
        """Queue ``request`` in its class (``retry``: ahead of the class's tenants, in age order)."""
        seq = next(self._seq)
        self._classes[class_index(request.priority)].add(request, retry=retry, seq=seq)
        self._where[request.id] = (request, retry, seq)
        self._size += 1
        self._pick = None

    def _remove(self, cls: _Class, queue: deque[Request], request: Request, *, charge: bool) -> None:
        if queue and queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        cls.size -= 1
        self._size -= 1
        self._where.pop(request.id, None)
        self._pick = None
        if not cls.size:  # nothing left: start the class afresh (its heap holds only stale entries)
            cls.ages.clear()
            cls.quantum = 1.0
        if queue is cls.retries:
            return
        tenant = request.tenant
        if charge:
            cls.deficit[tenant] -= request.cost
        if not queue:
            cls.emptied(tenant)

    def cancel(self, request_id: str) -> Request | None:
        """Remove a still-queued request; returns it, or None if it was not queued."""
        found = self._where.get(request_id)
        if found is None:
            return None
        request, retry, _ = found
        cls = self._classes[class_index(request.priority)]
        self._remove(cls, cls.retries if retry else cls.tenants[request.tenant], request, charge=False)
        return request

    def expire(self, now: float, timeout_s: float) -> list[Request]:
        """Remove and return the requests that have waited longer than ``timeout_s`` at ``now`` (from
        ``queued_since``); O(classes + expired x log n) through each class's age heap."""
        expired: list[Request] = []
        for cls in self._classes:
            while cls.size:
                queue, request = self._oldest(cls)
                if now - request.queued_since <= timeout_s:
                    break
                self._remove(cls, queue, request, charge=False)
                expired.append(request)
        return expired

    def _oldest(self, cls: _Class) -> tuple[deque[Request], Request]:
        """The class's oldest request and the deque it heads (the class is not empty); drops stale heap entries."""
        ages = cls.ages
        while True:
            _, seq, request = ages[0]
            found = self._where.get(request.id)
            if found is not None and found[2] == seq:
                # Deques and the heap both order by (queued_since, arrival): the oldest heads its deque.
                return (cls.retries if found[1] else cls.tenants[request.tenant]), request
            heapq.heappop(ages)

    # -- picks --------------------------------------------------------------------------------------------------
    def _choose(self, now: float) -> tuple[int, deque[Request], bool] | None:
        """(class index, deque whose head goes next, whether the class won by aging), passing over the deques of
        ``_passed``; None when every queued request is in one of those."""
        if self._pick is not None:
            return self._pick
        ranked: list[tuple[float, float, int, bool]] = []
        for ci, cls in enumerate(self._classes):
            if not cls.size:
                continue
            since = self._oldest(cls)[1].queued_since
            steps = math.floor((now - since) / self.aging_s) if self.aging_s > 0 else 0
            effective = max(0, ci - max(0, steps))
            ranked.append((effective, since, ci, effective < ci))
        # Stable sort on (effective class, oldest): a tie keeps the lower class index first, as the scan did.
        for _, _, ci, aged in sorted(ranked, key=lambda key: key[:2]):
            pick = self._class_pick(ci, aged)
            if pick is not None:
                # Cached until the queue changes: the same answer for the same state, whatever ``now`` (a dispatch
                # pass asks twice: for the window, then to take), while aging moves on at the next change or pass.
                self._pick = pick
                return pick
        return None

    def _class_pick(self, ci: int, aged: bool) -> tuple[int, deque[Request], bool] | None:
        """Class ``ci``'s pick: its retries, else (``aged``) its oldest request's deque, else the deficit round
        robin tenant's; deques in ``_passed`` are passed over."""
        cls, passed = self._classes[ci], self._passed
        if cls.retries and id(cls.retries) not in passed:
            return ci, cls.retries, aged
        if aged:
            queue = self._oldest(cls)[0]
            if id(queue) not in passed:
                return ci, queue, True
        if not cls.active:
            return None
        tenant = cls.wdrr_tenant(self.weight_of, (lambda t: id(cls.tenants[t]) in passed) if passed else None)
        return None if tenant is None else (ci, cls.tenants[tenant], False)

    def head(self, now: float) -> Request:
        """The request to place next at ``now`` (the queue must not be empty)."""
        pick = self._choose(now)
        assert pick is not None
        return pick[1][0]

    def window(self, now: float, k: int, blocked: Callable[[Request], bool] | None = None) -> list[Request]:
        """The head and up to ``k - 1`` later requests of its deque (same class, same tenant), oldest first.

        ``blocked`` (request -> True when it cannot be placed in this pass) passes requests over: the window holds
        the deque's first ``k`` others, and a deque with none is passed over until ``new_pass`` (the next tenant in
        rotation, or the next class, goes instead); [] when every queued request is blocked."""
        while True:
            pick = self._choose(now)
            if pick is None:
                return []
            queue = pick[1]
            found = queue if blocked is None else (r for r in queue if not blocked(r))
            window = list(itertools.islice(found, max(1, k)))
            if window:
                return window
            self._passed.add(id(queue))
            self._pick = None

    def take(self, now: float, request: Request) -> None:
        """Remove ``request`` (from ``window(now, k)``), just placed; a deficit round robin pick charges its
        tenant ``request.cost``."""
        pick = self._choose(now)
        assert pick is not None, "take() follows a window() that found a request"
        ci, queue, aged = pick
        cls = self._classes[ci]
        self._remove(cls, queue, request, charge=queue is not cls.retries and not aged)

    def new_pass(self) -> None:
        """Forget the cached pick and the deques passed over (a dispatch pass starts: time moved on, aging may have
        changed the order, targets may have room again)."""
        self._pick = None
        self._passed.clear()

    # -- reading ------------------------------------------------------------------------------------------------
    def oldest_since(self) -> float | None:
        """``queued_since`` of the oldest queued request, or None when empty."""
        heads = [self._oldest(cls)[1].queued_since for cls in self._classes if cls.size]
        return min(heads) if heads else None

    def lengths(self) -> dict[tuple[str, str], int]:
        """Queued requests by (priority class, tenant); retried requests count with their tenant."""
        out: dict[tuple[str, str], int] = {}
        for name, cls in zip(PRIORITIES, self._classes):
            for tenant, queue in cls.tenants.items():
                out[(name, tenant)] = out.get((name, tenant), 0) + len(queue)
            for request in cls.retries:
                out[(name, request.tenant)] = out.get((name, request.tenant), 0) + 1
        return out
