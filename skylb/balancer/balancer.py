"""The balancer's live state: the router, the dispatcher loop, and the probers of replicas and peers.

Source: SkyLB paper Algorithm 1: MONITORAVAILABILITY (probe every local replica and every peer each probe interval)
and HANDLEREQUEST (the head of the FCFS queue goes to an available replica, else an available peer, else waits).
The dispatcher runs whenever something changes (a request arrives or ends, a probe answers) and at least every
``dispatch_tick_ms`` (the prototype's 10 ms loop).
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import structlog

from skylb.balancer.membership import MembershipWatcher
from skylb.balancer.metrics import BalancerMetrics
from skylb.balancer.protocol import STATUS_PATH, TOKEN_HEADER, ProtocolError, decode_status
from skylb.config import BalancerConfig
from skylb.core import Decision, QueueFull, Request, build_router
from skylb.engines import adapter_for
from skylb.engines.auto import detected_engine

__all__ = ["Balancer", "QueueTimeout", "QueueFull"]

log = structlog.get_logger("skylb.balancer")


class QueueTimeout(Exception):
    """A request waited longer than ``queue_timeout_s`` without an available target."""


class Balancer:
    """One region's balancer state and background loops.

    Args:
        cfg: the balancer's settings; region: its region; advertise_url: how peers and the controller reach it.
    """

    def __init__(self, cfg: BalancerConfig, *, region: str, advertise_url: str):
        self.cfg = cfg
        self.region = region
        self.advertise_url = advertise_url
        self.router = build_router(region, cfg)
        self.metrics = BalancerMetrics(self)
        self.session: aiohttp.ClientSession | None = None
        self.membership: MembershipWatcher | None = None
        self._waiting: dict[str, asyncio.Future] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def now(self) -> float:
        """The balancer's clock: the event loop's monotonic time, s."""
        return asyncio.get_running_loop().time()

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the upstream session, load membership, start the dispatcher, probers and controller watch."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                        sock_read=self.cfg.read_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             auto_decompress=False)
        self.membership = MembershipWatcher(
            region=self.region, advertise_url=self.advertise_url, controller_url=self.cfg.controller_url,
            state_dir=self.cfg.state_dir, apply=self.apply_membership, session=self.session)
        self.membership.load_persisted()
        self.membership.start()
        self._tasks = [asyncio.create_task(self._dispatch_loop()), asyncio.create_task(self._probe_replicas()),
                       asyncio.create_task(self._probe_peers())]

    async def stop(self) -> None:
        """Stop every loop, fail queued requests with QueueTimeout, close the session."""
        if self.membership:
            await self.membership.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(QueueTimeout("balancer shutting down"))
        if self.session:
            await self.session.close()

    def apply_membership(self, snapshot: dict) -> None:
        """Apply a controller snapshot: this region's replicas, other regions' balancers as peers."""
        replicas = [(r["id"], r["url"].rstrip("/"), r.get("engine", "vllm"))
                    for r in snapshot.get("replicas", []) if r.get("region") == self.region]
        peers = [(b["region"], self.cfg.peer_urls.get(b["region"], b["url"]).rstrip("/"))
                 for b in snapshot.get("balancers", []) if b.get("region") != self.region]
        limits = {r["id"]: r.get("max_concurrency") for r in snapshot.get("replicas", [])
                  if r.get("region") == self.region}
        self.router.set_replicas(replicas, max_concurrency=limits)
        self.router.set_peers(peers)
        self._wake.set()

    # -- the queue ----------------------------------------------------------------------------------------------
    async def acquire(self, request: Request, *, retry: bool = False) -> Decision:
        """Queue ``request`` and wait for its routing decision.

        ``retry`` puts it back at the head (its target failed before the first byte). Raises QueueFull,
        QueueTimeout; if the waiting task is cancelled (client gone) the request leaves the queue, or, if it was
        already placed, its decision is released.
        """
        fut = asyncio.get_running_loop().create_future()
        if retry:
            self.router.requeue(request)
        else:
            self.router.enqueue(request)
        self._waiting[request.id] = fut
        self._dispatch_once()  # place it now if it can be: no round trip through the dispatcher task
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
        self.router.finished(decision)
        self._wake.set()

    async def _dispatch_loop(self) -> None:
        tick = self.cfg.dispatch_tick_ms / 1000
        while True:
            try:
                async with asyncio.timeout(tick):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            self._dispatch_once()

    def _dispatch_once(self) -> None:
        """Expire overdue requests and place every request the head of the queue lets through (synchronous)."""
        now = self.now()
        for request in self.router.expire(now, self.cfg.queue_timeout_s):
            fut = self._waiting.get(request.id)
            if fut and not fut.done():
                fut.set_exception(QueueTimeout(
                    f"no replica in region {self.region} or its peers had room for {self.cfg.queue_timeout_s:g} s"))
        for decision in self.router.dispatch(now):
            fut = self._waiting.get(decision.request.id)
            if fut is None or fut.done():  # its client left between the queue and here
                self.router.finished(decision)
                continue
            fut.set_result(decision)
            route = "local" if decision.kind == "replica" else "peer"
            self.metrics.routed.labels(self.region, route, decision.target).inc()
            self.metrics.queue_wait.labels(self.region).observe(decision.queued_s)

    # -- probers ------------------------------------------------------------------------------------------------
    async def _every_interval(self, probe_all) -> None:
        interval = self.cfg.probe_interval_ms / 1000
        while True:
            started = self.now()
            try:
                await probe_all()
            except Exception:  # a prober must never die: log and keep probing
                log.exception("probe_round_failed", region=self.region)
            self._wake.set()
            await asyncio.sleep(max(0.0, interval - (self.now() - started)))

    async def _probe_replicas(self) -> None:
        await self._every_interval(self._probe_replicas_once)

    async def _probe_peers(self) -> None:
        await self._every_interval(self._probe_peers_once)

    async def _probe_replicas_once(self) -> None:
        timeout_s = self.cfg.probe_timeout_ms / 1000
        replicas = list(self.router.replicas.values())

        async def probe(state):
            try:
                adapter = adapter_for(state.engine)
            except ValueError as exc:
                self.router.observe_replica(state.id, now=self.now(), healthy=False, error=str(exc))
                return
            sent_at = self.now()
            result = await adapter.probe(self.session, state.url, timeout_s=timeout_s,
                                         outstanding=state.outstanding, max_concurrency=state.max_concurrency)
            self.router.observe_replica(state.id, now=self.now(), healthy=result.healthy, pending=result.pending,
                                        running=result.running, error=result.error, capacity=result.capacity,
                                        probe_sent_at=sent_at)
            if result.healthy and state.models is None:
                engine = detected_engine(state.url) if state.engine == "auto" else state.engine
                if engine == "ollama":  # Ollama serves its own API besides the OpenAI one
                    state.apis = frozenset({"openai", "ollama"})
                try:
                    models = await adapter.models(self.session, state.url, timeout_s=timeout_s)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    return  # retried at the next probe
                self.router.set_replica_models(state.id, models)

        await asyncio.gather(*(probe(r) for r in replicas))

    async def _probe_peers_once(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.probe_timeout_ms / 1000)
        headers = {TOKEN_HEADER: self.cfg.peer_token} if self.cfg.peer_token else {}

        async def probe(peer):
            try:
                async with self.session.get(peer.url + STATUS_PATH, timeout=timeout, headers=headers) as resp:
                    if resp.status != 200:
                        raise ProtocolError(f"status answered HTTP {resp.status}")
                    status = decode_status(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError) as exc:
                self.router.observe_peer(peer.region, now=self.now(), status=None,
                                         error=str(exc) or type(exc).__name__)
                return
            self.router.observe_peer(peer.region, now=self.now(), status=status)

        await asyncio.gather(*(probe(p) for p in list(self.router.peers.values())))

    # -- status -------------------------------------------------------------------------------------------------
    def served_models(self, api: str = "openai") -> list[str]:
        """The models this region can serve in dialect ``api``: its replicas' and, by forwarding, its peers'."""
        return sorted(self.router.served_models(api))

    def detailed_status(self) -> dict:
        """A JSON-able view for operators: every replica and peer with its availability and the reason."""
        now, router = self.now(), self.router
        return {
            **dataclasses.asdict(router.status(now)),
            "policy": self.cfg.policy,
            "controller_reachable": bool(self.membership and self.membership.controller_reachable),
            "membership_revision": self.membership.revision if self.membership else None,
            "replicas": [
                {"id": r.id, "url": r.url, "engine": r.engine, "healthy": r.healthy, "pending": r.pending,
                 "running": r.running, "outstanding": r.outstanding, "draining": r.draining, "served": r.served,
                 "available": router.rules.replica_available(r, now),
                 "reason": router.rules.replica_unavailable_reason(r, now),
                 "probe_age_ms": None if r.probed_at is None else round((now - r.probed_at) * 1000, 1),
                 "models": sorted(r.models or ()), "apis": sorted(r.apis)}
                for r in router.replicas.values()],
            "peers": [
                {"region": p.region, "url": p.url, "healthy": p.healthy, "available_replicas": p.available_replicas,
                 "queue_len": p.queue_len, "forwarded": p.forwarded, "models": p.models, "outstanding": p.outstanding,
                 "available": router.rules.peer_available(p, now),
                 "reason": router.rules.peer_unavailable_reason(p, now)}
                for p in router.peers.values()],
        }
