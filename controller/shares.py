"""Each region's share of every limit, without Redis (the embedded default splits each limit across regions and the
controller moves unused share to busy regions).

Balancers enforce their share of each bucket in-process (skylb/quota/buckets.py ``LocalLimits.set_shares``) and
report, in every heartbeat, the demand each bucket saw over the last minute (skylb/quota/demand.py). The controller
answers each heartbeat with the shares this module computes from the latest reports of every live balancer.

The rule, per bucket key (source: max-min fair allocation by water-filling, the FAIR_SHARE algorithm of Google's
Doorman rate-limit server, github.com/youtube/doorman doc/algorithms.md: an equal share each, capacity left by
clients wanting less split among those wanting more, as many fully served as possible; here with a floor, and with
capacity nobody wants split evenly instead of left unassigned):

1. Default: ``1 / N``, N the live balancers (healthy, not draining, heard from within 30 s). A bucket nobody
   reported gets the default everywhere.
2. Each balancer's *want*: its use of the global limit over the window, the largest of admitted tokens / minute
   over ``tokens_per_minute``, admitted requests / minute over ``requests_per_minute`` and peak requests in flight
   over ``max_concurrent``, times ``HEADROOM`` (1.25, so a region growing slowly is not refused first); a balancer
   whose bucket *refused* requests in the window wants all it can get (infinity); one that reported but did not
   use the bucket wants 0; one whose report is missing or stale wants the default ``1 / N`` (unknown demand keeps
   the even split, e.g. a balancer heartbeating to another controller).
3. Every balancer gets at least the floor ``FLOOR / N`` (FLOOR = 0.2), so an idle region can start serving at once
   and, once its bucket refuses, asks for more at its next heartbeat.
4. Water-filling: each balancer gets ``max(floor, min(want, level))`` with the level chosen so the shares sum to 1
   (busy balancers split what the others do not use, evenly: max-min fair). When every want fits, what is left is
   split evenly on top, so shares always sum to 1 and never exceed the limit together.

Shares change one heartbeat (``balancer.heartbeat_s``) after demand does. Each heartbeat's answer is computed from
the reports the controller holds at that moment, so during a change two balancers' shares may come from successive
computations: their sum can be off 1 by the change of one balancer's want until the next heartbeat of each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["FLOOR", "HEADROOM", "want", "allocate", "ShareBook"]

#: Every live balancer's minimum share, as a fraction of the even split 1 / N.
FLOOR = 0.2
#: A balancer that refused nothing wants its use times this.
HEADROOM = 1.25
#: A report older than this is stale (s): the balancer counts as unknown demand.
STALE_S = 30.0


def want(bucket: Mapping | None, window_s: float) -> float:
    """A balancer's want of one bucket (a fraction of the global limit, or infinity) from its report ``bucket``
    (skylb/quota/demand.py shape; None: it reported other buckets but not this one, so it wants 0)."""
    if bucket is None:
        return 0.0
    if bucket.get("refused", 0) > 0:
        return math.inf
    limit, per_minute = bucket.get("limit", {}), 60.0 / max(window_s, 1.0)
    uses = [0.0]
    if limit.get("tokens_per_minute"):
        uses.append(bucket.get("admitted_tokens", 0) * per_minute / limit["tokens_per_minute"])
    if limit.get("requests_per_minute"):
        uses.append(bucket.get("admitted_requests", 0) * per_minute / limit["requests_per_minute"])
    if limit.get("max_concurrent"):
        uses.append(bucket.get("peak_in_flight", 0) / limit["max_concurrent"])
    return min(1.0, max(uses) * HEADROOM)


def allocate(wants: list[float], floor: float) -> list[float]:
    """Water-filling: shares in the order of ``wants`` (fractions or infinity), each at least ``floor``
    (``floor * len(wants) <= 1``), summing to 1 (this module's rule, steps 3 and 4)."""
    n = len(wants)
    if n == 0:
        return []

    def total(level: float) -> float:
        return sum(max(floor, min(w, level)) for w in wants)

    if total(1.0) <= 1.0:  # every want fits: split the rest evenly on top
        base = [max(floor, min(w, 1.0)) for w in wants]
        spare = (1.0 - sum(base)) / n
        return [b + spare for b in base]
    lo, hi = 0.0, 1.0
    for _ in range(60):  # total() is monotonic in the level; 60 halvings reach float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < 1.0 else (lo, mid)
    shares = [max(floor, min(w, lo)) for w in wants]
    spare = (1.0 - sum(shares)) / n  # the bisection's last rounding, spread evenly (|spare| ~ 1e-16)
    return [s + spare for s in shares]


class ShareBook:
    """The controller's latest demand report of each balancer, and the shares computed from them.

    Reports live in this controller's memory only (they are refreshed every heartbeat); with several controllers,
    each one counts a balancer that reports elsewhere as unknown demand (the even split)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, balancer_url: str, demand: dict, now: float) -> None:
        """Keep ``demand`` (skylb/quota/demand.py ``report`` shape) as ``balancer_url``'s latest, at ``now`` (s)."""
        self._reports[balancer_url] = (now, demand)

    def shares_for(self, balancer_url: str, live: Iterable[str], now: float) -> dict:
        """``balancer_url``'s shares among the ``live`` balancers (URLs; it is counted even when not among them):
        {"default": 1 / N, "buckets": {key: share}} for every bucket some live balancer reported."""
        urls = sorted(set(live) | {balancer_url})
        n = len(urls)
        fresh = {url: demand for url, (at, demand) in self._reports.items() if url in urls and now - at <= STALE_S}
        for url in [u for u in self._reports if u not in urls]:
            del self._reports[url]  # a balancer gone from membership: forget it
        keys = sorted({key for demand in fresh.values() for key in demand.get("buckets", {})})
        mine = urls.index(balancer_url)
        buckets = {}
        for key in keys:
            wants = [want(fresh[url].get("buckets", {}).get(key), fresh[url].get("window_s", 60.0))
                     if url in fresh else 1.0 / n for url in urls]
            buckets[key] = round(allocate(wants, FLOOR / n)[mine], 6)
        return {"default": 1.0 / n, "buckets": buckets}
