"""Stage 1, parse: read the body, parse it in the request's dialect, and check a forwarded request's peer token.

Answers 413 for a body over ``balancer.max_body_bytes``, 408 for one the client sent too slowly
(``balancer.client_connections``), 400 for a body that is not a valid request (OpenAI or Ollama
API reference), 403 for a request marked as forwarded without the right peer token (SkyLB paper §3.3: a forwarded
request is never forwarded again, so only a peer may mark one).
"""

from __future__ import annotations

from aiohttp import web

from skylb.balancer.api import BadRequest, parse_ollama, parse_openai
from skylb.listener import ClientBodyTimeout
from skylb.balancer.protocol import FORWARDED_FROM, TOKEN_HEADER, token_ok
from skylb.balancer.stages.context import RequestContext

__all__ = ["ParseStage"]


class ParseStage:
    """Sets ``ctx.body``, ``ctx.parsed``, ``ctx.forwarded_from`` and ``ctx.forwarded``.

    Args: max_body_bytes: the body limit, bytes (enforced by aiohttp; named in the 413); session_header: the header
    that carries a session key; peer_token: the shared secret between balancers (None: none configured).
    """

    name = "parse"

    def __init__(self, *, max_body_bytes: int, session_header: str, peer_token: str | None):
        self.max_body_bytes = max_body_bytes
        self.session_header = session_header
        self.peer_token = peer_token

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        request = ctx.http
        try:
            ctx.body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return ctx.reject(413, f"request body is larger than balancer.max_body_bytes ({self.max_body_bytes} "
                                   "bytes)", "body_too_large")
        except ClientBodyTimeout as exc:  # the listener's body deadline (skylb/listener.py)
            return ctx.reject(408, str(exc), "body_timeout")
        parse = parse_ollama if ctx.api == "ollama" else parse_openai
        try:
            ctx.parsed = parse(request.path, ctx.body, session_header_value=request.headers.get(self.session_header))
        except BadRequest as exc:
            return ctx.reject(400, str(exc), exc.reason, param=exc.param)
        ctx.forwarded_from = request.headers.get(FORWARDED_FROM)
        ctx.forwarded = ctx.forwarded_from is not None
        # No peer token configured: no peer can send a forwarded request (skylb/balancer/auth.py), so none is taken.
        if ctx.forwarded and (not self.peer_token or not token_ok(self.peer_token, request.headers.get(TOKEN_HEADER))):
            return ctx.reject(403, "forwarded request with a missing or wrong peer token", "forbidden",
                              type_="permission_error")
        return None
