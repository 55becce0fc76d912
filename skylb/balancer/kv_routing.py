"""Exact cache locality in the balancer: the block index, a subscriber per replica that publishes KV-cache events,
their metrics and status, and each request's block hashes from the engine's own tokenizer.

A replica publishes events when its membership entry says where (``kv_events``: the engine's ZMQ PUB endpoint,
``kv_events_replay``: its replay socket, ``kv_block_size``: tokens per block when it is not the one its events
report; `skylb-ctl replica add --kv-events`, or `skylb balancer --replica URL#kv=tcp://...`). Every membership change
updates the subscribers (:class:`~skylb.engines.kv_subscriber.KVEventSubscribers`); the router's prefix locality
reads the index (skylb/core/plugins/kv_locality.py).

A request's block hashes are computed once, before it is queued and outside the routing decision: its prompt is
tokenized by one live event-publishing replica serving its model (vLLM ``POST /tokenize``, the chat template applied
by the engine itself; ``vllm/entrypoints/openai/serving_tokenization.py``, request and response shapes in
``vllm/entrypoints/openai/protocol.py`` ``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``TokenizeResponse``), then hashed as vLLM hashes blocks (skylb/core/kv_hash.py). A tokenizer that fails or does
not answer within ``balancer.kv_tokenize_timeout_ms`` leaves the request without hashes: it is routed by the prefix
trie, as every request is when no replica publishes events. The tokenizing time is the histogram
``skylb_kv_tokenize_seconds`` (by outcome), apart from the routing decision's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import aiohttp
import structlog
from prometheus_client import Histogram
from prometheus_client.registry import CollectorRegistry

from skylb.core.kv_index import BlockIndex, ReplicaEvents
from skylb.core.state import ReplicaState
from skylb.core.kv_hash import BlockHashCache, request_block_hashes
from skylb.engines.kv_metrics import KVIndexCollector
from skylb.core.kv_endpoint import KVEventsEndpoint

if TYPE_CHECKING:
    from skylb.engines.kv_subscriber import KVEventSubscribers

__all__ = ["KVRouting", "kv_endpoint", "tokenize_body", "DEFAULT_BLOCK_SIZE"]

log = structlog.get_logger("skylb.kv_routing")

#: Tokens per block assumed for a replica whose events have not said yet and whose entry sets none (vLLM's default).
DEFAULT_BLOCK_SIZE = 16
#: Chat fields vLLM's ``TokenizeChatRequest`` shares with a chat completion request: they change the chat template's
#: output, so the tokenizer gets them as the request has them.
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                "chat_template_kwargs", "tools", "documents")
_TOKENIZE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def kv_endpoint(entry: Mapping) -> KVEventsEndpoint | None:
    """The KV-cache event endpoint of a membership replica entry (``kv_events``, ``kv_events_replay``), or None
    when it has none. Raises ValueError for an endpoint that is not ``tcp://HOST:PORT`` (or ``ipc://``,
    ``inproc://``), or a replay endpoint without an event endpoint."""
    endpoint, replay = entry.get("kv_events"), entry.get("kv_events_replay")
    if endpoint is None:
        if replay is not None:
            raise ValueError("kv_events_replay needs kv_events (the replica's event endpoint) too")
        return None
    return KVEventsEndpoint(endpoint, replay)


def tokenize_body(path: str, body: Mapping) -> dict | list[int] | None:
    """What vLLM's ``POST /tokenize`` needs for a request to ``path`` with JSON ``body``: a chat request's
    ``{"model", "messages", ...chat template fields}``, a completion's ``{"model", "prompt"}``; a completion whose
    prompt is already token ids is those ids (nothing to ask). None for anything else (a batch of prompts, the
    Responses API, embeddings): such a request gets no block hashes."""
    model = body.get("model")
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        return {"model": model, "messages": body["messages"], **{k: body[k] for k in _CHAT_FIELDS if k in body}}
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            keep = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
            return {"model": model, "prompt": prompt, **keep}
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
    return None


class KVRouting:
    """The balancer's block index and what feeds it.

    Args:
        max_blocks: the index's bound, blocks (``balancer.kv_index_max_blocks``). region: the balancer's region
        (metric label). tokenize_timeout_s: the longest wait for one replica's ``/tokenize``, s.
    """

    def __init__(self, *, max_blocks: int, region: str, tokenize_timeout_s: float):
        self.index = BlockIndex(max_blocks)
        self.region = region
        self.tokenize_timeout_s = tokenize_timeout_s
        self.tokenize_seconds = Histogram(
            "skylb_kv_tokenize_seconds", "Time to get a request's token ids from a replica's /tokenize and hash its "
            "blocks, by outcome (ok, error, timeout), s; spent before the request is queued, not in routing.",
            ["region", "outcome"], buckets=_TOKENIZE_BUCKETS_S, registry=None)
        #: {replica id: tokens per block} set in membership entries (``kv_block_size``).
        self.block_sizes: dict[str, int] = {}
        self.endpoints: dict[str, KVEventsEndpoint] = {}
        self._subscribers: KVEventSubscribers | None = None
        #: The blocks hashed lately (skylb/core/kv_hash.py): a conversation's next turn and a tenant's shared
        #: prompt hash only their new blocks in full (about a third of the cost per block seen, 1.2x per new one).
        self.hash_cache = BlockHashCache()

    def register(self, registry: CollectorRegistry) -> None:
        """Add the index's metrics (skylb/engines/kv_metrics.py) and the tokenize histogram to ``registry``."""
        KVIndexCollector(self.index, region=self.region).register(registry)
        registry.register(self.tokenize_seconds)

    def apply(self, entries: Iterable[Mapping]) -> None:
        """Follow the event streams of ``entries`` (the membership replica entries this balancer serves); an entry
        whose endpoint is invalid is logged and left on the trie. Subscribers start once ``start`` ran."""
        endpoints, sizes = {}, {}
        for entry in entries:
            try:
                endpoint = kv_endpoint(entry)
            except ValueError as exc:
                log.error("kv_events_endpoint_invalid", replica=entry.get("id"), error=str(exc))
                continue
            if endpoint is not None:
                endpoints[entry["id"]] = endpoint
                if isinstance(entry.get("kv_block_size"), int) and entry["kv_block_size"] >= 1:
                    sizes[entry["id"]] = entry["kv_block_size"]
        self.endpoints, self.block_sizes = endpoints, sizes
        if self._subscribers is not None:
            self._subscribers.update(endpoints)

    def start(self) -> None:
        """Start following the streams applied so far (inside the event loop)."""
        from skylb.engines.kv_subscriber import KVEventSubscribers  # here: pyzmq loads only where events are followed
        self._subscribers = KVEventSubscribers(self.index)
        self._subscribers.update(self.endpoints)

    async def close(self) -> None:
        """Stop every subscriber and close its sockets."""
        if self._subscribers is not None:
            await self._subscribers.close()
            self._subscribers = None

    def block_size(self, replica_id: str) -> int:
        """Tokens per block of ``replica_id``: its entry's ``kv_block_size``, else what its events reported, else
        vLLM's default 16."""
        state = self.index.replicas.get(replica_id)
        return self.block_sizes.get(replica_id) or (state and state.block_size) or DEFAULT_BLOCK_SIZE

    def tokenizer(self, replicas: Iterable[ReplicaState], model: str) -> ReplicaState | None:
        """The replica to tokenize a request for ``model`` with: among healthy, not draining replicas serving it
        whose events are live, the one with the fewest outstanding requests; None when there is none."""
        live = [r for r in replicas if self.index.is_live(r.id) and r.healthy and not r.draining
                and r.serves(model, "openai")]
        return min(live, key=lambda r: (r.outstanding, r.id)) if live else None

    async def block_hashes(self, session: aiohttp.ClientSession, replica: ReplicaState, ask: dict | list[int], *,
                           cache_salt: str | None, authorization: str | None) -> tuple[tuple[int, ...], int] | None:
        """(the request's block hashes, its prompt tokens) with ``replica``'s tokenizer and block size; ``ask`` is
        :func:`tokenize_body`'s answer. None when the replica fails or does not answer in time (logged, counted)."""
        started = time.perf_counter()
        outcome, answer = "ok", None
        try:
            ids = ask if isinstance(ask, list) else await self._tokenize(session, replica, ask, authorization)
            answer = (request_block_hashes(ids, self.block_size(replica.id), cache_salt=cache_salt,
                                           cache=self.hash_cache), len(ids))
        except asyncio.TimeoutError:
            outcome = "timeout"
        except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            outcome = "error"
            log.warning("kv_tokenize_failed", replica=replica.id, error=repr(exc))
        self.tokenize_seconds.labels(self.region, outcome).observe(time.perf_counter() - started)
        return answer

    async def _tokenize(self, session: aiohttp.ClientSession, replica: ReplicaState, body: dict,
                        authorization: str | None) -> list[int]:
        """The token ids vLLM's ``/tokenize`` on ``replica`` gives ``body``; raises ValueError for an answer
        that is not 200 with ``tokens`` a list of ints, aiohttp errors and asyncio.TimeoutError as they come."""
        headers = {"Authorization": authorization} if authorization else None
        timeout = aiohttp.ClientTimeout(total=self.tokenize_timeout_s)
        async with session.post(f"{replica.url}/tokenize", json=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"/tokenize answered {resp.status}")
            tokens = (await resp.json(content_type=None)).get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError("/tokenize answered without a list of token ids")
        return tokens

    def status(self) -> dict:
        """Per replica with an event endpoint: {"endpoint", "live", "block_size", "blocks", "batches", "gaps",
        "replayed", "unfilled_gaps", "drops"}, plus the index's "blocks" and "max_blocks", and the block hash cache's
        "hash_cache": {"blocks", "hits", "misses"} (blocks hashed from it and in full since the balancer began)."""
        index = self.index
        replicas = {}
        for rid, endpoint in sorted(self.endpoints.items()):
            state = index.replicas.get(rid) or ReplicaEvents()
            replicas[rid] = {"endpoint": endpoint.endpoint, "live": state.live, "block_size": self.block_size(rid),
                             "blocks": index.replica_blocks(rid), "batches": state.batches, "gaps": state.gaps,
                             "replayed": state.replayed, "unfilled_gaps": state.unfilled_gaps, "drops": state.drops}
        cache = self.hash_cache
        return {"blocks": len(index), "max_blocks": index.max_blocks, "replicas": replicas,
                "hash_cache": {"blocks": len(cache), "hits": cache.hits, "misses": cache.misses}}
