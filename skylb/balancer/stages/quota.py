"""Stage 7 (optional, on with quotas), the quota gate: wait for room in every bucket of the tenant and the model
(tokens per minute, concurrency caps), else 429 with Retry-After. Both answers carry OpenAI's ``x-ratelimit-*``
headers of the most restrictive bucket (skylb/quota/headers.py) when a limit on requests or tokens applies.

Source: "LLM-Load-Balancer" (the quota-aware router's README), iteration 1 (token buckets, concurrency caps) and
iteration 2 (jittered waits); the gate itself is skylb/quota/gate.py. A request already charged by a model group or
an admission lease (``ctx.charged``) passes. The end hook frees the concurrency slot and gives back the tokens of a
request that no replica or peer answered, whatever the ending (answered, failed, cancelled, client gone).
"""

from __future__ import annotations

from aiohttp import web

from skylb.balancer.stages.context import RequestContext
from skylb.quota.gate import QuotaExceeded, QuotaGate
from skylb.quota.headers import rate_limit_headers

__all__ = ["QuotaStage"]


class QuotaStage:
    """``gate``: the balancer's QuotaGate (reads the quotas and limit backend in force on every call)."""

    name = "quota"

    def __init__(self, gate: QuotaGate):
        self.gate = gate

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        if ctx.charged:
            return None
        parsed = ctx.parsed
        try:
            admission = await self.gate.admit_request(tenant=ctx.tenant, model=parsed.model, text=parsed.text,
                                                      max_tokens=parsed.max_tokens, path=ctx.http.path,
                                                      arrived_at=ctx.arrived_at, forwarded=ctx.forwarded)
        except QuotaExceeded as exc:
            ctx.response_headers.update(rate_limit_headers(self.gate.quotas().limits_for(ctx.tenant, parsed.model),
                                                           self.gate.limits()))
            return ctx.reject(429, str(exc), exc.reason, type_="rate_limit_exceeded", retry_after_s=exc.retry_after_s)
        if admission is not None:
            ctx.response_headers.update(rate_limit_headers(admission.buckets, self.gate.limits()))
            ctx.on_end(lambda ctx: self.gate.release(admission, refund_tokens=0 if ctx.answered else admission.tokens))
        return None
