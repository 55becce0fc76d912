"""Where a replica publishes its KV-cache events: a validated pair of ZMQ endpoints (vLLM's ``endpoint`` and
``replay_endpoint`` of ``--kv-events-config``). Kept apart from the subscriber (skylb/engines/kv_subscriber.py) so
that what validates configuration (skylb-ctl, the controller's store) loads neither ZMQ nor aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVEventsEndpoint"]


@dataclass(frozen=True)
class KVEventsEndpoint:
    """Where one replica publishes: ``endpoint`` (``tcp://host:port`` of its PUB socket), ``replay_endpoint`` (its
    ROUTER socket, or None: gaps then drop the replica's blocks) and ``topic`` (vLLM's ``topic``; "" = all)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        """Raises ValueError for an endpoint that is not a ZMQ ``tcp://host:port`` (or ``ipc://``, ``inproc://``)."""
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not _valid_endpoint(value):
                raise ValueError(f"KV events {name} must be tcp://HOST:PORT (or ipc://, inproc://), got {value!r}")


def _valid_endpoint(value: str) -> bool:
    if value.startswith(("ipc://", "inproc://")):
        return len(value.split("://", 1)[1]) > 0
    host, _, port = value.removeprefix("tcp://").rpartition(":")
    return value.startswith("tcp://") and bool(host) and "*" not in host and port.isdigit() and 0 < int(port) < 65536
