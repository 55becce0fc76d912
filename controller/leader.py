"""Which controller leads: only the leader runs the leader's task (health checks, and the failover they drive).

Every controller serves the REST API, whatever its store; what only one may do is probe and reassign, because two
health checkers would fight over the same verdicts. With the embedded SQLite store there is one controller and it
always leads (SoleLeader). With etcd, the controllers sharing a key prefix elect one (EtcdElection):

- campaign: every ``POLL_S`` a follower reads ``<prefix>/leader``; when it is absent, the follower grants a lease of
  ``ttl_s`` and creates the key attached to it, in one transaction that succeeds only while the key is still absent
  (etcd3gw's ``create``), so exactly one controller wins;
- hold: the leader renews the lease every ``ttl_s / 3`` and checks that the key still names it. It stops leading at
  once, cancelling the leader's task, when a renewal says the lease is gone, when the key names another controller,
  or when no renewal succeeded for ``ttl_s`` minus one request timeout since the last good one was sent: etcd may
  expire the lease from then on, so the task stops before another controller can be elected;
- a controller that stops (SIGTERM) revokes its lease, so another leads within ``POLL_S``; one that dies leaves the
  lease to expire: another leads within ``ttl_s`` + ``POLL_S`` + etcd's expiry check (0.5 s); 3.6-5.3 s measured with
  the default 5 s (README.md, "A highly available controller on etcd").

The leader's task is restarted (after ``RESTART_S``) when it fails while its controller leads: a health checker that
met an etcd error must not stay dead for the rest of a long term.

etcd calls run in a worker thread (``asyncio.to_thread``) on the election's own EtcdConnection, so a slow etcd
delays the API's requests but never the renewal's clock. Each election logs ``leader_elected`` (with ``after_s``, the
seconds it campaigned) and ``leader_lost`` (with ``led_s`` and the reason).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import structlog

from controller.store import StoreUnavailable
from skylb.config import ControllerConfig

if TYPE_CHECKING:  # etcd3gw (and requests under it) loads only where an election runs: 0.2 s of every start else
    from etcd3gw.client import Etcd3Client

__all__ = ["LeaderTask", "SoleLeader", "EtcdElection", "POLL_S", "RESTART_S", "leadership_for"]

log = structlog.get_logger("skylb.controller")

#: What the leader runs while it leads: a coroutine factory, called at each election and cancelled at its end.
LeaderTask = Callable[[], Awaitable[None]]

#: How often a follower looks for a vacant leader key (s); bounds the election time after the key is gone.
POLL_S = 0.25
#: Pause before a failed leader's task runs again (s).
RESTART_S = 1.0

T = TypeVar("T")


def _lease(lease_id: int, client: Etcd3Client):
    """etcd3gw's Lease ``lease_id`` on ``client`` (imported here: etcd3gw loads only where an election runs)."""
    from etcd3gw.lease import Lease
    return Lease(lease_id, client)


class SoleLeader:
    """The only controller of an embedded (SQLite) store: it leads from start to stop."""

    is_leader = True

    async def run(self, lead: LeaderTask | None) -> None:
        """Run ``lead()`` (if given) until cancelled."""
        await _keep_running(lead)


class EtcdElection:
    """Leader election among the controllers that share ``prefix`` in the etcd cluster at ``endpoints``.

    ``ttl_s`` is the leader lease in whole seconds (etcd raises one below its minimum, 2 s by default, to that);
    ``name`` identifies this controller in the leader key and the logs (a random suffix keeps it unique).
    ``is_leader`` says whether this process leads now.
    """

    def __init__(self, endpoints: Sequence[str], *, prefix: str = "/skylb", ttl_s: int = 5, name: str = ""):
        self.ttl_s = ttl_s
        self.name = f"{name or socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex[:8]}"
        self.is_leader = False
        self._key = f"{prefix.rstrip('/')}/leader".encode()
        # One request may take a sixth of the lease: a renewal that fails still leaves time for two more.
        self._timeout_s = max(ttl_s / 6, 0.2)
        from controller.etcd_store import EtcdConnection
        self._etcd = EtcdConnection(endpoints, timeout_s=self._timeout_s)
        self._lease_id: int | None = None
        self._holder: bytes | None = None

    async def run(self, lead: LeaderTask | None) -> None:
        """Campaign, lead (running ``lead()``) until leadership is lost, campaign again; until cancelled, when a
        leader revokes its lease so that another controller leads at once."""
        loop = asyncio.get_running_loop()
        elected = 0.0
        try:
            while True:
                started = loop.time()
                valid_until = await self._campaign()
                elected = loop.time()
                self.is_leader = True
                log.info("leader_elected", leader=self.name, after_s=round(elected - started, 3), ttl_s=self.ttl_s)
                task = asyncio.create_task(_keep_running(lead))
                try:
                    reason = await self._hold(valid_until)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                self.is_leader = False
                log.warning("leader_lost", leader=self.name, led_s=round(loop.time() - elected, 3), reason=reason)
                await self._resign()  # the lease may still live (a lost answer): free the key for the others
        finally:
            if self.is_leader:
                self.is_leader = False
                log.info("leader_lost", leader=self.name, led_s=round(loop.time() - elected, 3), reason="stopping")
            await self._resign()
            self._etcd.close()

    async def _campaign(self) -> float:
        """Wait until this controller holds the leader key; returns the loop time until which its lease is valid."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                holder = await self._call(lambda c: c.get(self._key))
                if not holder:
                    sent = loop.time()
                    self._lease_id = (await self._call(lambda c: c.lease(self.ttl_s))).id
                    if await self._call(lambda c: c.create(self._key, self.name.encode(), _lease(self._lease_id, c)),
                                        retry=False):
                        return sent + self.ttl_s
                    await self._resign()  # another controller was faster: drop the unused lease
                elif holder[0] != self._holder:
                    self._holder = holder[0]
                    log.info("leader_observed", leader=holder[0].decode(errors="replace"), me=self.name)
            except StoreUnavailable as exc:
                log.warning("leader_campaign_failed", me=self.name, error=str(exc))
            await asyncio.sleep(POLL_S)

    async def _hold(self, valid_until: float) -> str:
        """Renew the lease while this controller leads; returns why it stopped leading.

        ``valid_until`` (loop time) is when the lease may expire at the latest: its last grant or renewal was sent
        ``ttl_s`` earlier. A renewal that would not finish before it is abandoned, and leadership with it.
        """
        loop = asyncio.get_running_loop()
        delay = self.ttl_s / 3
        while True:
            await asyncio.sleep(min(delay, max(0.0, valid_until - self._timeout_s - loop.time())))
            if loop.time() + self._timeout_s >= valid_until:
                return f"no lease renewal for {self.ttl_s} s"
            sent = loop.time()
            try:
                async with asyncio.timeout_at(valid_until):
                    ttl = await self._call(lambda c: _lease(self._lease_id, c).refresh(), retry=False)
                    holder = await self._call(lambda c: c.get(self._key))
            except (StoreUnavailable, TimeoutError) as exc:
                # A timed-out call may go on in its thread; requests' connection pool is thread-safe.
                log.warning("leader_renewal_failed", leader=self.name, error=str(exc) or "timed out")
                delay = min(0.2, self.ttl_s / 10)
                continue
            if ttl <= 0:
                return "the lease expired"
            if holder != [self.name.encode()]:
                return f"the leader key names {holder[0].decode(errors='replace') if holder else 'nobody'}"
            valid_until = sent + min(ttl, self.ttl_s)
            delay = self.ttl_s / 3

    async def _resign(self) -> None:
        """Revoke this controller's lease, if any (deleting the leader key when it holds it); best effort."""
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                await self._call(lambda c: _lease(lease_id, c).revoke(), retry=False)
            except StoreUnavailable:
                pass  # it expires by itself within ttl_s

    async def _call(self, op: Callable[[Etcd3Client], T], *, retry: bool = True) -> T:
        return await asyncio.to_thread(self._etcd.call, op, retry=retry)


async def _keep_running(lead: LeaderTask | None) -> None:
    """Run ``lead()`` until cancelled, again ``RESTART_S`` after each time it fails or ends; idle without one."""
    if lead is None:
        await asyncio.Event().wait()
    while True:
        try:
            await lead()
            log.error("leader_task_ended")
        except Exception:
            log.exception("leader_task_failed")
        await asyncio.sleep(RESTART_S)


def leadership_for(config: ControllerConfig) -> SoleLeader | EtcdElection:
    """The leadership of a controller configured with ``config``: elected through etcd (named after this host and
    the controller's port), or sole with SQLite."""
    if config.store == "etcd":
        return EtcdElection(config.etcd.endpoints, prefix=config.etcd.prefix, ttl_s=config.etcd.lease_ttl_s,
                            name=f"{socket.gethostname()}:{config.port}")
    return SoleLeader()
