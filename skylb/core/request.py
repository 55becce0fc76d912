"""The routing core's view of a request: what routing needs, nothing about HTTP; and the names the queue orders
requests by (priority classes, the default tenant), which the quotas, the balancer and the controller take from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Request", "PRIORITIES", "Priority", "DEFAULT_TENANT"]

#: Priority classes, most urgent first: embeddings (critical), then ``X-Priority: high``, then the rest, as in
#: "Why I Built a Priority Queue for Ollama" (three strict tiers), with ``low`` below ``normal``.
PRIORITIES = ("critical", "high", "normal", "low")
#: One of :data:`PRIORITIES`, for pydantic fields and type hints.
Priority = Literal["critical", "high", "normal", "low"]
#: The tenant of a request whose API key names none (or when the balancer checks no keys).
DEFAULT_TENANT = "default"


@dataclass(eq=False)
class Request:
    """One request waiting for a routing decision.

    Attributes:
        id: unique id (the balancer's request id).
        text: the prompt text the prefix trie keys on (chat messages flattened in order).
        arrived_at: arrival time at this balancer, s on the caller's clock (the core never reads a clock).
        model: the requested model name.
        session_key: the hash-ring key (session header, OpenAI ``user`` or ``prompt_cache_key``), or None.
        forwarded_from: the region of the peer that forwarded this request, or None when a client sent it here.
            A forwarded request is never forwarded again (one hop: no request loops between regions).
        prompt_tokens: an estimate of the prompt's length in tokens, when known (for reporting only).
        api: the API dialect the request must be served in: "openai" (every engine) or "ollama" (Ollama replicas
            and peer balancers only).
        waited_s: how long the request had already waited in the queue of the balancer that forwarded it, s (0 for
            a client's request); the queue orders by ``queued_since``, so a forwarded request keeps its place in
            first-come, first-served order across regions.
        avoid: targets that failed this request before its first byte, as ("local", replica id) or ("peer",
            region); a retry goes elsewhere while another target is usable (Envoy's ``previous_hosts`` predicate).
        priority: its priority class, one of :data:`PRIORITIES` ("critical", "high", "normal", "low");
            only a router with priority classes on reads it (skylb/core/queue.py).
        tenant: the tenant it belongs to (its client API key's; "default" without one); tenants of one class share
            the queue by weighted deficit round robin.
        cost: what one placement charges its tenant under deficit round robin (1: shares counted in requests).
        pin: the one target that may serve it, as ("local", replica id) or ("peer", region), or None (any): a
            follow-up of a stateful answer (OpenAI Responses ``previous_response_id``) must reach the replica that
            holds the state. A pinned request is placed by ``Router.place_pinned``, never through the queue.
        max_tokens: the most output tokens it may generate, as the client said (OpenAI ``max_completion_tokens``
            or ``max_tokens`` times ``n``, Ollama ``num_predict``), or None when it did not say: what an engine that
            reserves KV cache for the output at admission reserves (skylb/core/plugins/kv_admission.py).
    """

    id: str
    text: str
    arrived_at: float
    model: str = ""
    session_key: str | None = None
    forwarded_from: str | None = None
    prompt_tokens: int | None = None
    api: str = "openai"
    waited_s: float = 0.0
    avoid: frozenset[tuple[str, str]] = frozenset()
    #: An embedding request (/v1/embeddings, /api/embed, /api/embeddings): may use an Ollama replica's embedding
    #: slot (skylb/core/fleet_rules.py ``FleetSettings.embedding_slot``).
    embedding: bool = False
    priority: str = "normal"
    tenant: str = DEFAULT_TENANT
    cost: float = 1.0
    pin: tuple[str, str] | None = None
    max_tokens: int | None = None
    #: The prompt's characters as skylb/core/rates.py ``prompt_chars`` counts them, cached by ``request_chars``
    #: (a decision may need them several times, and a long prompt costs a scan each time).
    chars: int | None = field(default=None, repr=False)
    #: The prompt's trie key, cached with the trie's ``chunking`` it was cut with.
    chunks: tuple[str, ...] | None = field(default=None, repr=False)
    chunking: tuple[int, int] | None = field(default=None, repr=False)
    #: The queue look-ahead's walk of this request's key while it waits (a prefix_trie.KeptMatch, reused while the
    #: trie nodes it depends on are unchanged; skylb/core/plugins/prefix_lookahead.py).
    kept_match: object | None = field(default=None, repr=False)
    #: The prompt's KV-cache block hashes as the engines publishing KV-cache events hash them (64-bit ints, prompt
    #: order; skylb/core/kv_hash.py), computed before the request is queued; None: not computed (no replica
    #: publishes events, or the engine's tokenizer did not answer), and routing uses the prefix trie alone.
    block_hashes: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        """What the request asks of a replica, as replicas' capabilities are recorded (``ReplicaState.supports``):
        "embeddings" or "generation"."""
        return "embeddings" if self.embedding else "generation"

    @property
    def may_forward(self) -> bool:
        """True when this request may still go to a peer (it did not arrive from one)."""
        return self.forwarded_from is None

    @property
    def queued_since(self) -> float:
        """When the request joined its first balancer's queue, on this balancer's clock (s): ``arrived_at``
        less ``waited_s``."""
        return self.arrived_at - self.waited_s
