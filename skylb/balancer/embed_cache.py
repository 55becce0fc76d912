"""The embedding cache: identical embedding requests are answered from memory, before the queue.

Source: "Why I Built a Priority Queue for Ollama", "The Embed Cache": embeddings are deterministic (same model, same
input, same vector), so a repeated one costs a replica nothing; the blog keys on model and input with a 5 minute
TTL and a hit is answered before the queue. Here the key also holds everything else that can change the answer
(every body field but ``user`` and ``keep_alive``: ``dimensions``, ``encoding_format``, ``truncate``, ``options``,
...), the path (the three embedding APIs answer in different shapes), the tenant, and, when clients' own
``Authorization`` goes on to the replicas (no SkyLB client keys), a digest of it, so a hit never answers a client
the replica would have refused, and one tenant cannot learn from the latency what another embedded.

Only whole (not streamed) 200 answers are stored, as the replica's bytes. The bound is in bytes (the stored
bodies plus a fixed overhead per entry), with cachetools' TTLCache (least recently used goes first when full).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from aiohttp import web
from cachetools import TTLCache
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from skylb.quota.priorities import EMBEDDING_PATHS

__all__ = ["EmbeddingCacheSettings", "EmbeddingCache", "ENTRY_OVERHEAD_BYTES"]

#: Bytes counted per entry besides its body (the key, the tuple, the TTL link): a rough but fixed charge, so many
#: tiny answers cannot exceed the bound by much.
ENTRY_OVERHEAD_BYTES = 256
#: Body fields that never change the vectors (OpenAI's end-user id, Ollama's model keep-alive).
_IGNORED_FIELDS = frozenset({"user", "keep_alive"})


class EmbeddingCacheSettings(BaseModel):
    """``balancer.embedding_cache``: answers to repeated embedding requests kept in memory (off by default).

    Attributes:
        enabled: keep successful embedding answers and answer identical requests from memory.
        ttl_s: how long an answer is kept, s ("Why I Built a Priority Queue for Ollama": 5 minutes).
        max_bytes: the most memory the answers take, bytes (bodies plus 256 bytes per entry); the least recently
            used go first. An answer larger than this is not kept.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    ttl_s: float = Field(300.0, gt=0)
    max_bytes: int = Field(8 * 1024 * 1024, gt=0)


class _Store(TTLCache):
    """A TTLCache that reports each eviction (``on_evict("size" | "ttl")``)."""

    def __init__(self, maxsize: int, ttl: float, on_evict: Callable[[str], None]):
        super().__init__(maxsize=maxsize, ttl=ttl, getsizeof=_size_of)
        self._on_evict = on_evict

    def popitem(self):
        item = super().popitem()  # called by __setitem__ while the new entry does not fit
        self._on_evict("size")
        return item

    def expire(self, time=None):
        expired = super().expire(time)
        for _ in expired:
            self._on_evict("ttl")
        return expired


def _size_of(entry: tuple[bytes, str]) -> int:
    return len(entry[0]) + ENTRY_OVERHEAD_BYTES


class _SizeCollector:
    """The cache's entries and bytes, read at scrape time."""

    def __init__(self, cache: "EmbeddingCache"):
        self.cache = cache

    def collect(self):
        store, region = self.cache.store, self.cache.region
        store.expire()
        entries = GaugeMetricFamily("skylb_embedding_cache_entries", "Embedding answers held in the cache.",
                                    labels=["region"])
        entries.add_metric([region], len(store))
        yield entries
        size = GaugeMetricFamily("skylb_embedding_cache_bytes", "Bytes the cached embedding answers take (bodies "
                                 f"plus {ENTRY_OVERHEAD_BYTES} per entry).", labels=["region"])
        size.add_metric([region], store.currsize)
        yield size


class EmbeddingCache:
    """Embedding answers by request key, with hit, miss and eviction metrics in ``registry``.

    Args:
        settings: ``balancer.embedding_cache``; region: the metric label; registry: the balancer's registry.
    """

    def __init__(self, settings: EmbeddingCacheSettings, *, region: str, registry: CollectorRegistry):
        self.region = region
        self.hits = Counter("skylb_embedding_cache_hits", "Embedding requests answered from the cache (no replica "
                            "reached).", ["region"], registry=registry).labels(region)
        self.misses = Counter("skylb_embedding_cache_misses", "Embedding requests not in the cache (sent on to a "
                              "replica or peer).", ["region"], registry=registry).labels(region)
        evictions = Counter("skylb_embedding_cache_evictions", "Cached embedding answers dropped, by reason: size "
                            "(the byte bound; least recently used first) or ttl (older than ttl_s).",
                            ["region", "reason"], registry=registry)
        self._evicted = {reason: evictions.labels(region, reason) for reason in ("size", "ttl")}
        self.store = _Store(settings.max_bytes, settings.ttl_s, lambda reason: self._evicted[reason].inc())
        registry.register(_SizeCollector(self))

    @classmethod
    def from_settings(cls, settings: EmbeddingCacheSettings, *, region: str,
                      registry: CollectorRegistry) -> "EmbeddingCache | None":
        """The cache, or None when ``settings.enabled`` is off."""
        return cls(settings, region=region, registry=registry) if settings.enabled else None

    @staticmethod
    def key(path: str, body: bytes, *, tenant: str, authorization: str | None) -> str | None:
        """The cache key of an embedding request (a sha256 hex digest), or None when ``path`` is not an embedding
        path or ``body`` is not a JSON object (such a request is not cached).

        ``authorization``: the client's Authorization header when it goes on to replicas, else None."""
        if path not in EMBEDDING_PATHS:
            return None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        fields = {k: v for k, v in data.items() if k not in _IGNORED_FIELDS}
        canonical = json.dumps([path, tenant, fields], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        digest = hashlib.sha256(canonical.encode())
        if authorization is not None:
            digest.update(b"\0" + hashlib.sha256(authorization.encode()).digest())
        return digest.hexdigest()

    def get(self, key: str) -> web.Response | None:
        """A fresh 200 response with the cached body for ``key`` (a hit), or None (a miss); counts either."""
        entry = self.store.get(key)
        if entry is None:
            self.misses.inc()
            return None
        self.hits.inc()
        body, content_type = entry
        return web.Response(status=200, body=body, headers={"Content-Type": content_type})

    def put(self, key: str, body: bytes, content_type: str = "application/json") -> bool:
        """Keep ``body`` (a replica's whole 200 answer) under ``key``; False when it is larger than the bound."""
        try:
            self.store[key] = (body, content_type)
        except ValueError:  # cachetools: "value too large"
            return False
        return True
