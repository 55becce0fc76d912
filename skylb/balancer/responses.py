"""The OpenAI Responses API's state across a balancer: which target holds each stored response.

An engine that serves ``POST /v1/responses`` keeps stored responses in its own memory (vLLM:
``vllm/entrypoints/openai/serving_responses.py``, ``response_store``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``), so
a request naming ``previous_response_id`` can only be served by the replica that produced that response. The
balancer does not rewrite engines' ids (that would mean re-encoding every streamed event); it records, as each
answer's head passes the relay, ``response id -> (route, target)`` in a :class:`ResponseBook`: ("local", replica
id) for its own replicas, ("peer", region) for an answer a peer relayed, whose own book then names its replica. So
a follow-up crosses regions exactly when its state lives in the other region, and only that one hop. Each id is
recorded with the tenant that created it; another tenant's follow-up or retrieve finds nothing (OpenAI scopes
stored responses to their owner).

The book is bounded: at most ``max_entries`` ids (least recently used dropped first) and each for ``ttl_s`` after
its last use. An id stored here takes about 250 bytes (its string, the target's, the entry), so the default
100,000 ids hold about 25 MB. A follow-up whose id the book does not hold (expired, dropped, produced through
another region's balancer, or this balancer restarted) gets OpenAI's 400 ``previous_response_not_found``.

Also here: ``GET /v1/responses/{id}`` (vLLM's retrieve endpoint), proxied to the target that holds the response,
404 in OpenAI's shape when none is known.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable

import aiohttp
from aiohttp import web

from skylb.balancer.api import openai_error
from skylb.balancer.auth import tenant_of
from skylb.balancer.protocol import FORWARDED_FROM, TOKEN_HEADER
from skylb.core.request import DEFAULT_TENANT
from skylb.quota.priorities import PEER_TENANT_HEADER, peer_class, peer_headers

__all__ = ["ResponseBook", "response_id_of", "retrieve_handler", "MAX_ENTRIES", "TTL_S", "RESPONSES_PATH"]

#: The endpoint of the Responses API.
RESPONSES_PATH = "/v1/responses"
#: The most response ids a balancer remembers (about 25 MB).
MAX_ENTRIES = 100_000
#: How long an id is remembered after its last use, s (a conversation idle for a day starts afresh).
TTL_S = 24 * 3600.0
_SSE_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
#: The longest a retrieve proxied to a replica or peer may take, s.
RETRIEVE_TIMEOUT_S = 30.0


class ResponseBook:
    """``response id -> (route, target)``, bounded in count (LRU) and age.

    Args: max_entries: the most ids kept; ttl_s: how long an id is kept after its last use, s; now(): the clock, s.
    """

    def __init__(self, *, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S,
                 now: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl_s, self.now = max_entries, ttl_s, now
        self._entries: OrderedDict[str, tuple[str, str, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, response_id: str, route: str, target: str, tenant: str = DEFAULT_TENANT) -> None:
        """``response_id``, created by ``tenant``, is held by ``target`` (a replica id for route "local", a region
        for "peer")."""
        self._entries[response_id] = (route, target, tenant, self.now())
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, response_id: str, tenant: str = DEFAULT_TENANT) -> tuple[str, str] | None:
        """(route, target) holding ``response_id`` for ``tenant``, or None when unknown, expired or another
        tenant's (a hit renews its age)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[2] != tenant:
            return None
        if self.now() - entry[3] > self.ttl_s:
            del self._entries[response_id]
            return None
        self.record(response_id, *entry[:3])
        return entry[0], entry[1]


def response_id_of(head: bytes) -> str | None:
    """The response id in the head of a Responses API answer: a whole response object (``{"id": "resp_...",
    "object": "response"}``) or a stream's first events (``response.created``, whose ``response`` holds the id, as
    vLLM and OpenAI send it, with or without an ``event:`` line). None when there is none."""
    payload = head.strip()
    if not payload.startswith((b"event:", b"data:", b":")):
        return _id_in(payload)
    for event in _SSE_END.split(payload):
        found = _id_in(b"\n".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")))
        if found is not None:
            return found
    return None


def _id_in(payload: bytes) -> str | None:
    """The id of the response object in one JSON ``payload`` (itself, or an event's ``response``), else None."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
        obj = obj["response"]
    if isinstance(obj, dict) and obj.get("object") == "response" and isinstance(obj.get("id"), str):
        return obj["id"]
    return None


def not_found(response_id: str) -> web.Response:
    """OpenAI's 404 for a response id nobody here holds."""
    return openai_error(404, f"No response found with id '{response_id}'.", param="response_id")


def retrieve_handler(book: ResponseBook, *, target_url: Callable[[str, str], str | None],
                     session: Callable[[], aiohttp.ClientSession], region: str, peer_token: str | None,
                     replica_auth: Callable[[web.Request], str | None]) -> Callable:
    """The handler of ``GET /v1/responses/{id}``: proxied to the target the book names (``target_url(route,
    target)`` gives its base URL, None when it left), with the peer token and this region as the forwarding
    balancer for a peer, and ``replica_auth(request)`` as the Authorization for a replica (as the relay sends it).
    404 in OpenAI's shape when the id is unknown here or its target left; 502 when the target does not answer. A
    forwarded retrieve is answered from this region's replicas only (one hop); the client's tenant (its API key's,
    or for a forwarded retrieve the one its balancer sent) must be the one that created the response."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        forwarded = FORWARDED_FROM in request.headers  # its peer token checked by the auth middleware
        tenant = (forwarded and peer_class(None, request.headers.get(PEER_TENANT_HEADER))[1]) or tenant_of(request)
        held = book.lookup(response_id, tenant)
        if held is None or (held[0] == "peer" and forwarded):
            return not_found(response_id)
        base = target_url(*held)
        if base is None:
            return not_found(response_id)
        headers = {"Accept-Encoding": "identity"}
        auth = replica_auth(request) if held[0] == "local" else None
        if auth:
            headers["Authorization"] = auth
        if held[0] == "peer":
            headers.update(peer_headers("normal", tenant))
            headers[FORWARDED_FROM] = region
            if peer_token:
                headers[TOKEN_HEADER] = peer_token
        try:
            async with session().get(base + request.rel_url.path_qs, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=RETRIEVE_TIMEOUT_S)) as upstream:
                body = await upstream.read()
                content_type = upstream.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return openai_error(502, f"{held[0]} {held[1]} holding response '{response_id}' did not answer: "
                                     f"{type(exc).__name__}")
        return web.Response(status=upstream.status, body=body, headers={"Content-Type": content_type})

    return handle
