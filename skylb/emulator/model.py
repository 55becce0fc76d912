"""A pure model of one vLLM replica: continuous batching, a block-level prefix cache and an iteration time model.

No asyncio, no sockets, no clock reads: every method that needs the time takes ``now`` (seconds, any epoch the
caller likes), so the live emulator (skylb/emulator/server.py) and a trace-driven simulator drive this one class.

Tokens: ONE TOKEN = ONE WHITESPACE-SEPARATED WORD (``text.split()``), the convention shared with the workload
generator (bench/workload.py). A chat prompt is, for each message in order, the word ``<role>:`` followed by the
content's words (:func:`chat_tokens`).

How a request moves (vLLM V1 scheduler, simplified):

1. ``submit`` puts it at the tail of the waiting queue and tries admission.
2. Admission is FCFS without skipping: the head is admitted into the running batch only when a running slot is
   free (``max_num_seqs``) and enough KV blocks are free for its prompt plus the output it will generate. The
   blocks are reserved at admission, so nothing is ever preempted. Real vLLM allocates blocks as decoding goes and
   preempts (recomputes) the newest request when it runs out; reserving the eventual footprint up front gives the
   same peak memory per request without modelling preemption. A request not admitted is *pending*: that count is
   ``vllm:num_requests_waiting``, the signal SkyLB's selective pushing reads (SkyLB paper §3.3).
   Real vLLM also leaves a request waiting for one iteration when the step's token budget is used up; here such a
   request is admitted (it holds its slot and blocks) and simply waits for its first prefill chunk, so "pending"
   means exactly "the batch is full", as the paper uses it.
3. Each iteration (``start_step`` .. ``complete_step``) gives every decoding request one token, then spends what is
   left of the token budget (``max_num_batched_tokens``) on prompt chunks of admitted requests in admission order
   (chunked prefill). The chunk that completes a prompt also yields the first output token (as in vLLM).
4. A request finishes after ``output_len`` tokens: exactly ``max_tokens`` when ``ignore_eos`` (so a replay
   reproduces a trace's output lengths), else a deterministic length in ``[1, min(max_tokens, eos_max_tokens)]``
   derived from the prompt (a simulated EOS). Its slot and blocks are released at the end of that step.

Prefix cache (vLLM automatic prefix caching): a full block of ``block_size`` prompt tokens is identified by a hash
chain over (parent block hash, block tokens). Computed prompt blocks are registered in the cache when the step
that computed them completes. Blocks of finished requests stay cached in an LRU free list (a request's blocks are
freed tail first, so its last blocks are evicted first, as in vLLM) and are evicted only when an allocation needs
the space. A new request's cached prefix is the longest run of leading full blocks found in the cache, capped so
that at least the last prompt token is computed (vLLM recomputes it to get logits). Generated tokens are not
cached: a later turn's prompt re-renders the reply with a role marker, so its blocks would not match anyway.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

__all__ = [
    "EngineParams",
    "EngineModel",
    "Step",
    "TokenOutput",
    "FinishedRequest",
    "RequestTooLong",
    "text_tokens",
    "chat_tokens",
    "output_token",
]

_MASK64 = (1 << 64) - 1

#: Words of the generated text (any fixed list works; these are short and plainly fake).
_VOCAB = (
    "the", "a", "model", "token", "cache", "batch", "region", "replica", "request", "answer", "is", "of", "and",
    "to", "in", "that", "prefix", "queue", "load", "balancer", "latency", "first", "next", "step", "block",
    "emulated", "output", "words", "here", "more", "so", "on",
)


def text_tokens(text: str) -> list[str]:
    """The tokens of a completion prompt: its whitespace-separated words."""
    return text.split()


def chat_tokens(messages: Iterable[tuple[str, str]]) -> list[str]:
    """The tokens of a chat prompt from ``(role, content)`` pairs: ``<role>:`` then the content's words, per message."""
    tokens: list[str] = []
    for role, content in messages:
        tokens.append(f"{role}:")
        tokens.extend(content.split())
    return tokens


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit integer hash (deterministic across processes)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def output_token(seed: int, index: int) -> str:
    """The ``index``-th (0-based) generated word of a request whose prompt gave ``seed``; deterministic."""
    return _VOCAB[_mix64(seed ^ (index * 0xD1B54A32D192ED03 & _MASK64)) % len(_VOCAB)]


class RequestTooLong(ValueError):
    """``prompt + max_tokens`` exceeds the model length: the request could never fit in the KV cache."""


@dataclass(frozen=True)
class EngineParams:
    """Every knob of the model, with defaults near meta-llama/Llama-3.1-8B-Instruct (fp16) on one NVIDIA L4.

    Derivations (L4: 24 GB GDDR6 at 300 GB/s, 121 TFLOPS dense fp16; Llama-3.1-8B: 8.03 B parameters, 32 layers,
    8 KV heads of dimension 128):

    * ``decode_base_ms`` = 53.5 ms: a decode step reads all weights once, 16.06 GB / 300 GB/s = 53.5 ms.
    * ``decode_ms_per_kv_token`` = 0.000437 ms: a step also reads each context token's KV,
      2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB per token; 131072 B / 300 GB/s = 0.437 us.
    * ``decode_ms_per_seq`` = 0.25 ms: per-sequence compute, 2 x 8.03 GFLOP / 121 TFLOPS = 0.13 ms at peak,
      doubled for realistic utilisation, sampling and scheduling. One sequence decodes in about 54 ms
      (about 18 tokens/s); 32 sequences of 1000 context tokens take 53.5 + 8 + 14 = 75.5 ms per step.
    * ``prefill_ms_per_token`` = 0.48 ms: the SkyLB paper (§2.1, "Latency metric") says a 512-token prompt
      takes about 300 ms to prefill on an L4; (300 - 53.5 base) / 512 = 0.48 ms per uncached prompt token.
    * ``kv_cache_tokens`` = 32768 (2048 blocks of 16): 24 GB x 0.9 (vLLM ``gpu_memory_utilization``) - 16.06 GB
      weights - about 1.3 GB activations and CUDA graphs leaves about 4.2 GB, / 128 KiB per token = about 32k
      tokens. The paper (§3.3) saw an L4 hold 20 to 50 outstanding requests: 32768 tokens / 20..50 requests =
      650..1600 tokens per request (prompt plus output), WildChat-like sizes.
    * ``max_num_seqs`` = 256 and ``max_num_batched_tokens`` = 2048: vLLM V1's defaults for the OpenAI server on a
      GPU with less than 70 GB; ``block_size`` = 16: vLLM's default.
    * ``max_model_len``: None means the whole KV cache (vLLM refuses to start with a longer one). Llama-3.1's
      native 131072 does not fit an L4; real L4 deployments pass a smaller ``--max-model-len``.
    * ``eos_max_tokens`` = 512: when ``ignore_eos`` is false the simulated EOS comes after
      ``1 + hash(prompt) % min(max_tokens, eos_max_tokens)`` tokens (chat replies are mostly a few hundred tokens).
    * ``time_scale``: multiplies every duration (0.01 = a hundred times faster than an L4, for tests and demos).

    Step time (ms) = ``decode_base_ms`` + ``decode_ms_per_seq`` x decoding sequences + ``decode_ms_per_kv_token``
    x their context tokens + ``prefill_ms_per_token`` x prompt tokens computed in the step; then x ``time_scale``.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int = 32768
    block_size: int = 16
    max_model_len: int | None = None
    prefill_ms_per_token: float = 0.48
    decode_base_ms: float = 53.5
    decode_ms_per_seq: float = 0.25
    decode_ms_per_kv_token: float = 0.000437
    eos_max_tokens: int = 512
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "eos_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one block ({self.block_size})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running sequence needs at least one token of budget per step.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs})")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len is not None and not 2 <= self.max_model_len <= capacity:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be between 2 and the KV cache capacity "
                             f"({capacity} tokens)")
        for name in ("prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq", "decode_ms_per_kv_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")

    @property
    def num_blocks(self) -> int:
        """KV cache size in blocks (``kv_cache_tokens // block_size``)."""
        return self.kv_cache_tokens // self.block_size

    @property
    def model_len(self) -> int:
        """The longest prompt + output a request may ask for (tokens)."""
        return self.max_model_len if self.max_model_len is not None else self.num_blocks * self.block_size

    def step_seconds(self, *, prefill_tokens: int, decode_seqs: int, decode_kv_tokens: int) -> float:
        """Duration (s, already x ``time_scale``) of one iteration with the given work."""
        ms = (self.decode_base_ms + self.decode_ms_per_seq * decode_seqs
              + self.decode_ms_per_kv_token * decode_kv_tokens + self.prefill_ms_per_token * prefill_tokens)
        return ms / 1000.0 * self.time_scale


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request that generated all its tokens; times are the caller's clock (s)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    #: "length" (stopped at max_tokens) or "stop" (simulated EOS).
    finish_reason: str
    submitted_at: float
    admitted_at: float
    first_token_at: float
    finished_at: float

    @property
    def queue_s(self) -> float:
        """Time spent pending, before admission into the running batch (s)."""
        return self.admitted_at - self.submitted_at

    @property
    def ttft_s(self) -> float:
        """Time to first token, from submission (s)."""
        return self.first_token_at - self.submitted_at

    @property
    def e2e_s(self) -> float:
        """Submission to last token (s)."""
        return self.finished_at - self.submitted_at


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One token one request produced in a step; ``finished`` is set on its last token."""

    request_id: str
    #: 0-based position in the completion.
    index: int
    seed: int
    finished: FinishedRequest | None = None

    @property
    def text(self) -> str:
        """The token's word (computed on demand: a simulator that ignores text pays nothing)."""
        return output_token(self.seed, self.index)


@dataclass(frozen=True, slots=True)
class Step:
    """One iteration of the engine: it runs from ``start`` to ``end`` (s) and produces ``outputs`` at ``end``."""

    start: float
    duration: float
    #: Uncached prompt tokens computed in this step (chunked prefill).
    prefill_tokens: int
    #: Requests that decoded one token in this step.
    decode_seqs: int
    outputs: tuple[TokenOutput, ...]

    @property
    def end(self) -> float:
        """When the step's tokens exist (s)."""
        return self.start + self.duration

    @property
    def finished(self) -> tuple[FinishedRequest, ...]:
        """Requests whose last token is in this step."""
        return tuple(o.finished for o in self.outputs if o.finished is not None)


class _Block:
    """A cached KV block: its hash and how many running requests use it (0 = in the LRU free list)."""

    __slots__ = ("block_hash", "ref")

    def __init__(self, block_hash: bytes):
        self.block_hash = block_hash
        self.ref = 1


class _Request:
    """Mutable per-request state (internal)."""

    __slots__ = ("request_id", "prompt_len", "block_hashes", "max_tokens", "output_len", "finish_reason", "seed",
                 "submitted_at", "admitted_at", "first_token_at", "cached_tokens", "num_computed", "num_generated",
                 "num_hashed", "blocks", "anon_blocks")

    def __init__(self, request_id: str, prompt_len: int, block_hashes: list[bytes], max_tokens: int,
                 output_len: int, finish_reason: str, seed: int, now: float):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.block_hashes = block_hashes  # hash of each FULL prompt block, in order
        self.max_tokens = max_tokens
        self.output_len = output_len
        self.finish_reason = finish_reason
        self.seed = seed
        self.submitted_at = now
        self.admitted_at = now
        self.first_token_at = now
        self.cached_tokens = 0
        self.num_computed = 0  # prompt tokens whose KV exists (cached ones included)
        self.num_generated = 0
        self.num_hashed = 0  # leading full prompt blocks already hit or registered
        self.blocks: list[_Block] = []  # cached blocks this request holds a reference on, in prompt order
        self.anon_blocks = 0  # reserved blocks not (yet) in the prefix cache


def _block_hashes(tokens: list[str], block_size: int) -> list[bytes]:
    """Hash chain over the full blocks of ``tokens``: h_i = H(h_{i-1}, block_i)."""
    hashes: list[bytes] = []
    parent = b"skylb-emulator"
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update("\x1f".join(tokens[start:start + block_size]).encode())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class EngineModel:
    """One replica's scheduler state. Not thread-safe; deterministic for a given sequence of calls.

    Drive it with ``submit`` / ``cancel`` as requests come and go, and ``start_step(now)`` then
    ``complete_step(step)`` at ``step.end`` (or ``next_step(now)`` for both at once). Between the two calls the
    step is in flight: its requests keep their slots and blocks until ``complete_step``, so probes taken during a
    step see the batch as it really is.
    """

    def __init__(self, params: EngineParams | None = None):
        self.params = params or EngineParams()
        self._waiting: dict[str, _Request] = {}  # FCFS: dicts keep insertion order and remove in O(1)
        self._running: dict[str, _Request] = {}  # in admission order
        self._cache: dict[bytes, _Block] = {}  # every cached block, in use or not
        self._lru: OrderedDict[bytes, _Block] = OrderedDict()  # cached blocks with ref 0, oldest first
        self._free_anon = self.params.num_blocks  # free blocks holding nothing worth caching
        self._in_flight: tuple[Step, list[tuple[_Request, int]], list[_Request]] | None = None
        #: Prompt tokens looked up in the prefix cache at admission (vLLM ``prefix_cache_queries``).
        self.prefix_cache_queries = 0
        #: Prompt tokens found in the prefix cache (vLLM ``prefix_cache_hits``).
        self.prefix_cache_hits = 0
        #: Prompt tokens of requests whose prefill completed (vLLM ``prompt_tokens``).
        self.prompt_tokens_total = 0
        #: Output tokens produced (vLLM ``generation_tokens``).
        self.generation_tokens_total = 0
        #: Finished requests by finish reason ("stop", "length"); cancelled ones count as "abort".
        self.requests_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        #: Cached blocks evicted to make room.
        self.evicted_blocks = 0

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Pending requests: submitted, not admitted (vLLM ``num_requests_waiting``)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a running slot (vLLM ``num_requests_running``)."""
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for allocation, evictable cached ones included."""
        return self._free_anon + len(self._lru)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use by running requests, 0-1 (vLLM ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.params.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix cache (in use or evictable)."""
        return len(self._cache)

    def cached_prefix_tokens(self, prompt_tokens: list[str]) -> int:
        """Tokens of this prompt the prefix cache would serve if it were admitted now (full blocks; no side effects)."""
        n = len(prompt_tokens)
        hits = 0
        for h in _block_hashes(prompt_tokens[: max(n - 1, 0)], self.params.block_size):
            if h not in self._cache:
                break
            hits += 1
        return hits * self.params.block_size

    def has_request(self, request_id: str) -> bool:
        """Whether the request is waiting or running."""
        return request_id in self._waiting or request_id in self._running

    # ---- requests -------------------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_tokens: list[str], max_tokens: int | None, *, ignore_eos: bool,
               now: float) -> None:
        """Queue a request (``prompt_tokens``: words; ``max_tokens``: None = up to the model length) and try to admit.

        Raises ValueError for a duplicate id, an empty prompt or ``max_tokens`` < 1, and RequestTooLong when
        ``len(prompt_tokens) + max_tokens`` exceeds ``params.model_len``.
        """
        if self.has_request(request_id):
            raise ValueError(f"request {request_id!r} is already in the engine")
        prompt_len = len(prompt_tokens)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        model_len = self.params.model_len
        if max_tokens is None:
            max_tokens = model_len - prompt_len
            if max_tokens < 1:
                raise RequestTooLong(f"This model's maximum context length is {model_len} tokens. However, your "
                                     f"request has {prompt_len} input tokens. Please reduce the length of the input.")
        elif max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        elif prompt_len + max_tokens > model_len:
            raise RequestTooLong(f"This model's maximum context length is {model_len} tokens. However, you "
                                 f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                                 f"{max_tokens} in the completion). Please reduce the length of the messages or "
                                 f"completion.")
        seed = int.from_bytes(hashlib.blake2b("\x1f".join(prompt_tokens).encode(), digest_size=8).digest(), "big")
        if ignore_eos:
            output_len, reason = max_tokens, "length"
        else:
            output_len = 1 + seed % min(max_tokens, self.params.eos_max_tokens)
            reason = "length" if output_len == max_tokens else "stop"
        hashes = _block_hashes(prompt_tokens, self.params.block_size)
        self._waiting[request_id] = _Request(request_id, prompt_len, hashes, max_tokens, output_len, reason, seed,
                                             now)
        self._admit(now)

    def cancel(self, request_id: str, *, now: float) -> bool:
        """Drop a waiting or running request (a client went away), free its slot and blocks, admit others.

        Returns False when the request is unknown (already finished or cancelled). Tokens of a step in flight
        that belong to it are still in that step's outputs: the caller drops them.
        """
        req = self._waiting.pop(request_id, None)
        if req is None:
            req = self._running.pop(request_id, None)
            if req is None:
                return False
            self._release(req)
        self.requests_finished["abort"] += 1
        self._admit(now)
        return True

    # ---- iterations -----------------------------------------------------------------------------------------

    def start_step(self, now: float) -> Step | None:
        """Plan the next iteration at ``now`` (s); None when nothing is running. Call ``complete_step`` at its end."""
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight: call complete_step first")
        if not self._running:
            return None
        p = self.params
        decode = [r for r in self._running.values() if r.num_computed >= r.prompt_len]
        budget = p.max_num_batched_tokens - len(decode)  # >= 0: max_num_batched_tokens >= max_num_seqs
        chunks: list[tuple[_Request, int]] = []
        for r in self._running.values():
            if budget <= 0:
                break
            if r.num_computed < r.prompt_len:
                n = min(r.prompt_len - r.num_computed, budget)
                chunks.append((r, n))
                budget -= n
        prefill_tokens = sum(n for _, n in chunks)
        kv_tokens = sum(r.prompt_len + r.num_generated for r in decode)
        duration = p.step_seconds(prefill_tokens=prefill_tokens, decode_seqs=len(decode), decode_kv_tokens=kv_tokens)
        end = now + duration
        outputs: list[TokenOutput] = []
        done: list[_Request] = []
        for r in decode:
            outputs.append(self._emit(r, r.num_generated, end, done))
        for r, n in chunks:
            r.num_computed += n
            if r.num_computed == r.prompt_len:  # the last prompt chunk samples the first output token
                r.first_token_at = end
                self.prompt_tokens_total += r.prompt_len
                outputs.append(self._emit(r, 0, end, done))
        step = Step(start=now, duration=duration, prefill_tokens=prefill_tokens, decode_seqs=len(decode),
                    outputs=tuple(outputs))
        self._in_flight = (step, chunks, done)
        return step

    def complete_step(self, step: Step) -> None:
        """End the in-flight ``step``: cache its computed blocks, release finished requests, admit waiting ones."""
        if self._in_flight is None or self._in_flight[0] is not step:
            raise RuntimeError("complete_step needs the step returned by the last start_step")
        _, chunks, done = self._in_flight
        self._in_flight = None
        for r, _ in chunks:
            if self._running.get(r.request_id) is r:  # skip requests cancelled during the step
                self._register_blocks(r)
        for r in done:
            if self._running.get(r.request_id) is r:
                del self._running[r.request_id]
                self._release(r)
                self.requests_finished[r.finish_reason] += 1
        self._admit(step.end)

    def next_step(self, now: float) -> Step | None:
        """``start_step`` and ``complete_step`` at once (capacity frees at ``now``, not at the step's end)."""
        step = self.start_step(now)
        if step is not None:
            self.complete_step(step)
        return step

    # ---- internals ------------------------------------------------------------------------------------------

    def _emit(self, r: _Request, index: int, end: float, done: list[_Request]) -> TokenOutput:
        r.num_generated = index + 1
        self.generation_tokens_total += 1
        finished = None
        if r.num_generated >= r.output_len:
            done.append(r)
            finished = FinishedRequest(
                request_id=r.request_id, prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                completion_tokens=r.num_generated, finish_reason=r.finish_reason, submitted_at=r.submitted_at,
                admitted_at=r.admitted_at, first_token_at=r.first_token_at, finished_at=end)
        return TokenOutput(r.request_id, index, r.seed, finished)

    def _admit(self, now: float) -> None:
        """Admit waiting requests FCFS while the head fits (a slot and its blocks); never skip the head."""
        p = self.params
        while self._waiting and len(self._running) < p.max_num_seqs:
            req = next(iter(self._waiting.values()))
            hits = self._lookup(req)
            need = -(-(req.prompt_len + req.output_len) // p.block_size) - len(hits)
            hits_evictable = sum(1 for b in hits if b.ref == 0)  # hits leave the free list when touched
            if need > self.num_free_blocks - hits_evictable:
                return
            for b in hits:
                if b.ref == 0:
                    del self._lru[b.block_hash]
                b.ref += 1
            self._allocate(need)
            del self._waiting[req.request_id]
            req.blocks = hits
            req.anon_blocks = need
            req.num_hashed = len(hits)
            req.cached_tokens = req.num_computed = len(hits) * p.block_size
            req.admitted_at = now
            self.prefix_cache_queries += req.prompt_len
            self.prefix_cache_hits += req.cached_tokens
            self._running[req.request_id] = req

    def _lookup(self, req: _Request) -> list[_Block]:
        """Longest run of the request's leading full blocks in the cache, leaving at least one token to compute."""
        hits: list[_Block] = []
        for h in req.block_hashes[: (req.prompt_len - 1) // self.params.block_size]:
            b = self._cache.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _allocate(self, n: int) -> None:
        """Take ``n`` free blocks: never-cached ones first, then evict least recently used cached ones."""
        take = min(n, self._free_anon)
        self._free_anon -= take
        for _ in range(n - take):
            h, _ = self._lru.popitem(last=False)
            del self._cache[h]
            self.evicted_blocks += 1

    def _register_blocks(self, r: _Request) -> None:
        """Put the request's newly computed full prompt blocks into the prefix cache."""
        full = min(r.num_computed // self.params.block_size, len(r.block_hashes))
        for i in range(r.num_hashed, full):
            h = r.block_hashes[i]
            if h in self._cache:
                continue  # computed concurrently by another request: this copy stays private, as in vLLM
            b = _Block(h)
            self._cache[h] = b
            r.blocks.append(b)
            r.anon_blocks -= 1
        r.num_hashed = max(r.num_hashed, full)

    def _release(self, r: _Request) -> None:
        """Return the request's blocks: cached ones to the LRU tail (last block first), the rest to the free pool."""
        for b in reversed(r.blocks):
            b.ref -= 1
            if b.ref == 0:
                self._lru[b.block_hash] = b
        self._free_anon += r.anon_blocks
        r.blocks = []
        r.anon_blocks = 0
