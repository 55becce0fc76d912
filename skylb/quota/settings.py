"""How a balancer enforces quotas (``balancer.quota`` in the config): where bucket levels live, how long a request
over a limit waits before 429, and how requests are sized in tokens.

The limits themselves are ``balancer.quotas`` (skylb/quota/limits.py). With no quotas configured nothing here has
any effect: every request passes the gate at once, as before quotas existed. Units are in the key names.
Source: the LLM-Load-Balancer README ("Iteration 1": token buckets in Redis, updated by Lua scripts;
"Iteration 2": jittered waits, leases).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["QuotaSettings"]


class QuotaSettings(BaseModel):
    """The ``balancer.quota`` section.

    Attributes:
        enabled: quotas, model groups and admission leases in the request path (the default). False leaves the quota
            gate and the model-group stage out of the balancer's chain: no limit is enforced, quotas from the
            controller are ignored, a model group alias is an unknown model.
        redis_url: a Redis shared by every balancer (``redis://host:6379/0``, ``rediss://`` for TLS; a password in
            the URL or ``$SKYLB_REDIS_URL``): limits are then global, counted atomically by Lua scripts. None (the
            default): each balancer counts in its own process, enforcing its share of every limit.
        key_prefix: prefix of every Redis key SkyLB writes, so several deployments can share one Redis. On a Redis
            Cluster, put a hash tag in it (``"{skylb}:"``) so a request's keys share one slot.
        wait_s: how long a request over a limit waits for room before it gets 429 with Retry-After, s (capped by
            ``balancer.queue_timeout_s``; 0 answers 429 at once).
        default_max_tokens: the output tokens assumed for a request that sets no ``max_tokens`` /
            ``max_completion_tokens`` (OpenAI) or ``options.num_predict`` (Ollama), tokens.
        local_share: the fraction of every limit this balancer enforces when it counts on its own (no Redis, or
            Redis unreachable), 0 < share <= 1. None (the default): 1 / the number of regions whose balancers are in
            membership (this one and its live peers), until the controller assigns a share.
        redis_connect_timeout_s: the longest a connection to Redis may take before this balancer falls back, s.
        redis_timeout_s: the longest one Redis command may take before this balancer falls back, s.
        redis_retry_s: while Redis is unreachable, how often to try it again, s.
        slot_lease_s: the lease of a concurrency slot held in Redis, s: this balancer renews the leases of its
            requests in flight every third of it, so a balancer that dies (or loses Redis) frees its slots at the
            latest this long after.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    redis_url: str | None = None
    key_prefix: str = Field("skylb:quota:", max_length=200)
    wait_s: float = Field(30.0, ge=0)
    default_max_tokens: int = Field(256, ge=0)
    local_share: float | None = Field(None, gt=0, le=1)
    redis_connect_timeout_s: float = Field(0.5, gt=0)
    redis_timeout_s: float = Field(0.5, gt=0)
    redis_retry_s: float = Field(5.0, gt=0)
    slot_lease_s: float = Field(60.0, ge=3)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url {url!r} is not a URL such as redis://127.0.0.1:6379/0")
        return url
