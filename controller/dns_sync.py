"""Keep each region's DNS answer on the balancer that serves it (SkyLB paper §4.1 "Load balancer distribution", §4.2
"Failure recovery of load balancers"): after a failover, a region's clients resolve the service name to the closest live
region's balancer; after recovery, to their own again.

The desired answer of region R is the addresses of every live (healthy, not draining) balancer of the region R is
assigned to (controller/store.py ``assignments``): all of a region's siblings, so clients spread over them and one
sibling's death leaves the others in the answer. :class:`DnsSync` writes it through :class:`DnsUpdater` (RFC 2136
with TSIG) whenever it differs from what it last wrote, woken by an assignment change and every ``resync_s``
otherwise, so an update that failed (DNS server down) is retried and a restarted controller re-asserts every answer.
"""

from __future__ import annotations

import asyncio

import structlog

from controller.dns import DnsUpdateError, DnsUpdater, address_of
from controller.store import Assignment, MembershipStore

__all__ = ["DnsSync"]

log = structlog.get_logger("skylb.controller.dns")


class DnsSync:
    """Drives ``updater`` from ``store``'s assignments; ``run`` until cancelled, ``changed`` to wake it.

    Args:
        store: the membership store (assignments and balancers are read at each pass).
        updater: writes one region's answer.
        resync_s: seconds between passes when nothing wakes it (retries failed updates).
    """

    def __init__(self, store: MembershipStore, updater: DnsUpdater, *, resync_s: float = 5.0):
        self.store = store
        self.updater = updater
        self.resync_s = resync_s
        #: {region: addresses (sorted)} as last written successfully by this process.
        self.written: dict[str, tuple[str, ...]] = {}
        self._wake = asyncio.Event()

    async def changed(self, assignment: Assignment | None = None) -> None:
        """An assignment changed: write the answers now (the HealthChecker's ``on_assignment``)."""
        self._wake.set()

    def desired(self) -> dict[str, tuple[str, ...]]:
        """{region: the addresses of its serving region's live balancers, sorted, each once} for every region whose
        serving region has a live balancer (siblings on one host share an address)."""
        live: dict[str, set[str]] = {}
        for b in self.store.list_balancers():
            if b.healthy and not b.draining:
                live.setdefault(b.region, set()).add(address_of(b.url))
        return {a.region: tuple(sorted(live[a.balancer_region])) for a in self.store.assignments()
                if a.balancer_region in live}

    async def sync(self) -> None:
        """One pass: write every answer that differs from what was last written; a failure is logged and retried
        at the next pass."""
        for region, addresses in self.desired().items():
            if self.written.get(region) == addresses:
                continue
            try:
                await self.updater.point(region, list(addresses))
            except (DnsUpdateError, ValueError) as exc:
                log.warning("dns_update_failed", region=region, addresses=list(addresses), error=str(exc))
                continue
            self.written[region] = addresses

    async def run(self) -> None:
        """Sync at start, at every change and every ``resync_s`` until cancelled."""
        while True:
            self._wake.clear()
            await self.sync()
            try:
                await asyncio.wait_for(self._wake.wait(), self.resync_s)
            except asyncio.TimeoutError:
                pass
