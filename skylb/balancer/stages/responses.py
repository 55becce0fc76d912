"""Stage 5, the OpenAI Responses API's state: a follow-up goes to the target that holds its previous response.

Only ``POST /v1/responses`` is looked at; other requests pass untouched. A request naming ``previous_response_id`` is
pinned (``ctx.pin``) to the target the balancer's ResponseBook recorded for that id (skylb/balancer/responses.py):
a local replica, or the peer whose replica produced it (one hop, as every forward). When the book holds no such id,
or its target is gone (a replica that left membership, a peer that is no longer one, a forwarded follow-up whose id
names a peer here), the answer is OpenAI's own for a previous response it cannot find: 400,
``invalid_request_error``, code ``previous_response_not_found``, param ``previous_response_id`` (OpenAI's API answers
400, not 404, for an unknown ``previous_response_id``; 404 is for ``GET /v1/responses/{id}``). The state went with
its replica, so no other replica can serve it; the client starts the conversation again with its full input. A
target that is there but unavailable for now (unhealthy, ejected) is the route stage's 503 with Retry-After.
A request that asks to be stored (``store``, default true) registers ``ctx.on_answer_head``: the relay hands it the
answer's head, and the response id in it is recorded with the target that produced it and the request's tenant
(another tenant's follow-up finds no such response).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from skylb.balancer.responses import RESPONSES_PATH, ResponseBook, response_id_of
from skylb.balancer.stages.context import RequestContext

__all__ = ["ResponsesStage"]


class ResponsesStage:
    """Args: book: the balancer's ResponseBook; pinned_reason(pin, now, may_forward=, model=, api=): the router's
    ``pinned_unavailable_reason``; now(): the balancer's clock, s."""

    name = "responses"

    def __init__(self, book: ResponseBook, *, pinned_reason: Callable[..., tuple[str, str] | None],
                 now: Callable[[], float]):
        self.book, self.pinned_reason, self.now = book, pinned_reason, now

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        if ctx.http.path != RESPONSES_PATH:
            return None
        parsed = ctx.parsed
        previous = parsed.previous_response_id
        if previous is not None:
            held = self.book.lookup(previous, ctx.tenant)
            why = ("this region's balancer has no record of it for this tenant (expired, or created through another "
                   "region)")
            if held is not None:
                reason = self.pinned_reason(held, self.now(), may_forward=not ctx.forwarded, model=parsed.model,
                                            api=ctx.api)
                why = None if reason is None or reason[0] != "gone" else f"the replica holding it is gone: {reason[1]}"
            if why is not None:
                return ctx.reject(400, f"Previous response with id '{previous}' not found: {why}.",
                                  "previous_response_not_found", param="previous_response_id",
                                  code="previous_response_not_found")
            ctx.pin = held
        if parsed.store:
            ctx.on_answer_head = self._record
        return None

    def _record(self, decision, head: bytes) -> None:
        response_id = response_id_of(head)
        if response_id is not None:
            self.book.record(response_id, decision.route, decision.target, decision.request.tenant)
