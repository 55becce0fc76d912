"""Quotas: what limits exist, as the config file and the controller hold them.

Three kinds of entry, all optional, all changeable at runtime through the controller (``skylb-ctl quota``):

* ``tenants``: per tenant (the name its API keys map to; ``default`` for requests without a tenant), a ``weight``
  (its share of the queue under weighted deficit round robin), a default ``priority`` class, and per model (or
  ``"*"``: every model together) a :class:`Limit`.
* ``models``: per model, a :class:`Limit` on all traffic to it, whatever the tenant (LLM-Load-Balancer: a model's
  tokens-per-minute bucket and concurrency cap).
* ``groups``: per group alias (for example ``fast``), the models that serve it interchangeably with their weights
  (LLM-Load-Balancer, "Iteration 1": weighted deficit round robin across models).

A limit is global across regions: balancers share counters through Redis when ``quota.redis_url`` is set, else
each balancer enforces its region's share (skylb/quota/buckets.py).

Sources: "LLM-Load-Balancer" (the quota-aware router's README); "Why I Built a Priority Queue for Ollama" (priority
classes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from skylb.core.request import Priority

__all__ = ["Limit", "TenantQuota", "Quotas", "ALL_MODELS"]

#: The model key of a tenant limit on all its models together.
ALL_MODELS = "*"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limit(_Strict):
    """One bucket set: any of the three may be unset (no limit of that kind).

    Attributes:
        tokens_per_minute: prompt plus ``max_tokens`` (or an estimate) admitted per minute; refills continuously
            at tokens_per_minute / 60 per second, starting full (LLM-Load-Balancer's TPM bucket).
        requests_per_minute: requests admitted per minute, refilled the same way.
        max_concurrent: requests in flight at once (admitted and not yet finished).
    """

    tokens_per_minute: int | None = Field(None, gt=0)
    requests_per_minute: int | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)

    def is_empty(self) -> bool:
        """True when no limit of any kind is set."""
        return self.tokens_per_minute is None and self.requests_per_minute is None and self.max_concurrent is None


class TenantQuota(_Strict):
    """A tenant's share and limits.

    Attributes:
        weight: its share of the queue when tenants compete for replicas (weighted deficit round robin), > 0.
        priority: the class its requests get without an ``X-Priority`` header (embeddings are always critical).
        limits: per model name, or ``"*"`` for all its models together, a Limit.
    """

    weight: float = Field(1.0, gt=0)
    priority: Priority = "normal"
    limits: dict[str, Limit] = Field(default_factory=dict)


#: The quota of a tenant without an entry (``Quotas.tenant``).
_NO_QUOTA = TenantQuota()


class Quotas(_Strict):
    """Every quota of a deployment (the ``quotas`` section of the config; the controller's copy wins when a
    balancer has a controller)."""

    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
    models: dict[str, Limit] = Field(default_factory=dict)
    groups: dict[str, dict[str, float]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _groups_valid(self) -> "Quotas":
        for name, members in self.groups.items():
            if not members:
                raise ValueError(f"group {name!r} has no models")
            for model, weight in members.items():
                if weight <= 0:
                    raise ValueError(f"group {name!r}: weight of {model!r} must be > 0, not {weight}")
            if name in members:
                raise ValueError(f"group {name!r} cannot list itself as a model")
        return self

    def tenant(self, name: str) -> TenantQuota:
        """``name``'s quota; a tenant without an entry has weight 1, class normal and no limits (one shared
        instance, read only: every request asks, and building a model is the cost of the ask)."""
        return self.tenants.get(name) or _NO_QUOTA

    def limits_for(self, tenant: str, model: str) -> list[tuple[str, Limit]]:
        """The buckets a request of ``tenant`` for ``model`` draws on, as (bucket key, Limit) pairs: the tenant's
        limit on ``model``, its limit on all models (``"*"``), and the model's own limit; empty ones left out.
        Keys are stable strings (``tenant/<tenant>/<model>``, ``model/<model>``) shared by every balancer."""
        out: list[tuple[str, Limit]] = []
        quota = self.tenants.get(tenant)
        if quota is not None:
            for key in (model, ALL_MODELS):
                limit = quota.limits.get(key)
                if limit is not None and not limit.is_empty():
                    out.append((f"tenant/{tenant}/{key}", limit))
        limit = self.models.get(model)
        if limit is not None and not limit.is_empty():
            out.append((f"model/{model}", limit))
        return out
