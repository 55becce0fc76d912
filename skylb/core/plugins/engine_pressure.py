"""Availability that sees prefill backlog and KV pressure (a Filter of the default profile).

Besides the router's rule (0 pending at the latest probe; AvailabilityRules), a replica must have less than
``backlog_budget_tokens`` of this balancer's prompt tokens still waiting for their first token (about one
chunked-prefill step: vLLM's ``max_num_batched_tokens`` default is 2048), and, when the engine reports it, KV usage
below ``kv_high_watermark``. Under chunked prefill an engine admits long prompts into its running batch (0 pending)
while every request on it slows down; the backlog clause stops piling more prompts there.
"""

from __future__ import annotations

from skylb.core.state import ReplicaState

__all__ = ["EnginePressure"]


class EnginePressure:
    """Filter: no request to a replica with a prefill backlog of ``backlog_budget_tokens`` (0: no such clause) or
    KV usage at ``kv_high_watermark`` (1: off)."""

    def __init__(self, *, backlog_budget_tokens: int, kv_high_watermark: float):
        self.backlog_budget_tokens, self.kv_high_watermark = backlog_budget_tokens, kv_high_watermark

    def unavailable_reason(self, replica: ReplicaState) -> str | None:
        """"prefill backlog", "KV cache full" or None."""
        budget = self.backlog_budget_tokens
        if budget and replica.unprefilled and replica.backlog_tokens >= budget:
            return "prefill backlog"
        if (replica.kv_usage is not None and self.kv_high_watermark < 1
                and replica.kv_usage >= self.kv_high_watermark):
            return "KV cache full"
        return None
