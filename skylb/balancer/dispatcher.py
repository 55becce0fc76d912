"""The dispatcher: requests wait in the router's queue and get their routing decision here.

Source: SkyLB paper Algorithm 1 HANDLEREQUEST (the head of the FCFS queue goes to an available replica, else an
available peer, else waits) and §4.1 "Request life cycle". The dispatcher runs whenever something changes (a request
arrives or ends, a probe answers: ``wake``) and at least every ``dispatch_tick_ms`` (the prototype's 10 ms loop).
A request that can be placed at once is placed inline by ``acquire``, without a round trip through the loop.
A request that cannot be placed holds back only requests of its own candidate set (skylb/core/router.py
``Router.dispatch``); one whose model no usable replica or peer serves fails with NoHealthyTarget once that has
lasted ``no_target_timeout_s`` (it waits at most that plus one tick past the moment its last target went).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from skylb.core import Decision, QueueFull, Request, Router

__all__ = ["Dispatcher", "QueueTimeout", "QueueFull", "NoHealthyTarget"]


class QueueTimeout(Exception):
    """A request waited longer than ``queue_timeout_s`` without an available target (or the balancer stopped)."""


class NoHealthyTarget(Exception):
    """No usable replica here or peer serves a queued request's model, and that lasted ``no_target_timeout_s``
    (Envoy's "no healthy upstream")."""


class Dispatcher:
    """Hands routing decisions to the requests waiting in ``router``'s queue.

    Args:
        router: the region's routing core. now: the balancer's clock (s).
        queue_timeout_s: the longest a request may wait (s). tick_s: the loop's longest sleep (s).
        no_target_timeout_s: how long a queued request's model may have no usable target before the request fails
            with NoHealthyTarget (s; ``Router.unserved``).
        on_routed: called with each decision handed to a waiting request (metrics).
    """

    def __init__(self, router: Router, *, now: Callable[[], float], queue_timeout_s: float, tick_s: float,
                 no_target_timeout_s: float = 5.0, on_routed: Callable[[Decision], None] = lambda d: None):
        self.router = router
        self.now = now
        self.queue_timeout_s = queue_timeout_s
        self.no_target_timeout_s = no_target_timeout_s
        self.tick_s = tick_s
        self.on_routed = on_routed
        self._waiting: dict[str, asyncio.Future] = {}
        self._wake = asyncio.Event()
        #: Set by ``close``: why no request is queued any more (the balancer is stopping).
        self.closed: str | None = None

    def wake(self) -> None:
        """Something changed (membership, a probe answer, a finished request): run the loop soon, if a request
        waits (with none queued a turn of the loop would place and expire nothing)."""
        if self.router.queue:
            self._wake.set()

    async def acquire(self, request: Request, *, retry: bool = False) -> Decision:
        """Queue ``request`` and wait for its routing decision.

        ``retry`` puts it back at the head (its target failed before the first byte). Raises QueueFull,
        QueueTimeout, NoHealthyTarget; if the waiting task is cancelled (client gone) the request leaves the queue, or, if it was
        already placed, its decision is released.
        """
        if self.closed is not None:
            raise QueueTimeout(self.closed)
        fut = asyncio.get_running_loop().create_future()
        if retry:
            self.router.requeue(request)
        else:
            self.router.enqueue(request)
        self._waiting[request.id] = fut
        self.dispatch_once()  # place it now if it can be: no round trip through the loop
        if not fut.done():
            self.wake()  # it waits: the loop ticks again (it sleeps while nothing is queued)
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.router.cancel(request.id) and fut.done() and not fut.cancelled() \
                    and fut.exception() is None:
                self.release(fut.result())
            raise
        finally:
            self._waiting.pop(request.id, None)

    def release(self, decision: Decision) -> None:
        """The response of ``decision`` ended: free its target's slot and let the queue move."""
        self.router.finished(decision, self.now())
        self.wake()

    async def run(self) -> None:
        """The dispatch loop: on every wake, and at least every ``tick_s`` while a request is queued; runs until
        cancelled. With nothing queued there is nothing to expire or place, so it sleeps until woken rather than
        turning 1000 / ``dispatch_tick_ms`` times a second on an idle balancer (``acquire`` wakes it when a request
        stays queued)."""
        while True:
            try:
                async with asyncio.timeout(self.tick_s if self.router.queue else None):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            self.dispatch_once()

    def dispatch_once(self) -> None:
        """Expire overdue requests, place every request that can be placed, then fail those whose model has had no
        usable target for ``no_target_timeout_s`` (synchronous)."""
        now = self.now()
        for request in self.router.expire(now, self.queue_timeout_s):
            self._fail(request, QueueTimeout(f"no replica in region {self.router.region} or its peers had room "
                                             f"for {self.queue_timeout_s:g} s"))
        self._place(now)
        if self.router.queue:
            for request in self.router.unserved(now, self.no_target_timeout_s):
                self._fail(request, NoHealthyTarget(
                    f"model '{request.model}' is served by no healthy replica in region {self.router.region} or its "
                    f"peers (for {self.no_target_timeout_s:g} s); retry later"))

    def _fail(self, request: Request, exc: Exception) -> None:
        fut = self._waiting.get(request.id)
        if fut and not fut.done():
            fut.set_exception(exc)

    def _place(self, now: float) -> None:
        for decision in self.router.dispatch(now):
            fut = self._waiting.get(decision.request.id)
            if fut is None or fut.done():  # its client left between the queue and here
                self.router.finished(decision)
                continue
            fut.set_result(decision)
            self.on_routed(decision)

    def fail_waiting(self, reason: str) -> None:
        """Fail every waiting request with QueueTimeout(``reason``) (the balancer is stopping)."""
        for request_id, fut in list(self._waiting.items()):
            if not fut.done():
                self.router.cancel(request_id)
                fut.set_exception(QueueTimeout(reason))

    def close(self, reason: str) -> None:
        """Fail every waiting request and every later ``acquire`` with QueueTimeout(``reason``) (end of a drain)."""
        self.closed = reason
        self.fail_waiting(reason)
