"""Balancer-to-balancer protocol: the msgpack peer status and the headers that mark forwarded requests.

Messages are msgpack, versioned and authenticated; a forwarded request is never forwarded again (one hop). Source:
SkyLB paper Algorithm 1 line 10 (PROBELB returns the peer's available replicas and queue size).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import msgpack
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skylb import PROTOCOL_VERSION
from skylb.core import PeerStatus
from skylb.core.held_prefixes import MAX_STATUS_PREFIXES
from skylb.core.kv_index import MAX_SUMMARY_BLOCKS
from skylb.tokens import secret_matches

__all__ = ["STATUS_PATH", "FORWARDED_FROM", "TOKEN_HEADER", "ROUTE_HEADER", "RULE_HEADER", "SERVED_BY_HEADER",
           "MODEL_HEADER", "LEASE_HEADER",
           "QUEUE_MS_HEADER",
           "REQUEST_ID_HEADER", "BALANCER_REQUEST_ID_HEADER", "MAX_CLIENT_ID_CHARS", "MAX_STATUS_BYTES",
           "ANSWER_COMPLETE", "ANSWER_USAGE", "answer_complete",
           "client_request_id", "ProtocolError", "queued_ms", "encode_status", "decode_status", "token_ok",
           "MAX_MODEL_ID_CHARS", "header_value", "valid_model_ids"]

STATUS_PATH = "/skylb/v1/status"
#: Set on a forwarded request: the region of the balancer that forwarded it. Such a request is never forwarded again.
FORWARDED_FROM = "X-SkyLB-Forwarded-From"
#: The shared secret between balancers, when ``peer_token`` is configured.
TOKEN_HEADER = "X-SkyLB-Token"
#: On responses: ``local`` or ``peer:<region>``, as decided by the balancer the client called.
ROUTE_HEADER = "X-SkyLB-Route"
#: On responses: why the balancer the client called chose that route, the plugin of its routing profile that chose
#: it (``Decision.rule``: ``push_to_holder``, ``prefer_peer``, ``estimated_ttft``... or ``pinned``); for a forwarded
#: request followed by the peer's own, comma-separated (``prefer_peer, push_to_holder``).
RULE_HEADER = "X-SkyLB-Rule"
#: On responses: ``<region>/<replica id>`` of the replica that served the request.
SERVED_BY_HEADER = "X-SkyLB-Served-By"
#: On a response: the model that served it (a model group's choice, an Ollama fleet's fallback, else the request's).
MODEL_HEADER = "X-SkyLB-Model"
#: Request header: the id of an admission lease (POST /skylb/v1/schedule) the request runs under.
LEASE_HEADER = "X-SkyLB-Lease"
#: On responses: time the request waited in the balancer's queue, ms. On a forwarded request: time it waited in the
#: forwarding balancer's queue, ms (the peer queues it as if it had arrived that much earlier).
QUEUE_MS_HEADER = "X-SkyLB-Queue-Ms"
#: On requests to a target: the balancer's own request id (unique, made by the balancer). From a client: only a
#: label, logged and echoed back, never a key (clients may send the same one twice).
REQUEST_ID_HEADER = "X-Request-Id"
#: On responses: the balancer's own id of the request (the ``id`` of its log line).
BALANCER_REQUEST_ID_HEADER = "X-SkyLB-Request-Id"
#: Key of the client's aiohttp request under which the relay records that a stream's last event is being written to
#: the client (its HTTP status): a client that closes then (as soon as it reads the last event, before the chunked
#: stream's end marker or while the balancer releases what it held) has its whole answer, and is not logged as
#: "client closed request".
ANSWER_COMPLETE = (web.RequestKey("skylb_answer_complete", int) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
                   else "skylb_answer_complete")
#: Beside it: the usage (token counts) that stream's events carried, None when they carried none.
ANSWER_USAGE = (web.RequestKey("skylb_answer_usage", object) if hasattr(web, "RequestKey")
                else "skylb_answer_usage")


def answer_complete(http_request) -> int | None:
    """The status of the stream whose last event went to the client of ``http_request`` (an aiohttp request), or
    None when no stream was written to its end (or there is no such request: a request built in a test)."""
    return http_request.get(ANSWER_COMPLETE) if isinstance(http_request, Mapping) else None


#: The longest client request id kept as a label (characters); longer or non-printable ones are dropped.
MAX_CLIENT_ID_CHARS = 128
#: A status is a few hundred bytes (up to about 9.2 KiB more with a sibling's prefixes, as much with a region summary
#: of KV-cache blocks); anything much larger is not one.
MAX_STATUS_BYTES = 1 << 20


class ProtocolError(ValueError):
    """Raised when a peer's status is not valid msgpack of our protocol (or of an incompatible version)."""


class _StatusMessage(BaseModel):
    """The wire shape of a peer status (strict: no coercion; an int field is a non-negative int, not a bool)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    v: Literal[PROTOCOL_VERSION]  # type: ignore[valid-type]
    region: str
    available_replicas: Annotated[int, Field(ge=0)]
    replicas: Annotated[int, Field(ge=0)]
    queue_len: Annotated[int, Field(ge=0)]
    models: dict[str, dict[str, Annotated[int, Field(ge=0)]]] | None = None
    # Added after version 1 shipped, optional both ways: an older peer omits it and ignores it (extra="ignore").
    wait_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    queue_age_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    dispatch_rate: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    backlog_tokens: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    prefill_fixed_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    prefill_ms_per_token: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    # model -> its engines' fields (skylb/core/model_cards.py peer_card); added later, optional both ways. Any value
    # is accepted and only scalars are kept (_scalar_cards): a richer card from a newer peer must not make its
    # whole status, and so its routing, unreadable.
    model_cards: dict[str, dict[str, Any]] | None = None
    # A sibling's prefix hashes (skylb/core/held_prefixes.py); added later, optional both ways. Any list is accepted
    # and only unsigned 64-bit ints are kept, the newest MAX_STATUS_PREFIXES (_hashes), for the same reason.
    prefixes: list[Any] | None = None
    prefix_seq: Annotated[int, Field(ge=0)] | None = None
    # The region summary of KV-cache blocks (skylb/core/kv_index.py BlockIndex.summary); added later, optional both
    # ways, kept as the prefixes are (_hashes: unsigned 64-bit ints, at most MAX_SUMMARY_BLOCKS).
    blocks: list[Any] | None = None
    block_size: Annotated[int, Field(ge=1)] | None = None
    # The mean requests in its usable replicas' engines (PeerStatus.load_per_replica); added later, optional both ways.
    load_per_replica: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


def encode_status(status: PeerStatus) -> bytes:
    """Pack ``status`` (``Router.status()``) with the protocol version as msgpack bytes."""
    # Its fields as they are: msgpack packs tuples and dicts itself; ``dataclasses.asdict`` deep-copied every
    # nested map and prefix for nothing (half the cost of answering a peer's probe).
    return msgpack.packb({"v": PROTOCOL_VERSION, **vars(status)}, use_bin_type=True)


def decode_status(data: bytes) -> PeerStatus:
    """Unpack and validate a peer status into a PeerStatus.

    Raises ProtocolError on more than MAX_STATUS_BYTES, bad msgpack, a non-map, another protocol version, or a
    missing or mistyped field (counts must be non-negative integers; ``models`` maps API -> model -> count;
    ``model_cards`` model -> a map of fields, of which only strings, numbers, bools and nulls are kept; ``prefixes``
    a list of which only unsigned 64-bit ints are kept, the newest MAX_STATUS_PREFIXES; ``blocks`` the same, the
    first MAX_SUMMARY_BLOCKS).
    """
    if len(data) > MAX_STATUS_BYTES:
        raise ProtocolError(f"peer status is {len(data)} bytes, more than {MAX_STATUS_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"peer status is not msgpack: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError("peer status must be a map")
    if raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {raw.get('v')!r}, we speak {PROTOCOL_VERSION}")
    try:
        msg = _StatusMessage.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(f"peer status field {where}: {first['msg']}") from None
    return PeerStatus(region=msg.region, available_replicas=msg.available_replicas, replicas=msg.replicas,
                      queue_len=msg.queue_len, models=msg.models, wait_ms=msg.wait_ms,
                      queue_age_ms=msg.queue_age_ms, dispatch_rate=msg.dispatch_rate,
                      backlog_tokens=msg.backlog_tokens, prefill_fixed_ms=msg.prefill_fixed_ms,
                      prefill_ms_per_token=msg.prefill_ms_per_token, model_cards=_scalar_cards(msg.model_cards),
                      prefixes=_hashes(msg.prefixes, MAX_STATUS_PREFIXES, newest_last=True),
                      prefix_seq=msg.prefix_seq, blocks=_hashes(msg.blocks, MAX_SUMMARY_BLOCKS),
                      block_size=msg.block_size, load_per_replica=msg.load_per_replica)


def _hashes(hashes: list | None, limit: int, *, newest_last: bool = False) -> tuple[int, ...] | None:
    """The ``limit`` newest of ``hashes`` (the last ones with ``newest_last``, else the first) that are unsigned
    64-bit ints (a bool is not one)."""
    if hashes is None:
        return None
    kept = hashes[-limit:] if newest_last else hashes[:limit]
    return tuple(h for h in kept if type(h) is int and 0 <= h < 1 << 64)


def _scalar_cards(cards: dict[str, dict] | None) -> dict[str, dict] | None:
    """``cards`` with only the fields whose value is a string, number (finite), bool or null."""
    if cards is None:
        return None
    return {m: {k: v for k, v in card.items()
                if v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v))}
            for m, card in cards.items()}


def queued_ms(value: str | None) -> float:
    """The wait a forwarded request's ``X-SkyLB-Queue-Ms`` header reports, ms: 0 when absent or not a finite
    non-negative number (a bad value only loses the request its place, it is not an error)."""
    try:
        ms = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return ms if math.isfinite(ms) and ms > 0 else 0.0


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Request-Id`` as a label: kept when printable ASCII of at most MAX_CLIENT_ID_CHARS, else None
    (it is echoed in a response header and written to the log)."""
    if value and len(value) <= MAX_CLIENT_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return None


#: The longest model id a replica may list (longer ones are skipped: no engine names a model so).
MAX_MODEL_ID_CHARS = 512


def header_value(value: object) -> str | None:
    """``value`` when it may go into a response header as it is: a str of printable ASCII, so no CR or LF (a header
    split in two, which aiohttp refuses only once the handler has returned, dropping the connection) and nothing
    that fails to encode; else None."""
    return value if isinstance(value, str) and value.isascii() and value.isprintable() else None


def valid_model_ids(ids: Iterable[object]) -> tuple[list[str], list[str]]:
    """Split the model ids a replica listed into (the valid ones, in order; the others as ``repr`` for a log line).
    Valid: a str of 1 to MAX_MODEL_ID_CHARS printable characters (no CR, LF or other control character, no lone
    surrogate from invalid UTF-8), since an id reaches clients' answers, the log and response headers."""
    good: list[str] = []
    bad: list[str] = []
    for model in ids:
        if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_ID_CHARS and model.isprintable():
            good.append(model)
        else:
            bad.append(repr(model)[:100])
    return good, bad


def token_ok(configured: str | None, given: str | None) -> bool:
    """True when no token is configured, or ``given`` equals it (constant-time comparison; any text a client sent,
    invalid UTF-8 included, is compared without raising: skylb/tokens.py ``secret_matches``)."""
    if configured is None:
        return True
    return secret_matches(given, configured)
