"""Following a replica's KV-cache event stream (vLLM ``--kv-events-config``) into the block index.

Source: vLLM ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``) and its example subscriber
(``examples/online_serving/kv_events_subscriber.py``). The engine binds a ZMQ PUB socket (``endpoint``) and, when
``replay_endpoint`` is set, a ROUTER socket holding its last ``buffer_steps`` batches. Per replica this module keeps:

- a SUB socket on the topic: messages ``[topic, seq (8 bytes, big-endian), payload]``, decoded by
  :mod:`skylb.engines.kv_wire` and applied to the :class:`~skylb.core.kv_index.BlockIndex`;
- a DEALER socket on the replay endpoint: a request is ``[b"", start seq (8 bytes, big-endian)]``; the answer is
  ``[b"", topic, seq, payload]`` per buffered batch from ``start`` on (earlier releases: ``[b"", seq, payload]``),
  then ``[b"", b"", -1 (8 bytes, signed), b""]``;
- the SUB socket's monitor: a completed handshake marks the replica live, a disconnect (the engine died, or ZMTP
  heartbeats went unanswered for ``heartbeat_timeout_s``) marks it stale. Stale, the index drops what it knew and
  the router uses the prefix trie for that replica; on reconnect it starts from nothing and catches up from the
  replay buffer.

Sequence numbers: a gap (a batch the PUB socket dropped at its high-water mark, or lost while reconnecting) is filled
from the replay socket; when the buffer no longer holds it (or no replay endpoint is set, or the replay times out)
the replica's blocks are dropped, since a missed ``BlockRemoved`` would otherwise leave a block it no longer holds.
A sequence number that goes back means the engine restarted (its cache is empty): its blocks are dropped. The first
batch after connecting triggers a replay from 0, which recovers whatever the engine's buffer still holds.

With data parallelism vLLM publishes rank r on the endpoint's port + r: follow each rank as its own replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from skylb.core.kv_endpoint import KVEventsEndpoint
from skylb.core.kv_events import apply_events
from skylb.core.kv_index import BlockIndex
from skylb.engines.kv_wire import CorruptBatch, decode_batch

__all__ = ["KVEventSubscriber", "KVEventSubscribers", "KVEventsEndpoint"]

log = structlog.get_logger("skylb.kv_events")


class KVEventSubscriber:
    """Follows one replica's event stream into ``index`` until ``run()`` is cancelled (its sockets then close).

    Args:
        index: the block index it feeds (shared by all replicas); replica: the replica id used in the index;
        source: the replica's endpoints; replay_timeout_s: the longest wait for one replay answer (s);
        heartbeat_s / heartbeat_timeout_s: ZMTP heartbeat interval and the silence after which the connection is
            closed (s); context: a ``zmq.asyncio.Context`` (default: the process's shared one, never terminated).
    """

    def __init__(self, index: BlockIndex, replica: str, source: KVEventsEndpoint, *, replay_timeout_s: float = 1.0,
                 heartbeat_s: float = 1.0, heartbeat_timeout_s: float = 3.0,
                 context: zmq.asyncio.Context | None = None):
        self.index = index
        self.replica = replica
        self.source = source
        self.replay_timeout_s = replay_timeout_s
        self._heartbeat_ms = (int(heartbeat_s * 1000), int(heartbeat_timeout_s * 1000))
        self._context = context or zmq.asyncio.Context.instance()
        self._last_seq: int | None = None
        self._dealer: zmq.asyncio.Socket | None = None

    async def run(self) -> None:
        """Subscribe and follow until cancelled; the replica is stale once this returns."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms[0])
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms[1])
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.source.endpoint)
            await asyncio.gather(self._follow_monitor(monitor), self._follow_stream(sub))
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._close_dealer()
            if self.replica in self.index.replicas:  # not when the replica was forgotten (it left membership)
                self.index.mark_stale(self.replica)

    async def _follow_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # A new connection: the engine may have restarted, so nothing known before holds.
                self.index.drop(self.replica)
                self.index.mark_live(self.replica)
                self._last_seq = None
                log.info("kv_events_connected", replica=self.replica, endpoint=self.source.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.index.mark_stale(self.replica)
                self._last_seq = None
                log.warning("kv_events_disconnected", replica=self.replica, endpoint=self.source.endpoint)

    async def _follow_stream(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                await self.on_message(frames)
            except (zmq.ZMQError, ValueError, TypeError) as exc:  # no message may stop the stream
                self.index.replica(self.replica).skipped_corrupt += 1
                log.error("kv_events_message_failed", replica=self.replica, error=repr(exc))

    async def on_message(self, frames: list[bytes]) -> None:
        """Handle one PUB message: fill a gap before it from the replay socket, then apply it."""
        state = self.index.replica(self.replica)
        if len(frames) != 3 or len(frames[1]) != 8:
            state.skipped_corrupt += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = self._last_seq
        if last is not None and seq <= last:  # a publisher's sequence only grows: the engine restarted
            log.warning("kv_events_restarted", replica=self.replica, seq=seq, last_seq=last)
            self.index.drop(self.replica)
            self._last_seq = last = None
        if last is None and seq > 0:
            await self._replay(0, seq)  # catch up on what the engine's buffer still holds
        elif last is not None and seq > last + 1:
            state.gaps += 1
            await self._replay(last + 1, seq)
        if self._last_seq is None or seq > self._last_seq:
            self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch; a hole before it that replay could not fill drops the replica's blocks first."""
        state = self.index.replica(self.replica)
        if self._last_seq is not None and seq > self._last_seq + 1:
            state.unfilled_gaps += 1
            self.index.drop(self.replica)
            log.warning("kv_events_gap_unfilled", replica=self.replica, missing_from=self._last_seq + 1, seq=seq)
        self._last_seq = seq
        state.batches += 1
        try:
            batch = decode_batch(payload)
        except CorruptBatch:
            state.skipped_corrupt += 1
            return
        state.skipped_unknown += batch.unknown
        state.skipped_corrupt += batch.corrupt
        apply_events(self.index, self.replica, batch.events)

    async def _replay(self, start: int, until: int) -> None:
        """Apply the buffered batches from ``start`` up to (not including) ``until`` from the replay socket."""
        if self.source.replay_endpoint is None:
            return
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.source.replay_endpoint)
        await self._dealer.send_multipart([b"", start.to_bytes(8, "big")])
        state = self.index.replica(self.replica)
        try:
            while True:
                frames = await asyncio.wait_for(self._dealer.recv_multipart(), self.replay_timeout_s)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                    state.skipped_corrupt += 1
                    continue
                seq, payload = int.from_bytes(frames[-2], "big", signed=True), frames[-1]
                if seq < 0 or not payload:
                    return  # the end marker
                if seq < until and (self._last_seq is None or seq > self._last_seq):
                    state.replayed += 1
                    self._apply(seq, payload)
        except asyncio.TimeoutError:
            # Late answers must not mix with the next request's: start the next replay on a fresh socket.
            log.warning("kv_events_replay_timeout", replica=self.replica, start=start)
            self._close_dealer()

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


class KVEventSubscribers:
    """One :class:`KVEventSubscriber` task per replica that publishes events, kept in step with the membership.

    ``update({replica: endpoint})`` starts subscribers for new replicas, restarts those whose endpoint changed and
    stops (and forgets in the index) those gone; ``close()`` stops all. Options are passed to each subscriber.
    """

    def __init__(self, index: BlockIndex, **options):
        self.index = index
        self._options = options
        self._tasks: dict[str, tuple[KVEventsEndpoint, asyncio.Task]] = {}

    def update(self, endpoints: Mapping[str, KVEventsEndpoint]) -> None:
        """Follow exactly the replicas in ``endpoints`` (must run inside the event loop)."""
        for replica in [r for r, (source, _) in self._tasks.items() if endpoints.get(r) != source]:
            self._tasks.pop(replica)[1].cancel()
            if replica not in endpoints:
                self.index.forget(replica)
        for replica, source in endpoints.items():
            if replica not in self._tasks:
                subscriber = KVEventSubscriber(self.index, replica, source, **self._options)
                self._tasks[replica] = (source, asyncio.create_task(subscriber.run(), name=f"kv-events {replica}"))

    async def close(self) -> None:
        """Stop every subscriber and wait until their sockets are closed."""
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
