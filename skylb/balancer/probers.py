"""The probers: every probe interval, each local replica (through its engine adapter) and each peer (msgpack status).

Source: SkyLB paper Algorithm 1 MONITORAVAILABILITY (probe every local replica and every peer each interval; the
prototype probes every 100 ms). Answers go into the router (``observe_replica`` / ``observe_peer``); after each
round the dispatcher is woken, since a target may have become available. A prober never dies: a round that raises
is logged and the next one runs. A round waits for its probes at most one interval: a target that hangs (a
partitioned peer) keeps its own probe running, bounded by the probe timeout, and gets no second one meanwhile, but
never delays the next round of the others; its status simply ages until the availability rules call it stale.
A target whose answers this balancer could foresee is probed less often (skylb/balancer/probe_backoff.py): each
round probes only the targets due.
A replica's health is logged when it changes (and so at its first probe): ``replica_unhealthy`` (a warning, with the
reason, e.g. ``engine detection failed: GET /metrics: connection refused``) and ``replica_healthy``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import structlog

from skylb.balancer.probe_backoff import ProbeBackoff, peer_summary, replica_foreseen
from skylb.balancer.protocol import (MAX_STATUS_BYTES, STATUS_PATH, TOKEN_HEADER, ProtocolError, decode_status,
                                     valid_model_ids)
from skylb.core import PeerState, ReplicaState, Router
from skylb.core.fleet_rules import FleetView
from skylb.engines import adapter_for
from skylb.engines.auto import detected_engine

__all__ = ["Probers"]

log = structlog.get_logger("skylb.balancer")


def checked_models(replica_id: str, ids: list) -> list[str]:
    """The model ids replica ``replica_id`` listed that are valid (protocol.valid_model_ids); the others are skipped
    with a warning (an id reaches clients' answers and response headers: one with CR/LF would split a header)."""
    good, bad = valid_model_ids(ids)
    if bad:
        log.warning("replica_model_ids_skipped", replica=replica_id, ids=bad[:10], skipped=len(bad),
                    rule="1 to 512 printable characters")
    return good


#: The most characters of one model entry a replica lists that ``GET /v1/models`` passes on (as JSON); a larger
#: one is passed on as its id alone.
MAX_CARD_CHARS = 4096


def _passed_on(cards: list[dict], ids: list[str]) -> dict[str, dict]:
    """{id: entry} of the entries in ``cards`` whose id is in ``ids`` (the valid ones), each entry no larger than
    MAX_CARD_CHARS as JSON (else ``{"id": id}``)."""
    valid = set(ids)
    return {card["id"]: card if len(json.dumps(card, default=str)) <= MAX_CARD_CHARS else {"id": card["id"]}
            for card in cards if isinstance(card.get("id"), str) and card["id"] in valid}


class Probers:
    """The replica and peer probe loops of one balancer.

    Args:
        router: the region's routing core; session: the shared upstream client session.
        now: the balancer's clock (s); on_round: called after every probe round (wakes the dispatcher).
        interval_s: probe period (s); timeout_s: one probe's timeout (s); peer_token: sent to peers, if set.
        models_refresh_s: seconds between two reads of a replica's model list.
        max_backoff: the longest interval of a target whose answers are foreseen, in probe intervals (1: every
            target every interval).
    """

    def __init__(self, router: Router, session: aiohttp.ClientSession, *, now: Callable[[], float],
                 on_round: Callable[[], None], interval_s: float, timeout_s: float, peer_token: str | None,
                 models_refresh_s: float = 30.0, max_backoff: int = 8):
        self.router = router
        self.session = session
        self.now = now
        self.on_round = on_round
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.peer_headers = {TOKEN_HEADER: peer_token} if peer_token else {}
        self.models_refresh_s = models_refresh_s
        #: replica id -> when its model list was last read (s, balancer clock); only replicas still known.
        self._models_read_at: dict[str, float] = {}
        #: The probe in flight per target, ("replica", id) or ("peer", region).
        self._probing: dict[tuple[str, str], asyncio.Task] = {}
        self.backoff = ProbeBackoff(interval_s, max_backoff)

    def tasks(self) -> list[asyncio.Task]:
        """Start both loops; the caller cancels the tasks to stop them."""
        return [asyncio.create_task(self._every_interval(self.probe_replicas)),
                asyncio.create_task(self._every_interval(self.probe_peers))]

    async def _every_interval(self, probe_all: Callable[[], Awaitable[None]]) -> None:
        try:
            while True:
                started = self.now()
                try:
                    await probe_all()
                except Exception:  # a prober must never die: log and keep probing
                    log.exception("probe_round_failed")
                self.on_round()
                await asyncio.sleep(max(0.0, self.interval_s - (self.now() - started)))
        finally:
            for task in self._probing.values():
                task.cancel()

    async def _round(self, kind: str, probes: list[tuple[tuple[str, str], Callable[[], Awaitable[None]]]]) -> None:
        """Start a probe for every target of ``kind`` ("replica", "peer") due without one in flight; wait for them
        at most one interval."""
        running = []
        now = self.now()
        self.backoff.forget(kind, {key for key, _ in probes})
        for key, start in probes:
            task = self._probing.get(key)
            if task is None or task.done():
                if not self.backoff.due(key, now):
                    continue
                task = asyncio.create_task(start())
                task.add_done_callback(self._log_failure)
                self._probing[key] = task
            running.append(task)
        if running:
            await asyncio.wait(running, timeout=self.interval_s)
        for key in [k for k, t in self._probing.items() if t.done()]:
            del self._probing[key]

    def probe_unprobed(self) -> None:
        """Probe at once every local replica never probed yet (membership just added it), rather than at the next
        round: with a long probe interval a new replica would otherwise sit unused for up to one interval. Each
        answer wakes the dispatcher (``on_round``)."""
        for state in list(self.router.replicas.values()):
            key = ("replica", state.id)
            task = self._probing.get(key)
            if state.probed_at is None and (task is None or task.done()):
                task = asyncio.create_task(self._probe_replica(state))
                task.add_done_callback(self._log_failure)
                task.add_done_callback(lambda _t: self.on_round())
                self._probing[key] = task

    def _log_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("probe_failed", exc_info=task.exception())

    async def probe_replicas(self) -> None:
        """One round over the local replicas: load signal, health, and (every ``models_refresh_s``) the models. A
        replica a routing rule waits on (``ReplicaState.probe_wanted``) is probed in this round, whatever its
        backoff."""
        for gone in set(self._models_read_at) - set(self.router.replicas):
            del self._models_read_at[gone]
        for state in self.router.replicas.values():
            if state.probe_wanted:  # a rule waits on this probe (ReplicaState.probe_wanted): no backoff
                self.backoff.reset(("replica", state.id))
        await self._round("replica", [(("replica", r.id), lambda r=r: self._probe_replica(r))
                           for r in list(self.router.replicas.values())])

    async def _probe_replica(self, state: ReplicaState) -> None:
        try:
            adapter = adapter_for(state.engine)
        except ValueError as exc:
            self.router.observe_replica(state.id, now=self.now(), healthy=False, error=str(exc))
            return
        sent_at, outstanding = self.now(), state.outstanding
        result = await adapter.probe(self.session, state.url, timeout_s=self.timeout_s,
                                     outstanding=state.outstanding, max_concurrency=state.max_concurrency)
        before = (state.probed_at is not None, state.healthy, state.error)
        limit_before = state.capacity.limit
        self.router.observe_replica(state.id, now=self.now(), healthy=result.healthy, pending=result.pending,
                                    running=result.running, error=result.error, slots=result.slots,
                                    probe_sent_at=sent_at, kv_usage=result.kv_usage,
                                    kv_capacity_tokens=result.kv_capacity_tokens,
                                    output_reserve_tokens=result.output_reserve_tokens,
                                    output_reserve_ratio=result.output_reserve_ratio)
        if self.router.replicas.get(state.id) is state:
            grace = self.backoff.answered(("replica", state.id), sent_at,
                                          foreseen=replica_foreseen(state, outstanding, limit_before))
            if grace != state.stale_grace_s:  # a write clears the availability memo: only when it changes
                state.stale_grace_s = grace
        _log_health_change(state, before)
        if state.capacity.limit != limit_before:
            log.debug("admission_capacity_changed", replica=state.id, limit=state.capacity.limit,
                      limit_before=limit_before, proven=state.capacity.proven_limit, pending=state.pending,
                      running=state.running)
        read_at = self._models_read_at.get(state.id)
        due = state.models is None or read_at is None or self.now() - read_at >= self.models_refresh_s
        engine = detected_engine(state.url) if state.engine == "auto" else state.engine
        if result.healthy and engine == "ollama":
            await self._probe_ollama_models(state)
        if result.healthy and due:
            if engine == "ollama":  # Ollama serves its own API besides the OpenAI one
                state.apis = frozenset({"openai", "ollama"})
            try:
                cards = await adapter.model_cards(self.session, state.url, timeout_s=self.timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return  # keep the list we have; retried at the next probe
            self._models_read_at[state.id] = self.now()
            models = checked_models(state.id, [card["id"] for card in cards])
            state.model_cards = _passed_on(cards, models)
            if frozenset(models) != state.models:
                self.router.set_replica_models(state.id, models)

    async def _probe_ollama_models(self, state: ReplicaState) -> None:
        """Every round: the loaded models (``/api/ps``), and when the model list is due, the models on disk with
        their sizes (``/api/tags``), into the replica's thermal state (skylb/core/fleet_rules.py)."""
        adapter = adapter_for("ollama")
        view = state.fleet or FleetView()
        try:
            loaded = await adapter.model_slots(self.session, state.url, "/api/ps", timeout_s=self.timeout_s)
            read_at = self._models_read_at.get(state.id)
            if view.disk is None or read_at is None or self.now() - read_at >= self.models_refresh_s:
                view.observe_tags(await adapter.model_slots(self.session, state.url, "/api/tags",
                                                            timeout_s=self.timeout_s))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return  # keep what we know; the next round reads again
        view.observe_ps(loaded, self.now())
        state.fleet = view

    async def probe_peers(self) -> None:
        """One round over the peers: each one's msgpack status, or why it could not be read. A peer that got a
        request since its latest status is probed in this round, whatever its backoff."""
        for peer in self.router.peers.values():
            if peer.sent_since_probe:
                self.backoff.reset(("peer", peer.region))
        await self._round("peer", [(("peer", p.region), lambda p=p: self._probe_peer(p))
                           for p in list(self.router.peers.values())])

    async def _probe_peer(self, peer: PeerState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        sent_at, before = self.now(), (peer_summary(peer) if not peer.sent_since_probe else None)
        try:
            async with self.session.get(peer.url + STATUS_PATH, timeout=timeout, headers=self.peer_headers) as resp:
                if resp.status != 200:
                    raise ProtocolError(f"status answered HTTP {resp.status}")
                status = decode_status(await _read_at_most(resp, MAX_STATUS_BYTES))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError) as exc:
            peer.stale_grace_s = self.backoff.answered(("peer", peer.region), sent_at, foreseen=False)
            self.router.observe_peer(peer.region, now=self.now(), status=None, error=str(exc) or type(exc).__name__)
            return
        now = self.now()
        self.router.observe_peer(peer.region, now=now, status=status, rtt_s=now - sent_at)
        peer.stale_grace_s = self.backoff.answered(("peer", peer.region), sent_at,
                                                   foreseen=before is not None and peer_summary(peer) == before)


def _log_health_change(state: ReplicaState, before: tuple[bool, bool, str | None]) -> None:
    """Log ``state``'s health when it differs from ``before`` = (probed, healthy, error) of the previous probe: an
    operator sees at start, and at each change, which replica cannot be used and why, without polling the status."""
    if before == (True, state.healthy, state.error):
        return
    engine = (detected_engine(state.url) or state.engine) if state.engine == "auto" else state.engine
    if state.healthy:
        log.info("replica_healthy", replica=state.id, url=state.url, engine=engine)
    else:
        log.warning("replica_unhealthy", replica=state.id, url=state.url, reason=state.error,
                    detail="no request goes to this replica until a probe succeeds")


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``; ProtocolError as soon as it passes ``limit`` bytes (a garbage "status" from a broken or
    hostile peer is not read into memory whole)."""
    data = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > limit:
            raise ProtocolError(f"peer status is more than {limit} bytes")
    return bytes(data)
