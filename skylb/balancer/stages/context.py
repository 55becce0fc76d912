"""The state of one request as it passes the stages: what was parsed, who sent it, what it was granted, where it
went, how it ended.

A stage reads what the stages before it set and sets its own part; it never reaches for the balancer. Settings are
given to each stage when the chain is built (skylb/balancer/stages/build.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from skylb.balancer.api import ParsedRequest, error_response, openai_error
from skylb.quota.estimate import is_embedding_path

__all__ = ["RequestContext", "EndHook"]

#: Called once when the request ends, however it ends (answered, rejected, failed, cancelled, client gone).
EndHook = Callable[["RequestContext"], Awaitable[None] | None]

@dataclass
class RequestContext:
    """One generation or embedding request on its way through the chain.

    Attributes:
        http: the aiohttp request. api: its dialect, "openai" or "ollama". request_id: the balancer's own id (hex);
        client_id: the client's X-Request-Id label, or None. arrived_at: arrival on the balancer's clock, s;
        started: arrival on the wall clock (time.time()), s, for the end-to-end time in the log line.
        body: the request body, bytes (rewritten by the stages that change the model or options).
        parsed: the routing view of the body (parse stage). forwarded_from: the peer region that forwarded it, or
        None for a client's request; forwarded: ``forwarded_from is not None`` (its peer token checked).
        priority, tenant: its class and tenant (classify stage; None before it).
        charged: True once a model group or an admission lease has charged the quotas (the quota gate skips it).
        decision, outcome: the routing decision and relay outcome of the last attempt (route stage).
        answered: a replica or peer answered some attempt (the quota's tokens were used).
        ttft_s, error, status: for the log line. reason: why the balancer answered the request itself;
        rejected: that answer counts as a rejection (skylb_rejected_requests_total).
        response_headers: headers every answer to the client gets (the quota stage's ``x-ratelimit-*``).
        pin: the one target that may serve it (``Request.pin``; the responses stage sets it for a follow-up).
        on_answer_head: called with the decision and the head of the target's answer (a whole body, or a stream's
            first event) before it goes to the client (the responses stage records which target holds the answer).
        trace: its spans (skylb/balancer/spans.py RequestTrace) when the balancer traces, else None.
        translation: set when an Ollama-API request goes to OpenAI-dialect replicas (translate stage,
        skylb/balancer/translate.py): the OpenAI path and the way back; None otherwise.
        block_hashes, prompt_tokens: the prompt's KV-cache block hashes and token count from a replica's tokenizer
            (block_hashes stage), or None.
    """

    http: web.Request
    api: str
    request_id: str
    client_id: str | None
    arrived_at: float
    started: float
    body: bytes = b""
    parsed: ParsedRequest | None = None
    forwarded_from: str | None = None
    forwarded: bool = False
    priority: str | None = None
    tenant: str | None = None
    charged: bool = False
    decision: Any = None
    outcome: Any = None
    answered: bool = False
    ttft_s: float | None = None
    error: str | None = None
    status: int | None = None
    reason: str | None = None
    rejected: bool = False
    response_headers: dict[str, str] = field(default_factory=dict)
    pin: tuple[str, str] | None = None
    on_answer_head: Callable[[Any, bytes], None] | None = None
    trace: Any = None
    translation: Any = None
    block_hashes: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    _end_hooks: list[EndHook] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        """The model the request asks for now (None before the parse stage)."""
        return None if self.parsed is None else self.parsed.model

    @property
    def route_api(self) -> str:
        """The dialect of the replicas and peers the request goes to: "openai" once translated, else ``api``."""
        return "openai" if self.translation is not None else self.api

    @property
    def embedding(self) -> bool:
        """True for an embedding request (either dialect)."""
        return is_embedding_path(self.http.path)

    def on_end(self, hook: EndHook) -> None:
        """Run ``hook(self)`` when the request ends; hooks run once each, the last registered first."""
        self._end_hooks.append(hook)

    def take_end_hooks(self) -> list[EndHook]:
        """The registered hooks, last first, and none left: a second call returns []."""
        hooks, self._end_hooks = self._end_hooks[::-1], []
        return hooks

    def reject(self, status: int, message: str, reason: str, *, type_: str | None = None, param: str | None = None,
               retry_after_s: int | None = None, code: str | None = None) -> web.Response:
        """An error in the request's API shape, counted as a rejection with ``reason``, with ``response_headers``;
        ``retry_after_s`` adds a Retry-After header (seconds); ``code``: OpenAI's string error code, if any."""
        if code is not None and self.api == "openai":
            response = openai_error(status, message, type_=type_, param=param, code=code)
        else:
            response = error_response(self.api, status, message, type_=type_, param=param)
        response.headers.update(self.response_headers)
        if retry_after_s is not None:
            response.headers["Retry-After"] = str(retry_after_s)
        self.reason, self.rejected = reason, True
        return response
