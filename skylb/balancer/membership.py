"""Membership from the controller: watch it, apply it to the router, keep it on disk.

Static stability (the Amazon Builders' Library, "Static stability using Availability Zones"): the last membership is
persisted to ``state_dir``; at start the balancer loads it before the controller answers, and when the controller is
unreachable it keeps serving on it and says so (``controller_reachable`` in status and metrics). The controller is
watched with a long poll from the last revision; every answer is a full snapshot, so a missed change is never lost.

The watch asks for this balancer's view (``?balancer=`` its URL): only the replicas it owns (a region may run several
balancers, siblings, which share its replicas one owner each: controller/ownership.py) and the list of its siblings.
A controller that predates the view answers the full snapshot, which ``apply`` also understands.

The snapshot also carries the controller's quotas (``quotas``, ``quotas_revision``; controller/quotas.py): when they
differ from the ones applied, ``apply_quotas`` gets them, so a `skylb-ctl quota set` reaches every balancer within
one watch round trip; they are kept on disk with the rest. While the controller holds none (null), the balancer's
config quotas stay in force.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Callable

import aiohttp
import structlog
from pydantic import ValidationError

from skylb.balancer.controller_client import ControllerClient, ControllerError, ControllerUnavailable
from skylb.quota.limits import Quotas

__all__ = ["MembershipWatcher"]

log = structlog.get_logger("skylb.membership")


class MembershipWatcher:
    """Keeps a balancer's replicas and peers in line with the controller.

    Args:
        region: this balancer's region; advertise_url: the URL peers and the controller use for it.
        controller_url: the controller's base URL, or None to rely on the persisted membership only.
        state_dir: where the last membership is kept (one JSON file per region).
        apply: called with each membership snapshot (the controller's JSON: revision, balancers, replicas).
        wait_s: long-poll duration, s; heartbeat_s: how often the balancer re-registers, s.
        token: the peer token, the credential of this balancer's heartbeats to the controller (None: none sent).
        apply_quotas: called with the quotas in force whenever the snapshot's differ from the last applied (the
            controller's, or ``config_quotas`` again when the controller drops its own).
        demand: returns what each quota bucket was asked for (skylb/quota/demand.py), sent with every heartbeat, or
            None to send none; apply_shares: called with the heartbeat answer's "quota_shares" ({"default",
            "buckets"}; controller/shares.py).
        timeout_s: the bound of one call to one controller, s (a long poll's wait comes on top).
        balancer_id: this balancer's name among its region's balancers (None: the controller's default);
        held_owned: returns {replica id: owner epoch} of the replicas this balancer owns, sent with heartbeats (None:
            not known, a controller without owners); when it loses one, a heartbeat goes at once (it confirms a
            handover, so the new owner gets the replica within a round trip).

    ``controller_reachable`` turns False when a watch call or a heartbeat finds no controller answering, and True
    again with the watch's next answer.
    """

    def __init__(self, *, region: str, advertise_url: str, controller_url: str | None, state_dir: str,
                 apply: Callable[[dict], None], session: aiohttp.ClientSession, wait_s: float = 20.0,
                 heartbeat_s: float = 10.0, held_epochs: Callable[[], dict[str, int]] | None = None,
                 token: str | None = None, apply_quotas: Callable[[Quotas], None] | None = None,
                 config_quotas: Quotas | None = None, demand: Callable[[], dict | None] | None = None,
                 apply_shares: Callable[[dict], None] | None = None, timeout_s: float = 5.0,
                 balancer_id: str | None = None, held_owned: Callable[[], dict[str, int] | None] | None = None):
        self.region = region
        self.balancer_id = balancer_id
        self.held_owned = held_owned or (lambda: None)
        self._beat_now = asyncio.Event()
        self.demand = demand or (lambda: None)
        self.apply_shares = apply_shares
        self.apply_quotas = apply_quotas
        self.config_quotas = config_quotas or Quotas()
        #: The controller's quota document last applied (None: none, the config's are in force) and its revision.
        self.quotas_doc: dict | None = None
        self.quotas_revision: int | None = None
        self.advertise_url = advertise_url
        self.apply = apply
        self.held_epochs = held_epochs or (lambda: {})
        self.wait_s = wait_s
        self.heartbeat_s = heartbeat_s
        # One file per balancer: siblings on one host may share a state directory.
        self.path = Path(state_dir) / (f"membership-{region}.json" if balancer_id is None
                                       else f"membership-{region}-{balancer_id.replace(':', '_')}.json")
        self.client = (ControllerClient(controller_url, session=session, timeout_s=timeout_s, token=token)
                       if controller_url else None)
        self.revision: int | None = None
        self.controller_reachable = False
        self._tasks: list[asyncio.Task] = []

    def load_persisted(self) -> bool:
        """Apply the membership kept on disk, if any; True when one was found and applied."""
        try:
            snapshot = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        self._apply(snapshot, persist=False)
        log.info("membership_loaded_from_disk", revision=self.revision, path=str(self.path))
        return True

    async def fetch_once(self, timeout_s: float) -> bool:
        """Read and apply the controller's membership now; False (nothing applied) when it does not answer within
        ``timeout_s`` seconds or there is no controller."""
        if self.client is None:
            return False
        try:
            snapshot = await asyncio.wait_for(self.client.get_membership(balancer=self.advertise_url), timeout_s)
        except (ControllerUnavailable, ControllerError, asyncio.TimeoutError):
            return False
        self.controller_reachable = True
        self._apply(snapshot, persist=True)
        return True

    def start(self) -> None:
        """Start watching the controller and heartbeating (no-op without a controller URL)."""
        if self.client is not None:
            self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._heartbeat())]

    async def stop(self) -> None:
        """Stop the background tasks."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _heartbeat(self) -> None:
        while True:
            try:
                answer = await self.client.register_balancer(self.region, self.advertise_url, self.held_epochs(),
                                                             demand=self.demand(), balancer_id=self.balancer_id,
                                                             owned=self.held_owned())
                shares = answer.get("quota_shares")
                if self.apply_shares is not None and isinstance(shares, dict):
                    self.apply_shares(shares)
            except ControllerError as exc:
                if exc.type == "stale_epoch":
                    # Replicas this balancer holds were given to another balancer: drop them now, not at the
                    # watch's next answer.
                    log.warning("stale_epoch", error=str(exc))
                    await self.fetch_once(timeout_s=5.0)
                elif exc.status == 400 and str(exc).startswith("demand:") and self.demand() is not None:
                    # A controller older than quota shares: register without demand from now on (the balancer keeps
                    # its default share) rather than fail every heartbeat during a rolling upgrade.
                    log.warning("controller_without_quota_shares", error=str(exc))
                    self.demand = lambda: None
                    continue
                else:
                    log.warning("balancer_registration_failed", error=str(exc))
            except ControllerUnavailable as exc:
                log.warning("balancer_registration_failed", error=str(exc))
                # No controller answered: say so now. The watch may sit in a long poll that a blackholed network
                # holds for wait_s plus the timeout per controller; its next answer sets this back.
                if self.controller_reachable:
                    log.warning("controller_unreachable_serving_last_membership", revision=self.revision,
                                error=str(exc))
                self.controller_reachable = False
            try:
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            self._beat_now.clear()

    async def _watch(self) -> None:
        backoff = 0.5
        while True:
            try:
                # The first call, and the first after a failure, is a plain snapshot (so a restarted controller is
                # seen at once); later ones long-poll from the revision we hold.
                poll = self.revision is not None and self.controller_reachable
                snapshot = await self.client.get_membership(
                    revision=self.revision, wait_s=self.wait_s if poll else 0, balancer=self.advertise_url)
            except (ControllerUnavailable, ControllerError) as exc:
                if self.controller_reachable:
                    log.warning("controller_unreachable_serving_last_membership",
                                revision=self.revision, error=str(exc))
                self.controller_reachable = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.5
            self.controller_reachable = True
            if snapshot.get("revision") != self.revision:
                self._apply(snapshot, persist=True)

    def _apply(self, snapshot: dict, *, persist: bool) -> None:
        before = self.held_owned() or {}
        self.apply(snapshot)
        if set(before) - set(self.held_owned() or {}):
            self._beat_now.set()  # say at once that it let go: that completes a handover to a sibling
        self._apply_quotas(snapshot)
        self.revision = snapshot.get("revision")
        if persist:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(snapshot))
            os.replace(tmp, self.path)  # atomic: a crash never leaves half a file
            log.info("membership_applied", revision=self.revision,
                     replicas=sum(1 for r in snapshot.get("replicas", []) if r.get("region") == self.region))

    def _apply_quotas(self, snapshot: dict) -> None:
        """Hand the snapshot's quotas to ``apply_quotas`` when they differ from those applied last."""
        doc = snapshot.get("quotas")
        if self.apply_quotas is None or doc == self.quotas_doc:
            return
        try:
            quotas = self.config_quotas if doc is None else Quotas.model_validate(doc)
        except ValidationError as exc:  # a newer controller's document this balancer cannot read: keep what it has
            log.warning("quotas_not_applied", revision=snapshot.get("quotas_revision"),
                        error=str(exc).splitlines()[0])
            return
        self.quotas_doc = doc
        self.quotas_revision = None if doc is None else snapshot.get("quotas_revision")
        self.apply_quotas(quotas)
        log.info("quotas_applied", source="config" if doc is None else "controller",
                 revision=self.quotas_revision)
