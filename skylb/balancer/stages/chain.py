"""The chain runner: a request's stages in order, the first answer wins, every end hook exactly once.

The shape is Envoy's HTTP filter chain ("HTTP filters", Envoy architecture overview): each stage owns one concern,
may answer the request itself (a 4xx, a 429, a cached embedding) or pass it on by returning None, and the last
stage, like Envoy's router filter, always answers (queue, route, relay with retries). A retry or a forward happens
inside that terminal stage, so no stage before it runs twice for one request and nothing is charged twice.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Protocol

import structlog
from aiohttp import web

from skylb.balancer.stages.context import RequestContext
from skylb.balancer.stages.finish import RequestLog

__all__ = ["Stage", "Chain"]

log = structlog.get_logger("skylb.request")


class Stage(Protocol):
    """One step of a request's path. ``name`` names it in the chain (status, tests)."""

    name: str

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        """Answer the request (a response) or pass it on (None); may register end hooks with ``ctx.on_end``."""


class Chain:
    """Stages in order; the last must answer. ``request_log`` counts each response and writes its log line."""

    def __init__(self, stages: Sequence[Stage], *, request_log: RequestLog):
        self.stages = tuple(stages)
        self.request_log = request_log

    @property
    def names(self) -> list[str]:
        """The stages' names, in order."""
        return [stage.name for stage in self.stages]

    async def run(self, ctx: RequestContext) -> web.StreamResponse:
        """Pass ``ctx`` through the stages until one answers; then (also when cancelled or on an error) run the end
        hooks, last registered first, each once; then count the response and log the request's one line. A request
        cancelled on the way (its client went away: queued, waiting for its first byte, or mid-stream) gets its line
        too, with status 499 (nginx's "client closed request"), before the cancellation goes on.
        Raises RuntimeError when no stage answers (a chain built without its terminal stage)."""
        response = None
        try:
            try:
                for stage in self.stages:
                    response = await stage.handle(ctx)
                    if response is not None:
                        break
                else:
                    raise RuntimeError(f"no stage of {self.names} answered the request")
            finally:
                await self._run_end_hooks(ctx)
        except asyncio.CancelledError:
            self.request_log.cancelled(ctx)
            raise
        return self.request_log.finish(ctx, response)

    @staticmethod
    async def _run_end_hooks(ctx: RequestContext) -> None:
        for hook in ctx.take_end_hooks():
            try:
                result = hook(ctx)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # one failing hook must not keep the others from releasing what they hold
                log.exception("end_hook_failed", id=ctx.request_id, hook=getattr(hook, "__qualname__", repr(hook)))
