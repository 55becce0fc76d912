"""Priority classes: the ``balancer.priorities`` settings and how a request gets its class.

Classification ("Why I Built a Priority Queue for Ollama", its three priority tiers, extended with tenants):

* embeddings (``/v1/embeddings``, ``/api/embed``, ``/api/embeddings``) are ``critical`` by their path alone: no
  client change is needed for the case that matters most (a 30 ms embedding must not wait behind minutes of
  generations);
* else an ``X-Priority: high | normal | low`` header (case-insensitive) picks the class; any other value is a 400
  in the API's shape (``critical`` is kept for embeddings);
* else the tenant's default class (``quotas.tenants.<tenant>.priority``, ``normal`` unless set).

A forwarded request keeps the class and tenant it got at its first balancer: they travel as X-SkyLB-Priority and
X-SkyLB-Tenant, read only on a request that passed the peer token check (like X-SkyLB-Queue-Ms).

The queue itself (classes, aging, tenants by weighted deficit round robin) is skylb/core/queue.py.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from skylb.core.request import PRIORITIES

__all__ = ["PrioritySettings", "PRIORITY_HEADER", "PEER_PRIORITY_HEADER", "PEER_TENANT_HEADER", "EMBEDDING_PATHS",
           "HEADER_CLASSES", "BadPriority", "classify", "peer_class", "peer_headers"]

#: The client's header choosing a class ("Why I Built a Priority Queue for Ollama").
PRIORITY_HEADER = "X-Priority"
#: On a forwarded request: the class it got at the forwarding balancer (trusted only with the peer token).
PEER_PRIORITY_HEADER = "X-SkyLB-Priority"
#: On a forwarded request: its tenant at the forwarding balancer (trusted only with the peer token).
PEER_TENANT_HEADER = "X-SkyLB-Tenant"
#: Paths whose requests are ``critical`` (the priority-queue blog: embeddings are classified by URL path).
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/api/embed", "/api/embeddings"})
#: The classes a client may ask for with X-Priority.
HEADER_CLASSES = ("high", "normal", "low")
#: The longest tenant name accepted from a peer header (characters).
_MAX_TENANT_CHARS = 128


class PrioritySettings(BaseModel):
    """``balancer.priorities``: priority classes and tenants in the queue (off by default: FCFS).

    Attributes:
        enabled: order the queue by class (critical, high, normal, low), then tenant by weighted deficit round
            robin (weights: ``quotas.tenants.<tenant>.weight``), then first come, first served; and classify
            requests (embeddings critical, ``X-Priority``, the tenant's default class). Off: one FCFS queue, and
            ``X-Priority`` is ignored.
        aging_s: a queued request's class rises one step per this many seconds waited, so ``low`` is not starved
            while the balancer stays saturated (s; 0: strict classes, never aged). Default 60 s: a ``low`` request
            competes as ``critical`` after 3 minutes, well inside the default queue timeout of 600 s.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    aging_s: float = Field(60.0, ge=0)


class BadPriority(ValueError):
    """An ``X-Priority`` header with a value other than high, normal or low (the client gets 400)."""


def classify(path: str, header: str | None, tenant_default: str, *, use_header: bool = True) -> str:
    """The class of a client's request: ``critical`` for an embedding path, else the ``X-Priority`` ``header``
    (high, normal or low, any case, surrounding spaces ignored), else ``tenant_default``. ``use_header`` False
    (priority classes off here) ignores the header: the class still travels to peers, which may have them on.

    Raises BadPriority for any other header value (also on an embedding path: a bad header is a client bug)."""
    chosen = None
    if header is not None and use_header:
        chosen = header.strip().lower()
        if chosen not in HEADER_CLASSES:
            shown = header if len(header) <= 40 else header[:40] + "..."
            raise BadPriority(f"{PRIORITY_HEADER} must be one of {', '.join(HEADER_CLASSES)}, not {shown!r}")
    if path in EMBEDDING_PATHS:
        return "critical"
    if chosen is not None:
        return chosen
    return tenant_default if tenant_default in PRIORITIES else "normal"


def _header_safe_tenant(tenant: str | None) -> bool:
    return bool(tenant) and len(tenant) <= _MAX_TENANT_CHARS and tenant.isascii() and tenant.isprintable()


def peer_headers(priority: str, tenant: str) -> dict[str, str]:
    """The headers that carry a forwarded request's class and tenant to the peer (a tenant name that is not
    printable ASCII of at most 128 characters is left out: the peer then counts it as its own ``default``)."""
    headers = {PEER_PRIORITY_HEADER: priority}
    if _header_safe_tenant(tenant):
        headers[PEER_TENANT_HEADER] = tenant
    return headers


def peer_class(priority: str | None, tenant: str | None) -> tuple[str | None, str | None]:
    """The (class, tenant) a forwarding peer sent (X-SkyLB-Priority, X-SkyLB-Tenant), each None when absent or
    not valid (a class not in PRIORITIES; a tenant empty, over 128 characters or not printable ASCII): the
    request is then classified here as a client's would be."""
    cls = priority.strip().lower() if priority else None
    if cls not in PRIORITIES:
        cls = None
    if not _header_safe_tenant(tenant):
        tenant = None
    return cls, tenant
