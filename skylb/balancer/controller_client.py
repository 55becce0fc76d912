"""An async client of the controller's REST API, for balancers: watch membership and register (heartbeat).

Balancers must keep serving on their last membership when the controller is down (static stability), so every
failure that says "the controller is not there right now" is one exception, ControllerUnavailable, which callers
catch to keep what they have and retry later. A 4xx answer is a different thing (this balancer sent something
wrong) and raises ControllerError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

__all__ = ["ControllerUnavailable", "ControllerError", "ControllerClient"]


class ControllerUnavailable(Exception):
    """The controller could not be reached, timed out, answered 5xx, or answered something that is not its API."""


class ControllerError(Exception):
    """The controller refused the request (4xx); ``status`` is the HTTP status, ``type`` the error's type (such as
    "stale_epoch") and the message the controller's."""

    def __init__(self, status: int, message: str, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_


class ControllerClient:
    """Talks to the controller at ``base_url`` (e.g. "http://10.0.0.2:8470") over the caller's ``session``.

    ``base_url`` may name several controllers sharing one etcd store (a list, or one string with commas): a request
    goes to the one that answered last and, when that one is unavailable, to the next in turn; ControllerUnavailable
    only when none answers. ``timeout_s`` bounds each request to one controller in seconds; a long poll gets
    ``wait_s`` on top of it. ``token``, the balancers' peer token, goes with every request as ``X-SkyLB-Token``
    (the controller requires it on heartbeats when it has one). The caller owns the session and closes it.
    """

    def __init__(self, base_url: str | Sequence[str], *, session: aiohttp.ClientSession, timeout_s: float = 5,
                 token: str | None = None):
        self._headers = {"X-SkyLB-Token": token} if token else {}
        urls = base_url.split(",") if isinstance(base_url, str) else base_url
        self.base_urls = [url.strip().rstrip("/") for url in urls if url.strip()]
        if not self.base_urls:
            raise ValueError(f"no controller URL in {base_url!r}")
        self._current = 0
        self._session = session
        self._timeout_s = timeout_s

    @property
    def base_url(self) -> str:
        """The controller the next request goes to first."""
        return self.base_urls[self._current]

    async def get_membership(self, revision: int | None = None, wait_s: float = 0, *,
                             balancer: str | None = None) -> dict:
        """The full membership snapshot, or with ``balancer`` (a balancer's URL) that balancer's view: only the
        replicas it owns, each with its "owner_epoch", and "view": {"balancer", "id", "siblings": [balancers]}.

        With ``revision`` and ``wait_s`` > 0, a long poll: returns as soon as the controller's revision is above
        ``revision``, or after ``wait_s`` seconds (the controller caps it at 60) with the unchanged state; compare
        the answer's "revision" to tell which. Shape: {"revision": int, "regions": [str], "balancers":
        [{"region", "url", "id", "last_seen"}], "replicas": [{"id", "region", "url", "engine", ...}], "owners":
        [{"replica", "balancer", "epoch"}]}.
        """
        params: dict[str, str] = {} if balancer is None else {"balancer": balancer}
        if revision is not None:
            params["revision"] = str(revision)
            if wait_s > 0:
                params["wait"] = str(wait_s)
        return await self._request("GET", "/v1/membership", params=params, extra_s=max(wait_s, 0),
                                   check=_snapshot)

    async def register_balancer(self, region: str, url: str, epochs: dict[str, int] | None = None, *,
                                demand: dict | None = None, balancer_id: str | None = None,
                                owned: dict[str, int] | None = None) -> dict:
        """Register this balancer (``url`` is how peers reach it) or, when already registered, refresh last_seen.

        ``epochs`` ({region: epoch}) are the assignments this balancer holds (the regions whose replicas it serves);
        the controller answers 409 ``stale_epoch`` (ControllerError) when one of them was since given to another
        balancer, and the caller must drop those replicas and re-read membership. ``demand`` (skylb/quota/demand.py)
        asks for this balancer's quota shares: the answer then has "quota_shares" (controller/shares.py).
        ``balancer_id`` names it among its region's balancers (None: the controller uses the URL's host:port);
        ``owned`` ({replica id: epoch}, None: not said) are the replicas it owns, checked as ``epochs`` are; a
        replica it was handing over and no longer lists is released. Returns the balancer as stored.
        """
        body: dict = {"region": region, "url": url}
        if balancer_id:
            body["id"] = balancer_id
        if epochs:
            body["epochs"] = epochs
        if owned is not None:  # {} too: it holds nothing (any replica it was handing over is let go)
            body["owned"] = owned
        if demand is not None:
            body["demand"] = demand
        return await self._request("POST", "/v1/balancers", json=body)

    async def _request(self, method: str, path: str, *, check: Callable[[dict], str | None] | None = None,
                       **kwargs: Any) -> dict:
        """The first controller's answer, trying each in turn from the current one; the one that answered becomes
        current. An answer for which ``check`` returns a complaint counts as unavailable."""
        errors = []
        start = self._current
        for i in range(len(self.base_urls)):
            index = (start + i) % len(self.base_urls)
            url = self.base_urls[index] + path
            try:
                body = await self._request_one(method, url, **kwargs)
                if check is not None and (complaint := check(body)):
                    raise ControllerUnavailable(f"{url}: {complaint}")
            except ControllerUnavailable as exc:
                errors.append(str(exc))
                if self._current == index:  # a concurrent request may have moved on already
                    self._current = (index + 1) % len(self.base_urls)
                continue
            self._current = index
            return body
        raise ControllerUnavailable("; ".join(errors))

    async def _request_one(self, method: str, url: str, *, extra_s: float = 0, **kwargs: Any) -> dict:
        timeout = aiohttp.ClientTimeout(total=self._timeout_s + extra_s)
        try:
            async with self._session.request(method, url, timeout=timeout, headers=self._headers,
                                             **kwargs) as resp:
                if resp.status >= 500:
                    raise ControllerUnavailable(f"{method} {url}: HTTP {resp.status}")
                try:
                    body = await resp.json(content_type=None)
                except ValueError:  # includes json.JSONDecodeError
                    raise ControllerUnavailable(f"{method} {url}: HTTP {resp.status} with a body that is not JSON")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ControllerUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(body, dict):
            raise ControllerUnavailable(f"{method} {url}: answer is not a JSON object")
        if resp.status >= 400:
            error = body.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            type_ = error.get("type") if isinstance(error, dict) else None
            raise ControllerError(resp.status, message or f"{method} {url}: HTTP {resp.status}", type_)
        return body


def _snapshot(body: dict) -> str | None:
    if isinstance(body.get("revision"), int) and isinstance(body.get("replicas"), list):
        return None
    return "answer is not a membership snapshot"
