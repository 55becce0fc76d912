"""Which balancer of a region pushes to each replica, when a region runs several balancers (siblings).

Siblings share their region's replicas: each replica is owned by exactly one live balancer at a time, so no two
balancers fill one replica's room at once (each sees only its own requests in flight). The replicas of region R go
to the live balancers of the region that serves R (its own, or after a cross-region failover the closest live one:
controller/failover.py), balanced by replica count. A sibling that joins, drains or dies re-balances the region with
as few moves as the balance allows: an owner that stays live keeps what it holds up to its fair count.

A balancer is *live* here when it is healthy, not draining and heard from within ``live_s`` seconds (missed
heartbeats count even where the health check is off). A region whose balancers are all down keeps its owners (there
is nobody to give the replicas to) until failover gives the region to another region's balancers.

Every change of owner is a store write that bumps the replica's epoch (controller/store.py ``set_owners``).
A replica taken from a live owner (a sibling joined or came back) is handed over in two steps, release before
acquire, so that no two balancers push to it at once: the owner's view drops it (``handover_to`` set; the new owner
does not get it yet), the owner stops pushing and heartbeats at once without it, and that heartbeat completes the
handover (:func:`confirm_released`: new owner, epoch + 1). A replica whose owner is dead or draining moves at once.
:func:`view_for` is what one balancer receives of the membership: only the replicas it owns, and its siblings.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from controller.store import Assignment, Balancer, Membership, Ownership, Replica

__all__ = ["LIVE_HEARTBEAT_S", "OwnerStore", "live_balancers", "plan_owners", "rebalance", "confirm_released",
           "stale_owned", "view_for"]

#: A balancer whose last heartbeat is older than this (s; three of its 10 s heartbeats) is not live: it owns no
#: replica and no longer holds its id against a new registration, even where the health check is off.
LIVE_HEARTBEAT_S = 30.0


class OwnerStore(Protocol):
    """What :func:`rebalance` needs of a membership store (both stores have it)."""

    def list_replicas(self) -> list[Replica]: ...
    def list_balancers(self) -> list[Balancer]: ...
    def assignments(self) -> list[Assignment]: ...
    def owners(self) -> list[Ownership]: ...
    def set_owners(self, plan: dict[str, str], handovers: dict[str, str | None] | None = None) -> list[Ownership]:
        ...


def live_balancers(balancers: list[Balancer], now: float, live_s: float) -> list[Balancer]:
    """The balancers that may own replicas: healthy, not draining, last heartbeat within ``live_s`` s of ``now``
    (unix s)."""
    return [b for b in balancers if b.healthy and not b.draining and now - b.last_seen < live_s]


def plan_owners(replicas: list[Replica], balancers: list[Balancer], assignments: list[Assignment],
                owners: list[Ownership], *, now: float, live_s: float) -> dict[str, str]:
    """The owner each replica should have: {replica id: balancer URL}, for every replica that can have one.

    Pure. For each serving region, its live balancers get its replicas (their own region's and those failed over
    to it) by count, ``n // k`` each and one more for the first ``n % k``, those holding most first (fewest moves);
    a replica whose owner is gone, or is over its count, goes to the live balancer holding fewest (ties by URL).
    Replicas of a region served by no live balancer keep their current owner (left out when they have none).
    """
    serving = {a.region: a.balancer_region for a in assignments}
    current = {o.replica: o.balancer for o in owners}
    live: dict[str, list[str]] = defaultdict(list)
    for b in live_balancers(balancers, now, live_s):
        live[b.region].append(b.url)
    groups: dict[str, list[Replica]] = defaultdict(list)
    for r in replicas:
        groups[serving.get(r.region, r.region)].append(r)
    plan = {}
    for region, members in groups.items():
        if live.get(region):
            plan.update(_balance([r.id for r in members], sorted(live[region]), current))
        else:
            plan.update((r.id, current[r.id]) for r in members if r.id in current)
    return plan


def rebalance(store: OwnerStore, *, now: float, live_s: float = LIVE_HEARTBEAT_S) -> list[Ownership]:
    """Apply :func:`plan_owners` to ``store`` (``now``: unix s): a replica without a live owner moves now, one a
    live owner must give up starts its handover (and a handover no longer wanted is cancelled); returns the
    ownerships that changed (one revision for all)."""
    balancers, owners = store.list_balancers(), store.owners()
    plan = plan_owners(store.list_replicas(), balancers, store.assignments(), owners, now=now, live_s=live_s)
    live = {b.url for b in live_balancers(balancers, now, live_s)}
    current = {o.replica: o for o in owners}
    moves, handovers = {}, {}
    for rid, url in plan.items():
        owner = current.get(rid)
        if owner is None or (owner.balancer != url and owner.balancer not in live):
            moves[rid] = url
        elif owner.handover_to != (None if owner.balancer == url else url):
            handovers[rid] = None if owner.balancer == url else url
    if not moves and not handovers:
        return []  # nothing to write: a heartbeat that changes nothing costs reads only
    return store.set_owners(moves, handovers)


def confirm_released(store: OwnerStore, url: str, owned: dict[str, int]) -> list[Ownership]:
    """Complete the handovers of the balancer at ``url`` whose replicas its heartbeat no longer claims (``owned``:
    {replica id: epoch}): each goes to its ``handover_to`` at epoch + 1. Returns the ownerships that changed."""
    done = {o.replica: o.handover_to for o in store.owners()
            if o.balancer == url and o.handover_to is not None and o.replica not in owned}
    return store.set_owners(done) if done else []


def _balance(replica_ids: list[str], urls: list[str], current: dict[str, str]) -> dict[str, str]:
    """Spread ``replica_ids`` over ``urls`` (sorted) by count, keeping current owners where the count allows."""
    held = {url: sorted(rid for rid in replica_ids if current.get(rid) == url) for url in urls}
    base, extra = divmod(len(replica_ids), len(urls))
    order = sorted(urls, key=lambda url: (-len(held[url]), url))
    cap = {url: base + (1 if i < extra else 0) for i, url in enumerate(order)}
    free = sorted(rid for rid in replica_ids if current.get(rid) not in held)
    for url in urls:
        while len(held[url]) > cap[url]:
            free.append(held[url].pop())  # the last by id: deterministic
    for rid in sorted(free):
        url = min((u for u in urls if len(held[u]) < cap[u]), key=lambda u: (len(held[u]), u))
        held[url].append(rid)
    return {rid: url for url, rids in held.items() for rid in rids}


def stale_owned(owned: dict[str, int], url: str, owners: list[Ownership]) -> list[Ownership]:
    """The ownerships the balancer at ``url`` claims (``owned``: {replica id: epoch}) that another balancer now
    holds at a higher epoch: it must drop those replicas."""
    return [o for o in owners if o.replica in owned and o.balancer != url and o.epoch > owned[o.replica]]


def view_for(membership: Membership, url: str) -> dict:
    """The membership as the balancer at ``url`` receives it: the snapshot's shape (Membership.to_dict) with
    ``replicas`` cut to the ones it owns and is not handing over (each with its ``owner_epoch``), plus ``"view":
    {"balancer": url, "id": its id or null when not registered, "siblings": [the other balancers of its region, as
    in "balancers"]}``."""
    snapshot = membership.to_dict()
    epochs = {o.replica: o.epoch for o in membership.owners if o.balancer == url and o.handover_to is None}
    snapshot["replicas"] = [{**r, "owner_epoch": epochs[r["id"]]} for r in snapshot["replicas"] if r["id"] in epochs]
    me = next((b for b in membership.balancers if b.url == url), None)
    siblings = [b.to_dict() for b in membership.balancers if me is not None and b.region == me.region and b.url != url]
    snapshot["view"] = {"balancer": url, "id": me.id if me else None, "siblings": siblings}
    return snapshot
