"""A pure model of one vLLM V1 replica: continuous batching, paged KV blocks with preemption, a block-level prefix
cache and an iteration time model.

No asyncio, no sockets, no clock reads: every method that needs the time takes ``now`` (seconds, any epoch the
caller likes), so the live emulator (bench/emulator/server.py) and a trace-driven simulator (bench/sim/cluster.py)
drive this one class.

Tokens: ONE TOKEN = ONE WHITESPACE-SEPARATED WORD (``text.split()``), the convention shared with the workload
generator (bench/replay/workload.py). A chat prompt is, for each message in order, the word ``<role>:`` followed by the
content's words (:func:`chat_tokens`).

How a request moves, as vLLM V1's scheduler moves it (vllm-project/vllm ``vllm/v1/core/sched/scheduler.py``:
``Scheduler.schedule`` and ``_preempt_request``; ``vllm/v1/core/kv_cache_manager.py``: ``allocate_slots``,
``get_computed_blocks``, ``free``). There is no prefill or decode phase: a request has ``num_tokens`` (prompt plus
the tokens generated so far) and ``num_computed`` (tokens whose KV exists); each step gives it tokens to catch up.

1. ``submit`` puts it at the tail of the waiting queue. It stays *waiting* (``num_waiting``, vLLM
   ``vllm:num_requests_waiting``) until a step first schedules tokens for it, even when a slot and KV blocks are
   free: a request that arrives during a step waits for the next one, and one that finds the step's token budget
   used up waits longer.
2. Each step (``start_step`` .. ``complete_step``) has a budget of ``max_num_batched_tokens`` tokens. First the
   running requests, in the order they (re)entered the batch: each gets ``min(num_tokens - num_computed,
   budget left)`` tokens, i.e. one token when decoding, a chunk of its prompt when prefilling (chunked prefill).
   Then, only if nothing was preempted in this step, the waiting queue FCFS without skipping its head, while there
   is budget and a free slot (``max_num_seqs``): the head is admitted (moves to running) with its first chunk, or
   the admission loop stops. A step whose chunk completes a request's tokens samples its next output token (the
   last prompt chunk yields the first token, as in vLLM).
3. KV blocks are allocated as tokens are scheduled (a prompt chunk, then one decode token at a time crossing into
   a new block), never for output not yet generated. Admission additionally requires the request's whole known
   sequence (prompt, plus output for a preempted one) to fit the free blocks now, less its prefix-cache hits
   (vLLM ``--scheduler-reserve-full-isl``, default on since vllm-project/vllm#37307, opened 2026-03:
   ``allocate_slots(full_sequence_must_fit=True)``; ``scheduler_reserve_full_isl=False`` gives older releases,
   which checked only the first chunk). Free blocks include cached blocks no running request uses: those are
   evicted (LRU) before anything is preempted.
4. Preemption (vLLM V1 has recompute only): when a running request needs a block and none is free, the most
   recently admitted running request (the tail of the running list: FCFS policy's lowest priority) is preempted,
   repeatedly, until the block fits or the request itself was the one preempted. A preempted request frees all its
   blocks (its cached prompt blocks go to the LRU free list and may still hit on readmission), resets
   ``num_computed`` to 0 and goes back to the HEAD of the waiting queue; its output so far is kept and never sent
   again. Readmitted, it recomputes prompt plus generated tokens (less prefix hits) and then continues decoding.
   Preemptions are counted (``num_preemptions``, vLLM ``vllm:num_preemptions``) and no new request is admitted
   in a step that preempted.
5. A request finishes after ``output_len`` tokens: exactly ``max_tokens`` when ``ignore_eos`` (so a replay
   reproduces a trace's output lengths), else a deterministic length in ``[1, min(max_tokens, eos_max_tokens)]``
   derived from the prompt (a simulated EOS). Its slot and blocks are released when its last step completes.

How SGLang differs (sgl-project/sglang ``python/sglang/srt/managers/schedule_policy.py``: ``PrefillAdder``;
``schedule_batch.py``: ``ScheduleBatch.check_decode_mem`` and ``retract_decode``; ``scheduler.py``:
``update_running_batch``): admission reserves KV for the running requests' future output, ``min(max_new_tokens -
generated, clip) x new_token_ratio`` each (the ratio decays from about 0.7 towards 0.1 while decoding succeeds), so
running out of KV is rarer. When a decode step still lacks memory, SGLang *retracts* running requests, those with
the fewest output tokens first (ties: the longest input), frees their KV (the prefix stays in the radix cache),
puts them back in the waiting queue and raises ``new_token_ratio``. This model implements vLLM's mechanism only;
``bench.emulator.sglang_model`` implements SGLang's (``EngineParams(admission="sglang")`` and
:func:`make_engine` choose it).

Prefix cache (vLLM automatic prefix caching): a full block of ``block_size`` prompt tokens is identified by a hash
chain over (parent block hash, block tokens). Computed prompt blocks are registered in the cache when the step
that computed them completes. Blocks of finished or preempted requests stay cached in an LRU free list (a
request's blocks are freed tail first, so its last blocks are evicted first, as in vLLM) and are evicted only when
an allocation needs the space; free blocks that hold nothing cacheable are used before any cached one (vLLM uses
one free queue for both, so it may evict a little earlier). A request's cached prefix is the longest run of leading
full blocks found in the cache, capped so that at least its last known token is computed (vLLM recomputes it to get
logits). Generated tokens are not cached: a later turn's prompt re-renders the reply with a role marker, so its
blocks would not match anyway; a preempted request therefore recomputes its generated tokens in full (vLLM caches
them too, though under the memory pressure that caused the preemption they are the first evicted).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from bench.emulator import kv_hash
from skylb.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "ADMISSIONS",
    "EngineParams",
    "make_engine",
    "sglang_kv_cache_tokens",
    "EngineModel",
    "Step",
    "TokenOutput",
    "FinishedRequest",
    "RequestTooLong",
    "text_tokens",
    "output_length",
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


#: The schedulers :func:`make_engine` can build, chosen by ``EngineParams.admission``.
ADMISSIONS = ("vllm", "sglang")


def sglang_kv_cache_tokens(mem_fraction_static: float = 0.88, *, gpu_free_gib: float = 22.0,
                           weights_gib: float = 14.96, kv_bytes_per_token: int = 131072) -> int:
    """SGLang's ``max_total_num_tokens`` (KV tokens) for Llama-3.1-8B fp16 on one NVIDIA L4.

    SGLang v0.4.3 ``model_executor/model_runner.py`` ``ModelRunner.profile_max_num_token``: ``rest_memory =
    available_gpu_memory - total_gpu_memory x (1 - mem_fraction_static)`` (GiB; ``total_gpu_memory`` is the free
    memory measured before the weights load, ``available_gpu_memory`` after), tokens = ``rest_memory x 2**30 //
    cell_size``. Inputs (assumptions, not measurements): an L4 has 23034 MiB (22.49 GiB), about 22.0 GiB free
    after the CUDA context; the weights take 8.03e9 x 2 bytes = 14.96 GiB; ``cell_size`` = 2 (K, V) x 32 layers
    x 8 KV heads x 128 x 2 bytes = 131072 B. At 0.88: (22.0 - 14.96) - 22.0 x 0.12 = 4.40 GiB -> 36044 tokens.
    """
    rest_gib = (gpu_free_gib - weights_gib) - gpu_free_gib * (1.0 - mem_fraction_static)
    if rest_gib <= 0:
        raise ValueError(f"mem_fraction_static {mem_fraction_static} leaves no memory for the KV cache")
    return int(rest_gib * (1 << 30) // kv_bytes_per_token)


def output_length(seed: int, max_tokens: int, *, ignore_eos: bool, output_len: int | None,
                  eos_max_tokens: int) -> tuple[int, str]:
    """How many tokens a request generates and why it stops: ``(tokens, "length" | "stop")``.

    ``output_len`` given: exactly that (ValueError outside [1, max_tokens]); else ``max_tokens`` when
    ``ignore_eos``; else a simulated EOS after ``1 + seed % min(max_tokens, eos_max_tokens)`` tokens.
    """
    if output_len is not None:
        if not 1 <= output_len <= max_tokens:
            raise ValueError(f"output_len must be between 1 and max_tokens ({max_tokens}), got {output_len}")
    elif ignore_eos:
        output_len = max_tokens
    else:
        output_len = 1 + seed % min(max_tokens, eos_max_tokens)
    return output_len, "length" if output_len == max_tokens else "stop"


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
    * ``kv_cache_tokens`` = 32768 (2048 blocks of 16): vLLM may use 24 GB x 0.9 (``gpu_memory_utilization``)
      = 21.6 GB; less 16.06 GB of weights (8.03 B parameters x 2 bytes) and about 1.3 GB of activations (profiled
      at ``max_num_batched_tokens``), CUDA graphs and non-torch memory, 4.24 GB are left for KV. One token's KV is
      2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131072 B = 128 KiB, so 4.24e9 / 131072 = 32349
      tokens, rounded to 32768 (2048 blocks). The paper (§3.3) saw an L4 hold 20 to 50 outstanding requests: 32768
      tokens / 20..50 requests = 650..1600 tokens per request (prompt plus output), WildChat-like sizes.
    * ``max_num_seqs`` = 256 and ``max_num_batched_tokens`` = 2048: vLLM V1's defaults for the OpenAI server on a
      GPU with less than 70 GB; ``block_size`` = 16: vLLM's default.
    * ``max_model_len``: None means the whole KV cache (vLLM refuses to start with a longer one). Llama-3.1's
      native 131072 does not fit an L4; real L4 deployments pass a smaller ``--max-model-len``.
    * ``eos_max_tokens`` = 512: when ``ignore_eos`` is false the simulated EOS comes after
      ``1 + hash(prompt) % min(max_tokens, eos_max_tokens)`` tokens (chat replies are mostly a few hundred tokens).
    * ``time_scale``: multiplies every duration (0.01 = a hundred times faster than an L4, for tests and demos).
    * ``scheduler_reserve_full_isl`` = True: admit a waiting request only if its whole known sequence fits the free
      KV blocks (vLLM's default since vllm-project/vllm#37307); False checks only its first chunk (older vLLM).

    Step time (ms) = ``decode_base_ms`` + ``decode_ms_per_seq`` x decoding sequences + ``decode_ms_per_kv_token``
    x their context tokens + ``prefill_ms_per_token`` x tokens computed in chunks in the step (uncached
    prompt tokens, and recomputed ones after a preemption); then x ``time_scale``.

    SGLang admission (``admission="sglang"``; :func:`make_engine` then builds
    ``bench.emulator.sglang_model.SglangEngineModel``, whose docstring cites the source of each rule; the values
    are sgl-project/sglang v0.4.3's defaults for one GPU under 25 GB):

    * ``kv_cache_tokens`` None (the default) derives the capacity for the admission: 32768 for vLLM (above), and
      for SGLang :func:`sglang_kv_cache_tokens` of ``mem_fraction_static`` (0.88: ``server_args.py``, one GPU):
      36044 tokens. Pass a number to override either; ``dataclasses.replace`` keeps a derived value, so pass
      ``kv_cache_tokens=None`` there when switching admission.
    * ``schedule_policy`` "lpm" (v0.4.3's default; v0.4.6 changed it to "fcfs"), ``lpm_fcfs_threshold`` 128
      (``SchedulePolicy._determine_active_policy``), ``max_prefill_tokens`` 16384, ``chunked_prefill_size`` 2048
      (GPU memory < 25 GB), ``max_running_requests`` None = SGLang's derivation (``min(max_total_num_tokens // 2,
      req_to_token_pool size)``, 2049 here), ``clip_max_new_tokens`` 4096 (``CLIP_MAX_NEW_TOKENS_ESTIMATION``).
    * ``global_config.py``: ``init_new_token_ratio`` 0.7, ``min_new_token_ratio_factor`` 0.14 (floor 0.098),
      ``new_token_ratio_decay_steps`` 600, ``retract_decode_steps`` 20.
    The vLLM-only knobs (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``scheduler_reserve_full_isl``) do not affect the SGLang model, and the SGLang ones do not affect vLLM's.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    prefill_ms_per_token: float = 0.48
    decode_base_ms: float = 53.5
    decode_ms_per_seq: float = 0.25
    decode_ms_per_kv_token: float = 0.000437
    eos_max_tokens: int = 512
    time_scale: float = 1.0
    scheduler_reserve_full_isl: bool = True
    admission: str = "vllm"
    schedule_policy: str = "lpm"
    lpm_fcfs_threshold: int = 128
    mem_fraction_static: float = 0.88
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 2048
    max_running_requests: int | None = None
    clip_max_new_tokens: int = 4096
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.kv_cache_tokens is None:  # derived once here; the dataclass is frozen otherwise
            derived = sglang_kv_cache_tokens(self.mem_fraction_static) if self.admission == "sglang" else 32768
            object.__setattr__(self, "kv_cache_tokens", derived)
        self._check_sglang()
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

    def _check_sglang(self) -> None:
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        for name in ("max_prefill_tokens", "chunked_prefill_size", "clip_max_new_tokens",
                     "new_token_ratio_decay_steps", "retract_decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be at least 1, got {self.max_running_requests}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0 < self.init_new_token_ratio <= 1 or not 0 <= self.min_new_token_ratio_factor <= 1:
            raise ValueError("init_new_token_ratio must be in (0, 1] and min_new_token_ratio_factor in [0, 1]")

    @property
    def num_blocks(self) -> int:
        """KV cache size in blocks (``kv_cache_tokens // block_size``)."""
        return self.kv_cache_tokens // self.block_size

    @property
    def model_len(self) -> int:
        """The longest prompt + output a request may ask for (tokens)."""
        if self.max_model_len is not None:
            return self.max_model_len
        if self.admission == "sglang":
            return self.kv_cache_tokens - 1  # SGLang's max_req_len: max_total_num_tokens - 1
        return self.num_blocks * self.block_size

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
    #: When a step first scheduled tokens for it (start of that step): it left the waiting queue.
    admitted_at: float
    first_token_at: float
    finished_at: float
    #: How many times KV exhaustion preempted it (each time it was recomputed).
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float:
        """Time spent waiting before its first scheduled step (s); time waiting again after a preemption excluded."""
        return self.admitted_at - self.submitted_at

    @property
    def ttft_s(self) -> float:
        """Time to first token, from submission (s)."""
        return self.first_token_at - self.submitted_at

    @property
    def e2e_s(self) -> float:
        """Submission to last token (s)."""
        return self.finished_at - self.submitted_at


class TokenOutput(NamedTuple):
    """One token one request produced in a step; ``finished`` is set on its last token.

    A named tuple (immutable, fields by name) rather than a frozen dataclass: one is made per generated token,
    and a frozen dataclass's ``__init__`` costs three times as much.
    """

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
    """One iteration of the engine: it runs from ``start`` to ``end`` (s) and produces ``outputs`` at ``end``.

    ``prefill_tokens`` counts every token computed in a chunk (prompt chunks, and a preempted request's
    recomputation of its prompt and generated tokens).
    """

    start: float
    duration: float
    #: Tokens computed in chunks in this step (uncached prompt tokens, recomputed ones after a preemption).
    prefill_tokens: int
    #: Requests that decoded one token in this step.
    decode_seqs: int
    outputs: tuple[TokenOutput, ...]
    #: Requests preempted when this step was planned (back in the waiting queue, to be recomputed).
    preempted: tuple[str, ...] = ()

    @property
    def end(self) -> float:
        """When the step's tokens exist (s)."""
        return self.start + self.duration

    @property
    def finished(self) -> tuple[FinishedRequest, ...]:
        """Requests whose last token is in this step."""
        return tuple(o.finished for o in self.outputs if o.finished is not None)


_new_tuple = tuple.__new__


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
                 "num_hashed", "blocks", "anon_blocks", "kv_slots", "num_preemptions", "token_ids")

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
        self.admitted_at: float | None = None  # first scheduled
        self.first_token_at = now
        self.cached_tokens = 0  # prefix-cache hit at first admission (what usage reports)
        self.num_computed = 0  # tokens (prompt, then generated) whose KV exists, cached ones included
        self.num_generated = 0  # output tokens sampled; num_tokens = prompt_len + num_generated
        self.num_hashed = 0  # leading full prompt blocks already hit or registered
        self.blocks: list[_Block] = []  # cached blocks this request holds a reference on, in prompt order
        self.anon_blocks = 0  # held blocks not (yet) in the prefix cache
        self.kv_slots = 0  # tokens the held blocks can store: (len(blocks) + anon_blocks) x block_size
        self.num_preemptions = 0
        self.token_ids: list[int] | None = None  # the prompt's token ids, kept only to publish KV-cache events


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
    ``complete_step(step)`` at ``step.end`` (or ``next_step(now)`` for both at once). ``start_step`` is where the
    scheduler runs (admission, block allocation, preemption); between the two calls the step is in flight: its
    requests keep their slots and blocks until ``complete_step``, so probes taken during a step see the batch as it
    really is, and requests submitted meanwhile wait for the next step.
    """

    def __init__(self, params: EngineParams | None = None):
        self.params = params or EngineParams()
        # FCFS; a preempted request goes back to the head (move_to_end(last=False)); O(1) removal on cancel.
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._running: dict[str, _Request] = {}  # in the order they (re)entered the batch; the tail is preempted
        self._cache: dict[bytes, _Block] = {}  # every cached block, in use or not
        self._lru: OrderedDict[bytes, _Block] = OrderedDict()  # cached blocks with ref 0, oldest first
        self._free_anon = self.params.num_blocks  # free blocks holding nothing worth caching
        self._in_flight: tuple[Step, list[_Request], list[_Request]] | None = None  # step, chunked, done
        #: Prompt tokens looked up in the prefix cache at first admission (vLLM ``prefix_cache_queries``; like
        #: vLLM, lookups of preempted requests are not counted).
        self.prefix_cache_queries = 0
        #: Prompt tokens found in the prefix cache at first admission (vLLM ``prefix_cache_hits``).
        self.prefix_cache_hits = 0
        #: Prompt tokens of requests that produced their first token (vLLM ``prompt_tokens``).
        self.prompt_tokens_total = 0
        #: Output tokens produced (vLLM ``generation_tokens``).
        self.generation_tokens_total = 0
        #: Finished requests by finish reason ("stop", "length"); cancelled ones count as "abort".
        self.requests_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        #: Cached blocks evicted to make room.
        self.evicted_blocks = 0
        #: Running requests preempted because KV blocks ran out (vLLM ``num_preemptions``).
        self.num_preemptions = 0
        #: KV-cache events since the last ``take_kv_events`` (None: not recorded; see ``enable_kv_events``).
        self.kv_events: list[KVEvent] | None = None

    def enable_kv_events(self) -> None:
        """Record KV-cache events as vLLM's block pool does (``BlockStored`` when computed prompt blocks enter the
        prefix cache, ``BlockRemoved`` when one is evicted), with block hashes as vLLM computes them
        (bench/emulator/kv_hash.py: SHA-256 chains over token ids) instead of the default cheaper hash. Call it
        before the first request. Events are skylb.core.kv_events' (bench/emulator/kv_publisher.py encodes them)."""
        if self._cache or self._waiting or self._running:
            raise RuntimeError("enable KV-cache events before the first request")
        self.kv_events = []

    def take_kv_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (vLLM ``BlockPool.take_events``)."""
        events, self.kv_events = self.kv_events, ([] if self.kv_events is not None else None)
        return events or []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM ``BlockPool.reset_prefix_cache``, ``POST /reset_prefix_cache``); as vLLM,
        refused (False) while a running request holds blocks. Records ``AllBlocksCleared`` when events are on."""
        if self._running or self._in_flight is not None:
            return False
        self._free_anon += len(self._lru)
        self._lru.clear()
        self._cache.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def _hash_prompt(self, prompt_tokens: list[str]) -> tuple[list[bytes], list[int] | None]:
        """The prompt's full-block hash chain, and its token ids when events are recorded."""
        if self.kv_events is None:
            return _block_hashes(prompt_tokens, self.params.block_size), None
        ids = kv_hash.token_ids(prompt_tokens)
        return kv_hash.block_hashes(ids, self.params.block_size), ids

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests not in the running batch: never scheduled yet, or preempted (vLLM ``num_requests_waiting``)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch, prefilling or decoding (vLLM ``num_requests_running``)."""
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
        for h in self._hash_prompt(prompt_tokens[: max(n - 1, 0)])[0]:
            if h not in self._cache:
                break
            hits += 1
        return hits * self.params.block_size

    def has_request(self, request_id: str) -> bool:
        """Whether the request is waiting or running."""
        return request_id in self._waiting or request_id in self._running

    # ---- requests -------------------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_tokens: list[str], max_tokens: int | None, *, ignore_eos: bool,
               now: float, output_len: int | None = None) -> None:
        """Queue a request (``prompt_tokens``: words; ``max_tokens``: None = up to the model length); it waits for
        the next ``start_step``.

        ``output_len``: when given, the request generates exactly that many tokens (a simulated EOS there, finish
        reason "stop" when it is below ``max_tokens``): a trace's or a workload's reply length under a larger
        client ``max_tokens``; it overrides ``ignore_eos``.

        Raises ValueError for a duplicate id, an empty prompt, ``max_tokens`` < 1 or ``output_len`` outside
        [1, max_tokens], and RequestTooLong when ``len(prompt_tokens) + max_tokens`` exceeds ``params.model_len``
        (it could never fit the KV cache).
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
        output_len, reason = output_length(seed, max_tokens, ignore_eos=ignore_eos, output_len=output_len,
                                           eos_max_tokens=self.params.eos_max_tokens)
        hashes, ids = self._hash_prompt(prompt_tokens)
        req = self._waiting[request_id] = _Request(request_id, prompt_len, hashes, max_tokens, output_len, reason,
                                                   seed, now)
        req.token_ids = ids

    def cancel(self, request_id: str, *, now: float) -> bool:
        """Drop a waiting or running request (a client went away) and free its slot and blocks.

        Returns False when the request is unknown (already finished or cancelled). Tokens of a step in flight
        that belong to it are still in that step's outputs: the caller drops them. Others take the freed room at
        the next ``start_step``.
        """
        req = self._waiting.pop(request_id, None)
        if req is None:
            req = self._running.pop(request_id, None)
            if req is None:
                return False
            self._release(req)
        self.requests_finished["abort"] += 1
        return True

    # ---- iterations -----------------------------------------------------------------------------------------

    def start_step(self, now: float) -> Step | None:
        """Schedule and plan the next iteration at ``now`` (s); None when no request is waiting or running.

        Call ``complete_step`` at the step's end. Scheduling follows vLLM V1's ``Scheduler.schedule`` (module
        docstring): running requests first (allocating their blocks, preempting the newest when blocks run out),
        then waiting ones FCFS within the token budget, slots and KV blocks.
        """
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight: call complete_step first")
        if not self._running and not self._waiting:
            return None
        p = self.params
        bs = p.block_size
        budget = p.max_num_batched_tokens
        # One pass per running request (the simulator runs millions of steps): schedule, allocate, classify,
        # advance num_computed, and note who samples a token (``sampling``) or computed a chunk (``chunked``).
        sampling: list[_Request] = []
        chunked: list[_Request] = []
        prefill_tokens = decode_seqs = kv_tokens = 0
        preempted: list[str] = []
        free = self._free_anon + len(self._lru)
        running = list(self._running.values())
        for r in running:  # popping preempted ones off the tail while iterating is safe: the index is checked
            if budget <= 0:
                break
            computed = r.num_computed
            num_tokens = r.prompt_len + r.num_generated
            n = num_tokens - computed
            if n == 1 and computed >= r.prompt_len:  # decoding: the common case, kept short
                if computed >= r.kv_slots:  # its last block is full
                    if free == 0:
                        free = self._make_room(1, r, running, preempted)
                        if free < 0:
                            break  # it was preempted itself; it waits at the head of the queue
                    self._allocate(1)
                    free -= 1
                    r.anon_blocks += 1
                    r.kv_slots += bs
                r.num_computed = num_tokens
                budget -= 1
                decode_seqs += 1
                kv_tokens += num_tokens
                sampling.append(r)
                continue
            if n > budget:
                n = budget
            if computed + n > r.kv_slots:  # crosses into blocks it does not hold yet
                need = -(-(computed + n) // bs) - r.kv_slots // bs
                if need > free:
                    free = self._make_room(need, r, running, preempted)
                    if free < 0:
                        break
                self._allocate(need)
                free -= need
                r.anon_blocks += need
                r.kv_slots += need * bs
            r.num_computed = computed + n
            budget -= n
            prefill_tokens += n
            chunked.append(r)
            if computed + n == num_tokens:
                sampling.append(r)
        if not preempted and self._waiting:
            prefill_tokens += self._schedule_waiting(now, budget, chunked, sampling)
        if not sampling and not chunked:
            # Unreachable: model_len <= KV capacity lets the oldest running request (or, with none, the waiting
            # head) always fit. Fail loudly rather than hang a driver that would wait for a step forever.
            raise RuntimeError("internal error: a step scheduled nothing although requests are queued")
        duration = p.step_seconds(prefill_tokens=prefill_tokens, decode_seqs=decode_seqs, decode_kv_tokens=kv_tokens)
        end = now + duration
        done: list[_Request] = []
        outputs = tuple([self._emit(r, end, done) for r in sampling])
        step = Step(start=now, duration=duration, prefill_tokens=prefill_tokens, decode_seqs=decode_seqs,
                    outputs=outputs, preempted=tuple(preempted))
        self._in_flight = (step, chunked, done)
        return step

    def complete_step(self, step: Step) -> None:
        """End the in-flight ``step``: cache its computed prompt blocks and release finished requests."""
        if self._in_flight is None or self._in_flight[0] is not step:
            raise RuntimeError("complete_step needs the step returned by the last start_step")
        _, chunked, done = self._in_flight
        self._in_flight = None
        running = self._running
        for r in chunked:
            if r.num_hashed < len(r.block_hashes) and running.get(r.request_id) is r:  # skip cancelled ones
                self._register_blocks(r)
        for r in done:
            if running.get(r.request_id) is r:
                del running[r.request_id]
                self._release(r)
                self.requests_finished[r.finish_reason] += 1

    def next_step(self, now: float) -> Step | None:
        """``start_step`` and ``complete_step`` at once (capacity frees at ``now``, not at the step's end)."""
        step = self.start_step(now)
        if step is not None:
            self.complete_step(step)
        return step

    # ---- internals ------------------------------------------------------------------------------------------

    def _schedule_waiting(self, now: float, budget: int, chunked: list[_Request], sampling: list[_Request]) -> int:
        """Admit waiting requests FCFS with their first chunk while budget, a slot and KV blocks allow; never skip
        the head (vLLM's waiting loop: ``get_computed_blocks`` then ``allocate_slots``, ``break`` on None).

        Appends the admitted to ``chunked`` (and to ``sampling`` when the chunk completes their known tokens) and
        returns the tokens scheduled.
        """
        tokens = 0
        p = self.params
        bs = p.block_size
        waiting, running = self._waiting, self._running
        while waiting and budget > 0 and len(running) < p.max_num_seqs:
            req = next(iter(waiting.values()))
            num_tokens = req.prompt_len + req.num_generated
            hits = self._lookup(req, num_tokens)
            computed = len(hits) * bs
            n = min(num_tokens - computed, budget)
            # Cached hits no one uses leave the free list when touched, so they count against the free blocks.
            free = self._free_anon + len(self._lru) - sum(1 for b in hits if b.ref == 0)
            need = -(-(computed + n) // bs) - len(hits)
            gate = -(-num_tokens // bs) - len(hits) if p.scheduler_reserve_full_isl else need
            if gate > free:
                break
            del waiting[req.request_id]
            for b in hits:
                if b.ref == 0:
                    del self._lru[b.block_hash]
                b.ref += 1
            self._allocate(need)
            req.blocks = hits
            req.anon_blocks = need
            req.kv_slots = (len(hits) + need) * bs
            req.num_hashed = len(hits)
            req.num_computed = computed + n
            if req.admitted_at is None:  # first admission (a preempted request keeps its first times and stats)
                req.admitted_at = now
                req.cached_tokens = computed
                self.prefix_cache_queries += req.prompt_len
                self.prefix_cache_hits += computed
            running[req.request_id] = req
            chunked.append(req)
            if computed + n == num_tokens:
                sampling.append(req)
            budget -= n
            tokens += n
        return tokens

    def _make_room(self, need: int, r: _Request, running: list[_Request], preempted: list[str]) -> int:
        """Preempt from the tail of ``running`` until ``need`` blocks are free or ``r`` itself was preempted.

        Returns the free blocks after that, or -1 when ``r`` was preempted (vLLM ``schedule``'s inner loop).
        """
        while True:
            victim = running.pop()  # the newest: FCFS policy's lowest priority
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is r:
                return -1
            free = self._free_anon + len(self._lru)
            if free >= need:
                return free

    def _emit(self, r: _Request, end: float, done: list[_Request]) -> TokenOutput:
        """Sample ``r``'s next output token at ``end``; mark it done when that is its last."""
        index = r.num_generated
        r.num_generated = index + 1
        self.generation_tokens_total += 1
        if index == 0:
            r.first_token_at = end
            self.prompt_tokens_total += r.prompt_len
        finished = None
        if r.num_generated >= r.output_len:
            done.append(r)
            finished = FinishedRequest(
                request_id=r.request_id, prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                completion_tokens=r.num_generated, finish_reason=r.finish_reason, submitted_at=r.submitted_at,
                admitted_at=r.admitted_at, first_token_at=r.first_token_at, finished_at=end,
                num_preemptions=r.num_preemptions)
        return _new_tuple(TokenOutput, (r.request_id, index, r.seed, finished))  # TokenOutput(...) minus a call

    def _preempt(self, r: _Request) -> None:
        """vLLM ``_preempt_request`` (recompute): free its blocks, forget its computed tokens, queue it at the head."""
        del self._running[r.request_id]
        self._release(r)
        r.num_computed = 0
        r.num_hashed = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting[r.request_id] = r
        self._waiting.move_to_end(r.request_id, last=False)

    def _lookup(self, req: _Request, num_tokens: int) -> list[_Block]:
        """Longest run of the request's leading full blocks in the cache, leaving at least one token to compute."""
        hits: list[_Block] = []
        for h in req.block_hashes[: (num_tokens - 1) // self.params.block_size]:
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
            if self.kv_events is not None:
                self.kv_events.append(BlockRemoved([kv_hash.external(h)]))

    def _register_blocks(self, r: _Request) -> None:
        """Put the request's newly computed full prompt blocks into the prefix cache."""
        full = min(r.num_computed // self.params.block_size, len(r.block_hashes))
        stored: list[int] = []
        for i in range(r.num_hashed, full):
            h = r.block_hashes[i]
            if h in self._cache:
                continue  # computed concurrently by another request: this copy stays private, as in vLLM
            b = _Block(h)
            self._cache[h] = b
            r.blocks.append(b)
            r.anon_blocks -= 1
            stored.append(i)
        if stored and self.kv_events is not None:
            self._record_stored(r, stored)
        r.num_hashed = max(r.num_hashed, full)

    def _record_stored(self, r: _Request, stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks (vLLM ``cache_full_blocks``)."""
        bs = self.params.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first = run[0]
            parent = kv_hash.external(r.block_hashes[first - 1]) if first else None
            self.kv_events.append(BlockStored([kv_hash.external(r.block_hashes[i]) for i in run], parent,
                                              r.token_ids[first * bs:(run[-1] + 1) * bs], bs))

    def _release(self, r: _Request) -> None:
        """Return the request's blocks: cached ones to the LRU tail (last block first), the rest to the free pool."""
        for b in reversed(r.blocks):
            b.ref -= 1
            if b.ref == 0:
                self._lru[b.block_hash] = b
        self._free_anon += r.anon_blocks
        r.blocks = []
        r.anon_blocks = 0
        r.kv_slots = 0


def make_engine(params: EngineParams | None = None):
    """The engine model ``params.admission`` names: :class:`EngineModel` (vLLM V1) or
    ``bench.emulator.sglang_model.SglangEngineModel`` (SGLang); both have the same interface."""
    params = params or EngineParams()
    if params.admission == "sglang":
        from bench.emulator.sglang_model import SglangEngineModel  # imported here: it imports this module

        return SglangEngineModel(params)
    return EngineModel(params)
