"""Balancer-to-balancer protocol: the msgpack peer status and the headers that mark forwarded requests.

Source: DESIGN.md decision 3 (msgpack, versioned, authenticated; one hop) and SkyLB paper Algorithm 1 line 10
(PROBELB returns the peer's available replicas and queue size).
"""

from __future__ import annotations

import hmac

import msgpack

from skylb import PROTOCOL_VERSION

__all__ = ["STATUS_PATH", "FORWARDED_FROM", "TOKEN_HEADER", "ROUTE_HEADER", "SERVED_BY_HEADER", "QUEUE_MS_HEADER",
           "REQUEST_ID_HEADER", "ProtocolError", "encode_status", "decode_status", "token_ok"]

STATUS_PATH = "/skylb/v1/status"
#: Set on a forwarded request: the region of the balancer that forwarded it. Such a request is never forwarded again.
FORWARDED_FROM = "X-SkyLB-Forwarded-From"
#: The shared secret between balancers, when ``peer_token`` is configured.
TOKEN_HEADER = "X-SkyLB-Token"
#: On responses: ``local`` or ``peer:<region>``, as decided by the balancer the client called.
ROUTE_HEADER = "X-SkyLB-Route"
#: On responses: ``<region>/<replica id>`` of the replica that served the request.
SERVED_BY_HEADER = "X-SkyLB-Served-By"
#: On responses: time the request waited in the balancer's queue, ms.
QUEUE_MS_HEADER = "X-SkyLB-Queue-Ms"
REQUEST_ID_HEADER = "X-Request-Id"
#: A status is a few hundred bytes; anything much larger is not one.
MAX_STATUS_BYTES = 1 << 20


class ProtocolError(ValueError):
    """Raised when a peer's status is not valid msgpack of our protocol (or of an incompatible version)."""


def encode_status(status: dict) -> bytes:
    """Pack a status dict (``Router.status()`` plus extras) with the protocol version as msgpack bytes."""
    return msgpack.packb({"v": PROTOCOL_VERSION, **status}, use_bin_type=True)


def decode_status(data: bytes) -> dict:
    """Unpack and validate a peer status.

    Returns a dict with at least region (str), available_replicas (int >= 0), replicas (int >= 0), queue_len
    (int >= 0), and optionally models ({api: {model: available replicas}}). Raises ProtocolError on bad msgpack, a missing or mistyped field, or another protocol version.
    """
    if len(data) > MAX_STATUS_BYTES:
        raise ProtocolError(f"peer status is {len(data)} bytes, more than {MAX_STATUS_BYTES}")
    try:
        status = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"peer status is not msgpack: {exc}") from exc
    if not isinstance(status, dict):
        raise ProtocolError("peer status must be a map")
    if status.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {status.get('v')!r}, we speak {PROTOCOL_VERSION}")
    if not isinstance(status.get("region"), str):
        raise ProtocolError("peer status has no region")
    for key in ("available_replicas", "replicas", "queue_len"):
        value = status.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"peer status field {key} must be a non-negative integer, got {value!r}")
    models = status.get("models")
    if models is not None:
        ok = isinstance(models, dict) and all(
            isinstance(api, str) and isinstance(per, dict) and all(
                isinstance(m, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                for m, n in per.items())
            for api, per in models.items())
        if not ok:
            raise ProtocolError("peer status field models must map API -> model -> available replicas")
    return status


def token_ok(configured: str | None, given: str | None) -> bool:
    """True when no token is configured, or ``given`` equals it (constant-time comparison)."""
    if configured is None:
        return True
    return given is not None and hmac.compare_digest(configured.encode(), given.encode())
