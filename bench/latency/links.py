"""Cross-region links: a Toxiproxy proxy with a latency toxic each way, so a request/response pays a region's RTT.

Talks to any server with Toxiproxy's HTTP API (``skylb toxiproxy`` here, a real Toxiproxy elsewhere) through the
`toxiproxy-python` client's API layer (``toxiproxy.api.APIConsumer``, which maps 404/409/400 to its ``NotFound``,
``ProxyExists`` and ``InvalidToxic`` exceptions). The API URL is the ``api_url`` argument, else the
``TOXIPROXY_URL`` environment variable, else ``http://127.0.0.1:8474`` (Toxiproxy's default port).

With a real Toxiproxy on another host, the upstreams you link must be reachable from that host, and the returned
listen address is on that host (pass ``listen_host`` so clients can reach it).

Example::

    with LatencyLinks() as links:
        eu_via_us = links.link("us-to-eu", "127.0.0.1:9002", rtt_ms=80)   # -> "127.0.0.1:41234"
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from types import TracebackType
from urllib.parse import quote, urlsplit

import requests
from toxiproxy.api import APIConsumer
from toxiproxy.exceptions import NotFound

__all__ = ["DEFAULT_API_URL", "ENV_VAR", "resolve_api_url", "api_reachable", "split_rtt", "LatencyLinks", "LinkError"]

DEFAULT_API_URL = "http://127.0.0.1:8474"
ENV_VAR = "TOXIPROXY_URL"
_DEFAULT_PORT = 8474
# The client keeps host and port as class attributes of APIConsumer: point it at our server under a lock.
_client_lock = threading.Lock()


def resolve_api_url(api_url: str | None = None) -> str:
    """``api_url`` if given, else ``$TOXIPROXY_URL`` if set, else ``http://127.0.0.1:8474``."""
    return api_url or os.environ.get(ENV_VAR) or DEFAULT_API_URL


def _host_port(api_url: str) -> tuple[str, int]:
    parts = urlsplit(api_url if "//" in api_url else f"http://{api_url}")
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"Toxiproxy API URL must be http://host[:port], got {api_url!r}")
    host = parts.hostname
    return (f"[{host}]" if ":" in host else host), (parts.port or _DEFAULT_PORT)


def api_reachable(api_url: str | None = None, *, timeout_s: float = 1.0) -> bool:
    """True if a Toxiproxy API answers ``GET /version`` with 200 at ``api_url`` (resolved as ``resolve_api_url``)."""
    host, port = _host_port(resolve_api_url(api_url))
    try:
        return requests.get(f"http://{host}:{port}/version", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def split_rtt(rtt_ms: float, jitter_ms: float = 0.0) -> tuple[tuple[int, int], tuple[int, int]]:
    """(upstream (latency, jitter), downstream (latency, jitter)) in whole ms for a round trip of ``rtt_ms``.

    Toxiproxy's attributes are integers, so the RTT is rounded up and split so the two halves sum to it exactly;
    the jitter (rounded) is split the same way, so a round trip takes ``rtt +/- jitter``.
    """
    if rtt_ms < 0 or jitter_ms < 0:
        raise ValueError("rtt_ms and jitter_ms must be >= 0")
    rtt, jitter = math.ceil(rtt_ms), round(jitter_ms)
    return (rtt // 2, jitter // 2), (rtt - rtt // 2, jitter - jitter // 2)


class LinkError(RuntimeError):
    """The API refused to create link ``name``: its HTTP ``status`` and ``message`` (Toxiproxy's ``{"error"}``)."""

    def __init__(self, name: str, status: int, message: str | None):
        super().__init__(f"link {name!r} refused: HTTP {status}: {message or 'no message'}")
        self.name, self.status, self.message = name, status, message


class LatencyLinks:
    """Creates and removes latency links (Toxiproxy proxies) on one Toxiproxy API.

    ``api_url``: ``http://host:port`` of the API (default: ``$TOXIPROXY_URL``, else ``http://127.0.0.1:8474``).
    ``listen_host``: where the proxies listen, on the Toxiproxy's host. ``timeout_s``: per API call.
    Not thread-safe per instance; instances pointing at different APIs may be used from different threads.
    """

    def __init__(self, api_url: str | None = None, *, listen_host: str = "127.0.0.1", timeout_s: float = 5.0):
        self.api_url = resolve_api_url(api_url)
        self.listen_host = listen_host
        self.timeout_s = timeout_s
        self._host, self._port = _host_port(self.api_url)
        self._links: dict[str, str] = {}  # name -> listen "host:port"

    @property
    def links(self) -> dict[str, str]:
        """The links this object created and has not removed: name -> listen ``"host:port"``."""
        return dict(self._links)

    def reachable(self) -> bool:
        """True if the API answers ``GET /version``."""
        return api_reachable(self.api_url, timeout_s=min(self.timeout_s, 1.0))

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        with _client_lock:
            APIConsumer.host, APIConsumer.port = self._host, self._port
            return getattr(APIConsumer, method)(path, timeout=self.timeout_s, **kwargs)

    def link(self, name: str, upstream: str, rtt_ms: float, jitter_ms: float = 0.0, *, listen_port: int = 0,
             spare_ports: Iterator[int] | None = None) -> str:
        """Proxy ``name`` to ``upstream`` (``"host:port"``) with a round trip of ``rtt_ms`` +/- ``jitter_ms``.

        Replaces a proxy of that name if one exists. Adds latency toxics ``latency_upstream`` (client -> server)
        and ``latency_downstream`` (server -> client), half the RTT each, so a request/response exchange pays the
        whole RTT (the TCP handshake itself is not delayed, as with Toxiproxy). Returns the listen ``"host:port"``:
        ``listen_port``, or with 0 a free port picked by the server (which may be a port the caller reserved with
        free_ports and has not bound yet: pass one from the same reservation to rule that out). A reserved port can
        still be taken before the proxy binds it (the kernel hands it to some process's outgoing connection): with
        ``spare_ports`` (more of the same reservation) the link then listens on the next spare instead, up to
        three times. Raises ``requests.RequestException`` if the API is unreachable, the client's exceptions
        (``toxiproxy.exceptions.*``) for a 400, 404 or 409, and LinkError for any other refusal (a port in use
        without a spare).
        """
        if not name or "/" in name:
            raise ValueError(f"link name must be non-empty without '/', got {name!r}")
        up, down = split_rtt(rtt_ms, jitter_ms)
        path = f"/proxies/{quote(name, safe='')}"
        self.unlink(name)
        for attempt in range(4):
            answer = self._call("post", "/proxies", json={
                "name": name, "listen": f"{self.listen_host}:{listen_port}", "upstream": upstream, "enabled": True})
            try:
                info = answer.json() if answer.content else {}
            except ValueError:  # not JSON: a proxy in front of the API, or a server that is not Toxiproxy's
                info = {"error": answer.text[:200]}
            if answer.status_code in (200, 201) and isinstance(info, dict) and "listen" in info:
                break
            error = LinkError(name, answer.status_code, info.get("error") if isinstance(info, dict) else None)
            spare = next(spare_ports, None) if spare_ports is not None and listen_port else None
            if spare is None or answer.status_code < 500 or attempt == 3:
                raise error
            listen_port = spare
        self._links[name] = info["listen"]
        try:
            for stream, (latency, jitter) in (("upstream", up), ("downstream", down)):
                self._call("post", f"{path}/toxics", json={
                    "name": f"latency_{stream}", "type": "latency", "stream": stream, "toxicity": 1.0,
                    "attributes": {"latency": latency, "jitter": jitter}})
        except Exception:
            self.unlink(name)
            raise
        return info["listen"]

    def unlink(self, name: str) -> None:
        """Delete the proxy ``name`` (ours or a leftover of an earlier run); no error if it does not exist."""
        self._links.pop(name, None)
        try:
            self._call("delete", f"/proxies/{quote(name, safe='')}")
        except NotFound:
            pass

    def close(self) -> None:
        """Delete every proxy this object created. An unreachable API is ignored (its proxies went with it)."""
        for name in list(self._links):
            try:
                self.unlink(name)
            except requests.ConnectionError:
                self._links.pop(name, None)

    def __enter__(self) -> LatencyLinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
