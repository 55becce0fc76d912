"""The emulator's KV-cache event publisher: vLLM's ``--kv-events-config``, its ZMQ sockets and its exact bytes.

Source: vLLM 0.33 ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``, ``KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) and ``vllm/config/kv_events.py`` (``KVEventsConfig``). Each engine step's
events go out as one message ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB socket, and into a buffer of the
last ``buffer_steps`` messages that a ROUTER socket (``replay_endpoint``) replays: a request ``[id, b"", start]``
is answered ``[id, b"", topic, seq, payload]`` per buffered message from ``start`` on, then
``[id, b"", b"", -1 (8 bytes, signed), b""]``. The payload is encoded byte for byte as msgspec encodes vLLM's
structs (checked against ``tests/fixtures/kv_events``): the batch as the array ``[ts, events, data_parallel_rank]``,
each event as a map whose first key ``"type"`` holds the class name, fields equal to their default omitted, and a
16-bit map header for ``BlockStored`` (msgspec reserves one for a struct of more than 15 fields).

As vLLM, an endpoint with ``*`` (or ``::``, ``ipc://``, ``inproc://``) is bound and any other is connected to; here a
``*`` host binds the emulator's own ``--host`` (loopback by default) and replica i of one process publishes on the
port + i (vLLM offsets data-parallel ranks so). ``drop_next(n)`` (tests, chaos) keeps the next n messages off the
PUB socket but in the replay buffer, as messages lost at the high-water mark are; with ``--fault-control`` it is
``PUT /emulator/kv-events {"drop_next": n}`` (:func:`add_kv_event_routes`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, fields

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from skylb.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["KVEventsConfig", "KVEventPublisher", "add_kv_event_routes", "encode_batch", "END_SEQ",
           "KV_EVENTS_PATH"]

KV_EVENTS_PATH = "/emulator/kv-events"

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The fields without a default, after the tag, in declaration order (vLLM 0.33); of those with one, only
#: ``extra_keys`` (when set) and ``group_idx`` (0, not its default None) are written: the others are left None.
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED = ("block_hashes", "medium")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (``--kv-events-config`` JSON); ``max_queue_size`` is accepted and unused
    (the emulator publishes inline, without vLLM's publisher thread and queue)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse the flag's JSON. Raises ValueError naming an unknown key, a wrong type or an unknown publisher."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(raw) - set(known)):
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        for key, value in raw.items():
            kind = {"enable_kv_cache_events": (bool,), "buffer_steps": (int,), "hwm": (int,),
                    "max_queue_size": (int,)}.get(key, (str, type(None)) if key in ("publisher", "replay_endpoint")
                                                  else (str,))
            if not isinstance(value, kind) or (kind == (int,) and (isinstance(value, bool) or value < 1)):
                raise ValueError(f"--kv-events-config: {key} has the wrong type or value: {value!r}")
        config = cls(**raw)
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {publisher!r} (zmq or null)")
        return cls(**{**raw, "publisher": publisher})

    @property
    def enabled(self) -> bool:
        """Whether events are published (vLLM: enabled and publisher "zmq")."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _map(pairs: list[tuple[str, object]], wide: bool, packer: msgpack.Packer) -> bytes:
    head = b"\xde" + len(pairs).to_bytes(2, "big") if wide else bytes([0x80 | len(pairs)])
    return head + b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)


def _event(event: KVEvent, packer: msgpack.Packer) -> bytes:
    """One event as msgspec encodes vLLM's struct (KV cache group 0)."""
    if isinstance(event, BlockStored):
        extra = [("extra_keys", event.extra_keys)] if event.extra_keys is not None else []
        return _map([("type", "BlockStored"), *zip(_STORED, event[:7]), *extra, ("group_idx", 0)], True, packer)
    if isinstance(event, BlockRemoved):
        return _map([("type", "BlockRemoved"), *zip(_REMOVED, event), ("group_idx", 0)], False, packer)
    if isinstance(event, AllBlocksCleared):
        return _map([("type", "AllBlocksCleared")], False, packer)
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """A ``KVEventBatch`` payload, byte for byte as vLLM 0.33's msgspec encoder writes it."""
    packer = msgpack.Packer(use_bin_type=True, use_single_float=False)
    body = b"".join(_event(e, packer) for e in events)
    count = len(events)
    head = bytes([0x90 | count]) if count < 16 else b"\xdc" + count.to_bytes(2, "big")
    return b"\x93" + packer.pack(float(ts)) + head + body + packer.pack(data_parallel_rank)


def _endpoint(endpoint: str, host: str, offset: int) -> tuple[str, bool]:
    """(the endpoint to use, whether to bind it): vLLM's bind heuristic and data-parallel port offset."""
    bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if offset and int(port):
            endpoint = f"{base}:{int(port) + offset}"
        endpoint = endpoint.replace("*", host, 1)
    return endpoint, bind


class KVEventPublisher:
    """One replica's PUB socket, replay buffer and ROUTER socket; ``start()`` then ``publish()``, ``close()``.

    Args:
        config: the parsed ``--kv-events-config``; host: the address a ``*`` binds; offset: added to the ports
            (the replica's index in its process); context: a ``zmq.asyncio.Context`` (default: the shared one).
    """

    def __init__(self, config: KVEventsConfig, *, host: str = "127.0.0.1", offset: int = 0,
                 context: zmq.asyncio.Context | None = None):
        self.config = config
        self._host, self._offset = host, offset
        self._context = context or zmq.asyncio.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._drop = 0
        self._topic = config.topic.encode()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        #: The endpoints actually bound or connected (a port 0 resolved), for clients and logs.
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None

    #: True once ``close`` ran: batches are no longer sent.
    closed = False

    def start(self) -> None:
        """Bind or connect the sockets and start answering replays (inside the event loop)."""
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(self.config.hwm)
        self.endpoint = self._attach(self._pub, self.config.endpoint)
        if self.config.replay_endpoint:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
            self.replay_endpoint = self._attach(self._router, self.config.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replays(), name="kv-events replay")

    def _attach(self, socket: zmq.asyncio.Socket, configured: str) -> str:
        endpoint, bind = _endpoint(configured, self._host, self._offset)
        if not bind:
            socket.connect(endpoint)
            return endpoint
        socket.bind(endpoint)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent], *, ts: float | None = None) -> int:
        """Send one batch (one engine step's events); returns its sequence number. Never blocks: a PUB socket
        drops messages past its high-water mark, and the replay buffer still holds them."""
        seq = self._seq
        self._seq += 1
        payload = encode_batch(time.time() if ts is None else ts, events)
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
        elif not self.closed:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        return seq

    def drop_next(self, n: int) -> None:
        """Keep the next ``n`` batches off the PUB socket (they stay replayable): a subscriber sees a gap."""
        self._drop += n

    async def _serve_replays(self) -> None:
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores a malformed request
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop answering replays and close both sockets (subscribers see the connection drop); later batches are
        kept in the buffer only (the engine runs on, its stream is gone)."""
        self.closed = True
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)


def add_kv_event_routes(app: web.Application, publisher: KVEventPublisher) -> None:
    """``GET`` / ``PUT {"drop_next": n}`` on ``/emulator/kv-events``: the publisher's endpoints and sequence, and
    the next n batches kept off the PUB socket (a subscriber sees a gap it must fill by replay); ``PUT {"stop":
    true}`` closes the sockets while the engine serves on (a lost event stream: its balancer falls back to the
    trie)."""

    def state() -> dict:
        return {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                "next_seq": publisher._seq, "drop_next": publisher._drop, "stopped": publisher.closed}

    async def show(request: web.Request) -> web.Response:
        return web.json_response(state())

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        if body == {"stop": True}:
            await publisher.close()
            return web.json_response(state())
        n = body.get("drop_next") if isinstance(body, dict) and set(body) == {"drop_next"} else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return web.json_response({"error": {"message": "body must be {\"drop_next\": integer >= 0} or "
                                                           "{\"stop\": true}",
                                                 "type": "BadRequestError"}}, status=400)
        publisher.drop_next(n)
        return web.json_response(state())

    app.router.add_get(KV_EVENTS_PATH, show)
    app.router.add_put(KV_EVENTS_PATH, update)
