"""How many tokens a request draws from a tokens-per-minute bucket, before it runs.

Prompt tokens are estimated from the prompt's characters by the routing core's estimator (skylb/core/estimate.py
``text_tokens``: characters / 4, rounded up, about right for English BPE vocabularies); output tokens are what the
request caps them at (``max_tokens``), else the configured ``default_max_tokens``; embeddings generate none. Source:
the LLM-Load-Balancer README, "Iteration 1" ("prompt plus max_tokens, or an estimate"), OpenAI's own rate limiter
(it charges the prompt plus ``max_tokens`` times ``n`` up front).
Pure: no I/O.
"""

from __future__ import annotations

from skylb.core.estimate import text_tokens
from skylb.quota.priorities import EMBEDDING_PATHS

__all__ = ["request_tokens", "is_embedding_path"]


def is_embedding_path(path: str) -> bool:
    """True for the embedding endpoints (OpenAI ``/v1/embeddings``, Ollama ``/api/embed`` and ``/api/embeddings``)."""
    return path in EMBEDDING_PATHS


def request_tokens(text: str, max_tokens: int | None, *, embedding: bool, default_max_tokens: int) -> int:
    """Tokens to charge for one request: ``text_tokens(text)`` (characters / 4, rounded up, at least 1) plus its
    output cap (``max_tokens``, else ``default_max_tokens``; 0 for an embedding). Units: characters in, tokens out."""
    prompt = text_tokens(text)
    if embedding:
        return prompt
    return prompt + (max_tokens if max_tokens is not None else default_max_tokens)
