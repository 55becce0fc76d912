"""Calibrate the engine model (bench/emulator/model.py): step times against the SkyLB paper's L4 figure, and
queueing against a real llama-server replica on this machine, the same requests on both.

`skylb bench calibrate` (or `python -m bench.live.calibrate`) does three things and writes bench/results/calibration.md:

1. **Paper check.** ``EngineParams()`` (Llama-3.1-8B on one L4) replays one 512-token prompt through
   ``EngineModel``; its TTFT is printed beside the paper's "around 300 ms of prefill latency" (SkyLB paper §2.1,
   "Latency metric", shared/seeds/004_be5532ea67aa0912.txt), with the decode step time at a few batch sizes.
2. **Fit.** A real ``llama-server`` (gemma-3-270m Q4_K_M on the CPU, ``-np`` slots, ``-c`` context) is measured on
   an idle server: TTFT of single requests of several prompt lengths gives the prefill time per token (the slope of
   a least-squares line), and the inter-token gaps of 1..slots concurrent streams (plus one long-context stream)
   give the decode step time (``decode_base_ms + decode_ms_per_seq x seqs + decode_ms_per_kv_token x context
   tokens``). Together with the server's shape (slots, context, ``-b`` batch) that is a fitted ``EngineParams``.
3. **Queueing side by side.** Scenarios (a burst of mixed requests sent at once, then a staggered load) are sent
   to the real llama-server and replayed through ``EngineModel`` with the fitted parameters (a discrete-event
   replay on bench/sim/engine.py's EventLoop, submitting each request at the time it was really sent, with its
   real token count). Pending (``llamacpp:requests_deferred``) and running (``llamacpp:requests_processing``) are
   sampled every 100 ms on both, and every request's TTFT is kept. Repeated ``--repeats`` times (default 3) with
   the machine's load recorded (bench/replay/sampling.py), since the machine has 2 cores shared with other people.

Tokens: the model counts whitespace words, llama-server counts real tokens. Prompts are built from words that each
are one gemma token (checked through llama-server's ``/tokenize`` before any measurement), so a prompt of
``n - 1`` words is ``n`` tokens with the BOS token; the replay uses the ``usage.prompt_tokens`` each response
reports. Every request sets ``cache_prompt: false`` and the model replay gives each request unique words, so
neither side reuses a cached prefix (the report shows the cached token count llama-server reported).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlsplit

from bench.replay.report import emit_markdown, markdown_table, percentile
from bench.replay.sampling import BUSY_FRACTION, MachineLoad, conditions_lines, process_cpu_s
from bench.sim.engine import EventLoop
from bench.emulator.model import EngineModel, EngineParams, make_engine

__all__ = [
    "PAPER_PREFILL_512_MS",
    "WORDS",
    "CalRequest",
    "Scenario",
    "FitPlan",
    "SideRun",
    "PrefillPoint",
    "DecodePoint",
    "PrefillFit",
    "DecodeFit",
    "prompt_words",
    "default_scenarios",
    "fit_probes",
    "chunk_probe",
    "stalls",
    "replay_model",
    "run_real",
    "prefill_points",
    "decode_points",
    "fit_prefill",
    "fit_decode",
    "fitted_params",
    "as_slots",
    "compare",
    "paper_check",
    "llama_server",
    "calibrate",
    "format_markdown",
    "build_parser",
    "main",
]

#: The SkyLB paper's figure (§2.1, "Latency metric"): a 512-token prompt of meta-llama/Llama-3.1-8B-Instruct on one
#: L4 "might incur around 300 ms of prefill latency before generating the first token" (ms).
PAPER_PREFILL_512_MS = 300.0
#: llama-server's logical batch (``-b``, tokens per llama_decode call; its default): prompt tokens of every slot
#: are added to one batch after the generating slots' tokens until it holds this many (the model's
#: ``max_num_batched_tokens``). ``-ub`` (512, default) only splits that batch into physical passes.
N_BATCH = 2048
N_UBATCH = 512
#: Words that are each exactly one gemma-3 token when preceded by a space (checked against /tokenize at run time).
WORDS = tuple(
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education".split())
#: Hard bounds on any request loop here.
MAX_REQUESTS = 64
REQUEST_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 0.1


# ------------------------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class CalRequest:
    """One request of a calibration run.

    Attributes:
        id: unique within its run. at_s: when to send it, s after the run's start.
        prompt_tokens: its length in real tokens, BOS included (the text has ``prompt_tokens - 1`` words).
        output_tokens: tokens to generate (``max_tokens`` with ``ignore_eos``: exactly this many).
        seed: picks the prompt's words (:func:`prompt_words`).
    """

    id: str
    at_s: float
    prompt_tokens: int
    output_tokens: int
    seed: int = 0

    @property
    def text(self) -> str:
        """The prompt: ``prompt_tokens - 1`` words of :data:`WORDS` (one token each; llama-server adds BOS)."""
        return " ".join(prompt_words(self.prompt_tokens - 1, self.seed))


def prompt_words(n: int, seed: int) -> list[str]:
    """``n`` words drawn from :data:`WORDS` by a ``random.Random(seed)`` (deterministic)."""
    rng = random.Random(seed)
    return [rng.choice(WORDS) for _ in range(n)]


@dataclass(frozen=True)
class Scenario:
    """A named list of requests sent to both sides (``requests`` in send order)."""

    name: str
    title: str
    requests: tuple[CalRequest, ...]


def default_scenarios(slot_ctx: int) -> list[Scenario]:
    """The side-by-side scenarios, sized for gemma-3-270m on one CPU thread (about 4.4 ms per prompt token).

    burst: 12 requests of mixed prompt (64-512 tokens) and output (16-96 tokens) lengths sent at once, 25 ms
    apart so that their order at the server is defined (not a race between client threads): with 4 slots, 8 are
    pending at first and the queue drains as slots free. staggered: 14 requests, one every 1.0 s on
    average (seeded exponential gaps), prompts 48-320 and outputs 16-64 tokens: near the server's capacity (about
    1.3 s of server time each), so short queues form and drain. Every prompt plus its output fits in one slot's
    context (``slot_ctx`` tokens).
    """
    burst_p = (96, 384, 192, 512, 64, 320, 256, 128, 448, 160, 288, 224)
    burst_o = (48, 16, 96, 24, 64, 32, 80, 40, 16, 72, 24, 56)
    burst = tuple(CalRequest(f"burst-{i:02d}", round(0.025 * i, 3), p, o, seed=1000 + i)
                  for i, (p, o) in enumerate(zip(burst_p, burst_o)))
    rng = random.Random(7)
    t, staggered = 0.0, []
    for i in range(14):
        staggered.append(CalRequest(f"stag-{i:02d}", round(t, 3), rng.choice((48, 96, 128, 192, 256, 320)),
                                    rng.choice((16, 32, 48, 64)), seed=2000 + i))
        t += rng.expovariate(1 / 1.0)
    scenarios = [Scenario("burst", "12 mixed requests sent at once (25 ms apart)", burst),
                 Scenario("staggered", "14 mixed requests, exponential gaps of 1.0 s on average",
                          tuple(staggered))]
    for sc in scenarios:
        for r in sc.requests:
            if r.prompt_tokens + r.output_tokens > slot_ctx:
                raise ValueError(f"{r.id}: {r.prompt_tokens} + {r.output_tokens} tokens exceed a slot's context "
                                 f"({slot_ctx})")
    return scenarios


@dataclass(frozen=True)
class FitPlan:
    """What the fit measures on an idle server.

    prefill_lengths: prompt lengths (tokens, BOS included) of the single-request TTFT probes, each sent
    ``prefill_passes`` times, one at a time. decode_batches: numbers of concurrent streams (each
    ``decode_prompt`` prompt tokens, ``decode_output`` output tokens) whose inter-token gaps give the decode step;
    ``long_prompt``: one more single stream with that long a prompt, for the per-context-token term (0: none);
    every decode probe is run ``decode_passes`` times. All points of all passes enter the least-squares fits, so
    a pass slowed by other processes pulls the fit only as much as its share. ``chunk_prompt``: a prompt of that
    many tokens sent 1 s into a ``chunk_stream_output``-token stream, to see how the server splits a long prefill
    around a decoding stream (:func:`chunk_probe`; 0: not measured).
    """

    prefill_lengths: tuple[int, ...] = (32, 128, 384, 768)
    prefill_passes: int = 3
    decode_batches: tuple[int, ...] = (1, 2, 3, 4)
    decode_prompt: int = 32
    decode_output: int = 32
    long_prompt: int = 768
    decode_passes: int = 2
    chunk_prompt: int = 768
    chunk_stream_output: int = 200


def chunk_probe(plan: FitPlan) -> list[CalRequest]:
    """One short-prompt stream of ``chunk_stream_output`` tokens, and 1 s later one ``chunk_prompt``-token prompt
    (2 output tokens); empty when ``chunk_prompt`` is 0. :func:`stalls` of the stream show how the prefill was cut."""
    if not plan.chunk_prompt:
        return []
    return [CalRequest("chunk-stream", 0.0, plan.decode_prompt, plan.chunk_stream_output, seed=30_000),
            CalRequest("chunk-prompt", 1.0, plan.chunk_prompt, 2, seed=30_001)]


def stalls(run: "SideRun", request_id: str, *, factor: float = 5.0) -> list[float]:
    """The inter-token gaps (ms) of one stream longer than ``factor`` x its median gap: the steps in which the
    engine worked on another request's prompt instead of giving this stream its next token (needs token times)."""
    times = run.token_times.get(request_id) or []
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return []
    typical = median(gaps)
    return [1000 * g for g in gaps if g > factor * typical]


def fit_probes(plan: FitPlan) -> tuple[list[list[CalRequest]], list[list[CalRequest]]]:
    """The fit's probes: (prefill probes, decode probes); each probe is a list of requests sent at once."""
    prefill = [[CalRequest(f"prefill-{k}-{n}", 0.0, n, 2, seed=10_000 + 100 * k + i)]
               for k in range(plan.prefill_passes) for i, n in enumerate(plan.prefill_lengths)]
    decode = []
    for k in range(plan.decode_passes):
        decode += [[CalRequest(f"decode-{k}-b{b}-{j}", 0.0, plan.decode_prompt, plan.decode_output,
                               seed=20_000 + 1000 * k + 10 * b + j) for j in range(b)] for b in plan.decode_batches]
        if plan.long_prompt:
            decode.append([CalRequest(f"decode-{k}-long", 0.0, plan.long_prompt, plan.decode_output,
                                      seed=29_000 + k)])
    return prefill, decode


# ---------------------------------------------------------------------------------------------------- one side


@dataclass
class SideRun:
    """What one side (the real llama-server, or the model) did with one list of requests. Times in s from the
    run's start.

    sent_s, ttft_s, e2e_s: per request id (a failed request has no ttft/e2e). prompt_tokens: the real length
    (``usage.prompt_tokens``; the model: what it was given). cached_tokens: ``usage.prompt_tokens_details.
    cached_tokens`` summed (0 for the model). token_times: per request, the arrival time of every token (s from
    the run's start; kept only when asked). samples: ``(t, pending, running)`` every ~100 ms. errors: per request
    id, why it failed. server_prompt_ms: llama-server's own ``timings.prompt_ms`` per request. server_run_s,
    server_wait_s: during the run, the time llama-server's compute thread ran on a core and the time it was
    runnable but waited for one (/proc/PID/schedstat; None when not measured).
    """

    sent_s: dict[str, float] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0
    token_times: dict[str, list[float]] = field(default_factory=dict)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    server_prompt_ms: dict[str, float] = field(default_factory=dict)
    server_run_s: float | None = None
    server_wait_s: float | None = None

    @property
    def slowdown(self) -> float:
        """How much longer llama-server's work took than on a core of its own: (ran + waited for a core) / ran,
        over the run (1.0 when not measured). Its compute thread is single-threaded, so every step stretches by this
        factor on average when other processes compete for the cores."""
        if not self.server_run_s or self.server_wait_s is None:
            return 1.0
        return (self.server_run_s + self.server_wait_s) / self.server_run_s

    @property
    def makespan_s(self) -> float:
        """When the last request finished (s from the start; 0.0 when none did)."""
        return max((self.sent_s[i] + e for i, e in self.e2e_s.items()), default=0.0)


def replay_model(requests: Sequence[CalRequest], params: EngineParams, *, sample_every_s: float | None = SAMPLE_EVERY_S,
                 keep_tokens: bool = False, max_sim_s: float = 3600.0) -> SideRun:
    """Replay ``requests`` through one ``make_engine(params)`` in simulated time (no sockets, no clock).

    Each request is submitted at ``at_s`` with ``prompt_tokens`` unique words (no prefix-cache hits) and exactly
    ``output_tokens`` outputs (``ignore_eos``); the engine steps back to back while anything runs. Every
    ``sample_every_s`` (None: never) the model's ``num_waiting`` and ``num_running`` are sampled, until every
    request finished. Stops at ``max_sim_s`` simulated seconds whatever happens.
    """
    if len(requests) > MAX_REQUESTS:
        raise ValueError(f"at most {MAX_REQUESTS} requests per run, got {len(requests)}")
    loop, engine = EventLoop(), make_engine(params)
    run = SideRun()
    remaining = {r.id for r in requests}
    busy = [False]

    def start() -> None:
        step = engine.start_step(loop.now)
        busy[0] = step is not None
        if step is not None:
            loop.at(step.end, complete, step)

    def complete(step) -> None:
        engine.complete_step(step)
        for out in step.outputs:
            rid = out.request_id
            if keep_tokens:
                run.token_times.setdefault(rid, []).append(step.end)
            if out.index == 0:
                run.ttft_s[rid] = step.end - run.sent_s[rid]
            if out.finished is not None:
                run.e2e_s[rid] = step.end - run.sent_s[rid]
                remaining.discard(rid)
        start()

    def submit(r: CalRequest) -> None:
        run.sent_s[r.id] = loop.now
        run.prompt_tokens[r.id] = r.prompt_tokens
        engine.submit(r.id, [f"{r.id}/{j}" for j in range(r.prompt_tokens)], r.output_tokens, ignore_eos=True,
                      now=loop.now)
        if not busy[0]:
            start()

    def sample(k: int) -> None:
        run.samples.append((loop.now, engine.num_waiting, engine.num_running))
        if remaining:
            loop.at((k + 1) * sample_every_s, sample, k + 1)

    for r in sorted(requests, key=lambda r: r.at_s):
        loop.at(r.at_s, submit, r)
    if sample_every_s:
        loop.at(0.0, sample, 0)
    loop.run(until=max_sim_s)
    return run


def schedstat(pid: int) -> tuple[float, float] | None:
    """(s on a core, s runnable but waiting for a core) of process ``pid``'s main thread, from
    /proc/PID/schedstat (nanoseconds, Linux with schedstats); None when unreadable. llama-server runs its whole
    inference loop (``-t 1``) in its main thread; its HTTP threads are not counted."""
    try:
        run_ns, wait_ns = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _http(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)


def _post_json(base_url: str, path: str, body: dict[str, Any], timeout_s: float = 30.0) -> Any:
    conn = _http(base_url, timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def _get(base_url: str, path: str, timeout_s: float = 5.0) -> str:
    conn = _http(base_url, timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read().decode(errors="replace")
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}: {data[:300]}")
        return data
    finally:
        conn.close()


def check_token_lengths(base_url: str, requests: Sequence[CalRequest]) -> None:
    """Check through llama-server's /tokenize that each request's prompt is ``prompt_tokens - 1`` tokens (BOS is
    added when served); raises ValueError naming the first that is not."""
    for r in requests:
        n = len(_post_json(base_url, "/tokenize", {"content": r.text})["tokens"])
        if n != r.prompt_tokens - 1:
            raise ValueError(f"{r.id}: its prompt is {n} tokens, not {r.prompt_tokens - 1}, on this tokenizer")


def _stream_one(base_url: str, model: str, r: CalRequest, t0: float, run: SideRun, lock: threading.Lock,
                conns: list, deadline: float, keep_tokens: bool) -> None:
    """Send one streamed completion at ``t0 + r.at_s`` and record its token times into ``run``."""
    body = json.dumps({"model": model, "prompt": r.text, "max_tokens": r.output_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "cache_prompt": False,
                       "stream_options": {"include_usage": True}})
    delay = t0 + r.at_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    conn = _http(base_url, REQUEST_TIMEOUT_S)
    with lock:
        conns.append(conn)
    times: list[float] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    sent = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for _ in range(100 * r.output_tokens + 100):  # bounded: one line per token plus blank lines and usage
            if time.perf_counter() > deadline:
                raise TimeoutError("run deadline passed")
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                times.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                usage, timings = chunk["usage"], chunk.get("timings")
        if len(times) < r.output_tokens - 1:
            raise RuntimeError(f"stream ended after {len(times)} of {r.output_tokens} tokens")
        error = None
    except Exception as exc:  # noqa: BLE001 - every failure is recorded against its request
        error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        conn.close()
    with lock:
        run.sent_s[r.id] = sent - t0
        if error is not None:
            run.errors[r.id] = error
            return
        run.ttft_s[r.id] = times[0] - run.sent_s[r.id]
        run.e2e_s[r.id] = times[-1] - run.sent_s[r.id]
        run.prompt_tokens[r.id] = int((usage or {}).get("prompt_tokens") or r.prompt_tokens)
        run.cached_tokens += int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if timings and timings.get("prompt_ms") is not None:
            run.server_prompt_ms[r.id] = float(timings["prompt_ms"])
        if keep_tokens:
            run.token_times[r.id] = times


def run_real(base_url: str, requests: Sequence[CalRequest], *, model: str = "",
             sample_every_s: float | None = SAMPLE_EVERY_S, keep_tokens: bool = False,
             timeout_s: float = 300.0, server_pid: int | None = None) -> SideRun:
    """Send ``requests`` to a llama-server at their ``at_s`` (one thread each, streamed, ``cache_prompt`` off) and
    record TTFT (first streamed token, client side) and end times; every ``sample_every_s`` (None: never) read
    ``llamacpp:requests_deferred`` (pending) and ``llamacpp:requests_processing`` (running) from /metrics, stamped
    with the time the answer arrived. With ``server_pid``, also how long llama-server's compute thread ran and
    waited for a core meanwhile (:func:`schedstat`). Bounded: at most :data:`MAX_REQUESTS` requests, ``timeout_s``
    for the whole run (connections still open then are closed and their requests recorded as failed).
    """
    if len(requests) > MAX_REQUESTS:
        raise ValueError(f"at most {MAX_REQUESTS} requests per run, got {len(requests)}")
    run, lock, conns = SideRun(), threading.Lock(), []
    stop = threading.Event()
    t0 = time.perf_counter() + 0.2  # a short lead: every thread is waiting before the first send
    deadline = t0 + timeout_s

    def sampler() -> None:
        k = 0
        while not stop.is_set() and time.perf_counter() < deadline:
            try:
                text = _get(base_url, "/metrics", timeout_s=10.0)
                pending = _metric(text, "llamacpp:requests_deferred")
                running = _metric(text, "llamacpp:requests_processing")
                if pending is not None and running is not None:
                    run.samples.append((time.perf_counter() - t0, int(pending), int(running)))
            except (OSError, RuntimeError, http.client.HTTPException):
                pass  # a missed sample leaves a gap; the comparison holds the last value
            k += 1
            wait = t0 + k * sample_every_s - time.perf_counter()
            if wait > 0:
                stop.wait(wait)

    threads = [threading.Thread(target=_stream_one, args=(base_url, model, r, t0, run, lock, conns, deadline,
                                                          keep_tokens), daemon=True) for r in requests]
    sampling = threading.Thread(target=sampler, daemon=True) if sample_every_s else None
    sched0 = schedstat(server_pid) if server_pid else None
    if sampling:
        sampling.start()
    for th in threads:
        th.start()
    try:
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.perf_counter()))
    finally:
        with lock:
            for conn in conns:  # unblocks a reader stuck past the deadline
                with contextlib.suppress(OSError):
                    if conn.sock is not None:
                        conn.sock.close()
        for th in threads:
            th.join(timeout=5)
        if sampling:
            time.sleep(min(sample_every_s or 0, 0.3))  # one sample after the last request finished
            stop.set()
            sampling.join(timeout=15)
    sched1 = schedstat(server_pid) if server_pid else None
    if sched0 and sched1:
        run.server_run_s, run.server_wait_s = sched1[0] - sched0[0], sched1[1] - sched0[1]
    for r in requests:
        if r.id not in run.ttft_s and r.id not in run.errors:
            run.errors[r.id] = "no answer before the run's deadline"
    return run


# ------------------------------------------------------------------------------------------------------ the fit


@dataclass(frozen=True)
class PrefillPoint:
    """One idle-server TTFT: ``prompt_tokens`` (BOS included), ``ttft_ms`` (client side), ``server_prompt_ms``
    (llama-server's own ``timings.prompt_ms``; None for the model), ``slowdown`` (the probe's
    :attr:`SideRun.slowdown`: how much other processes stretched it)."""

    prompt_tokens: int
    ttft_ms: float
    server_prompt_ms: float | None = None
    slowdown: float = 1.0

    @property
    def full_core_ms(self) -> float:
        """The TTFT on a core of its own: ``ttft_ms / slowdown`` (ms)."""
        return self.ttft_ms / self.slowdown


@dataclass(frozen=True)
class DecodePoint:
    """One decode measurement: ``batch`` concurrent streams, ``kv_tokens`` context tokens of all of them together
    at the median step, ``gap_ms`` the median inter-token gap while all of them decode (= the step time),
    ``slowdown`` the probe's :attr:`SideRun.slowdown`."""

    batch: int
    kv_tokens: float
    gap_ms: float
    slowdown: float = 1.0

    @property
    def full_core_ms(self) -> float:
        """The step time on a core of its own: ``gap_ms / slowdown`` (ms)."""
        return self.gap_ms / self.slowdown


@dataclass(frozen=True)
class PrefillFit:
    """Least-squares line TTFT = ``intercept_ms`` + ``ms_per_token`` x prompt tokens, its largest residual (ms)."""

    ms_per_token: float
    intercept_ms: float
    max_residual_ms: float


@dataclass(frozen=True)
class DecodeFit:
    """Decode step (ms) = ``base_ms`` + ``per_seq_ms`` x sequences + ``per_kv_token_ms`` x their context tokens;
    ``max_residual_ms`` over the points it was fitted to."""

    base_ms: float
    per_seq_ms: float
    per_kv_token_ms: float
    max_residual_ms: float

    def step_ms(self, batch: int, kv_tokens: float) -> float:
        """The fitted decode step time (ms) for ``batch`` sequences holding ``kv_tokens`` context tokens."""
        return self.base_ms + self.per_seq_ms * batch + self.per_kv_token_ms * kv_tokens


def prefill_points(probes: Sequence[Sequence[CalRequest]], runs: Sequence[SideRun]) -> list[PrefillPoint]:
    """The TTFT of each single-request probe (``runs[i]`` is what ``probes[i]`` gave), by its real length."""
    points = []
    for probe, run in zip(probes, runs):
        for r in probe:
            if r.id in run.ttft_s:
                points.append(PrefillPoint(run.prompt_tokens.get(r.id, r.prompt_tokens), 1000 * run.ttft_s[r.id],
                                           run.server_prompt_ms.get(r.id), run.slowdown))
    return points


def _window_gaps(token_times: Sequence[Sequence[float]]) -> list[float]:
    """Inter-token gaps (s) of every stream while all the streams decode: after the last one's first token and
    before the first one's last token."""
    start = max(t[0] for t in token_times)
    end = min(t[-1] for t in token_times)
    return [b - a for t in token_times for a, b in zip(t, t[1:]) if a >= start and b <= end]


def decode_points(probes: Sequence[Sequence[CalRequest]], runs: Sequence[SideRun]) -> list[DecodePoint]:
    """One DecodePoint per decode probe whose streams all finished (needs ``keep_tokens`` runs): the median gap
    while all its streams decode, and their context then (prompt + half the output, summed over streams)."""
    points = []
    for probe, run in zip(probes, runs):
        times = [run.token_times.get(r.id) for r in probe]
        if not all(t and len(t) >= 3 for t in times):
            continue
        gaps = _window_gaps(times)
        if not gaps:
            continue
        kv = sum(run.prompt_tokens.get(r.id, r.prompt_tokens) + r.output_tokens / 2 for r in probe)
        points.append(DecodePoint(len(probe), kv, 1000 * median(gaps), run.slowdown))
    return points


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares: the x minimising |A x - y| through the normal equations (Gaussian elimination)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(a[i][c]))
        if abs(a[p][c]) < 1e-12:
            raise ValueError("the points do not determine the fit (too few distinct points)")
        a[c], a[p] = a[p], a[c]
        for i in range(n):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_prefill(points: Sequence[PrefillPoint]) -> PrefillFit:
    """The least-squares line through (prompt tokens, full-core TTFT ms: ``full_core_ms``); needs two distinct
    lengths. A negative slope (no prefill cost measured) is a ValueError."""
    if len({p.prompt_tokens for p in points}) < 2:
        raise ValueError("the prefill fit needs TTFTs of at least two prompt lengths")
    intercept, slope = _solve([[1.0, p.prompt_tokens] for p in points], [p.full_core_ms for p in points])
    if slope <= 0:
        raise ValueError(f"TTFT does not grow with the prompt (slope {slope:.4f} ms/token)")
    resid = max(abs(intercept + slope * p.prompt_tokens - p.full_core_ms) for p in points)
    return PrefillFit(slope, intercept, resid)


def fit_decode(points: Sequence[DecodePoint]) -> DecodeFit:
    """Fit gap = base + per_seq x batch + per_kv x kv_tokens to the points' full-core gaps (``full_core_ms``),
    every coefficient kept >= 0.

    The context term is identified only by points of the same batch size at different contexts (the long-prompt
    probe beside the short one): ``per_kv`` is the pooled slope of gap on context within such groups (0 without
    any, or when negative). Then base and per_seq are the least-squares line through the gaps less that term, over
    every batch size; a negative per_seq is refitted as 0 (a constant step), a negative base as 0 (a line through
    the origin). Fitting all three at once instead would let the batch's own curvature (see the report) leak into
    the context term, since context grows with the batch in the other probes.
    """
    if len({p.batch for p in points}) < 2:
        raise ValueError("the decode fit needs gaps at two batch sizes at least")
    sxy = sxx = 0.0
    for b in {p.batch for p in points}:
        group = [p for p in points if p.batch == b]
        mk = sum(p.kv_tokens for p in group) / len(group)
        mg = sum(p.full_core_ms for p in group) / len(group)
        sxy += sum((p.kv_tokens - mk) * (p.full_core_ms - mg) for p in group)
        sxx += sum((p.kv_tokens - mk) ** 2 for p in group)
    per_kv = max(0.0, sxy / sxx) if sxx > 0 else 0.0
    ys = [p.full_core_ms - per_kv * p.kv_tokens for p in points]
    base, per_seq = _solve([[1.0, float(p.batch)] for p in points], ys)
    if per_seq < 0:
        base, per_seq = sum(ys) / len(ys), 0.0
    elif base < 0:
        base, per_seq = 0.0, _solve([[float(p.batch)] for p in points], ys)[0]
    fit = DecodeFit(max(0.0, base), max(0.0, per_seq), per_kv, 0.0)
    resid = max(abs(fit.step_ms(p.batch, p.kv_tokens) - p.full_core_ms) for p in points)
    return replace(fit, max_residual_ms=resid)


def fitted_params(prefill: PrefillFit, decode: DecodeFit, *, slots: int, ctx_size: int,
                  n_batch: int = N_BATCH) -> EngineParams:
    """EngineParams for a llama-server with ``slots`` slots (``-np``), ``ctx_size`` context for all slots (``-c``)
    and logical batch ``n_batch`` (``-b``), with the fitted step times.

    max_num_seqs = slots; max_num_batched_tokens = n_batch; kv_cache_tokens = ctx_size; max_model_len = ctx_size //
    slots (a request must fit one slot's context); prefill_ms_per_token = the TTFT slope; decode_* from the decode
    fit; time_scale 1.
    """
    return EngineParams(max_num_seqs=slots, max_num_batched_tokens=max(n_batch, slots), kv_cache_tokens=ctx_size,
                        block_size=16, max_model_len=ctx_size // slots, prefill_ms_per_token=prefill.ms_per_token,
                        decode_base_ms=decode.base_ms, decode_ms_per_seq=decode.per_seq_ms,
                        decode_ms_per_kv_token=decode.per_kv_token_ms, time_scale=1.0)


# ------------------------------------------------------------------------------------------- side-by-side figures


def _held(samples: Sequence[tuple[float, int, int]], t: float) -> tuple[int, int]:
    """(pending, running) of the last sample taken at or before ``t`` (0, 0 before the first)."""
    value = (0, 0)
    for ts, p, r in samples:
        if ts > t:
            break
        value = (p, r)
    return value


def as_slots(samples: Sequence[tuple[float, int, int]], slots: int) -> list[tuple[float, int, int]]:
    """The model's (t, waiting, running) samples in llama-server's meaning: of the outstanding requests (waiting +
    running), ``min(outstanding, slots)`` hold a slot (``requests_processing``) and the rest are deferred
    (``requests_deferred``). The model's own ``num_waiting`` (vLLM's meaning) also counts a request that holds a
    slot but whose prompt has not been scheduled yet; llama-server counts that one as processing."""
    return [(t, max(0, w + r - slots), min(w + r, slots)) for t, w, r in samples]


def compare(real: SideRun, model: SideRun, *, slots: int | None = None,
            grid_s: float = SAMPLE_EVERY_S) -> dict[str, Any]:
    """The side-by-side figures of one repetition: per side TTFT p50/p90/max (s), makespan (s), mean and max
    pending and running on a common ``grid_s`` grid (last sample held), and the model's errors: per request TTFT
    mean absolute and mean signed error (s), and the mean absolute pending / running difference on the grid.

    With ``slots``, the model's pending and running are taken in llama-server's meaning (:func:`as_slots`) and its
    own ``num_waiting`` mean and max are added as ``model.own_waiting_mean`` / ``own_waiting_max``.
    """
    horizon = max(real.makespan_s, model.makespan_s)
    grid = [k * grid_s for k in range(int(horizon / grid_s) + 1)]
    model_samples = as_slots(model.samples, slots) if slots else model.samples
    out: dict[str, Any] = {}
    for name, side, samples in (("real", real, real.samples), ("model", model, model_samples)):
        ttft = list(side.ttft_s.values())
        held = [_held(samples, t) for t in grid]
        out[name] = {
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "ttft_max_s": max(ttft) if ttft else None, "makespan_s": side.makespan_s,
            "pending_mean": sum(p for p, _ in held) / len(held), "pending_max": max(p for p, _ in held),
            "running_mean": sum(r for _, r in held) / len(held), "running_max": max(r for _, r in held),
            "completed": len(side.e2e_s), "failed": len(side.errors), "samples": len(side.samples),
        }
        out[name]["_held"] = held
    both = [i for i in real.ttft_s if i in model.ttft_s]
    diffs = [model.ttft_s[i] - real.ttft_s[i] for i in both]
    out["error"] = {
        "ttft_mae_s": sum(abs(d) for d in diffs) / len(diffs) if diffs else None,
        "ttft_bias_s": sum(diffs) / len(diffs) if diffs else None,
        "pending_mad": sum(abs(a[0] - b[0]) for a, b in zip(out["real"]["_held"], out["model"]["_held"])) / len(grid),
        "running_mad": sum(abs(a[1] - b[1]) for a, b in zip(out["real"]["_held"], out["model"]["_held"])) / len(grid),
    }
    own = [_held(model.samples, t)[0] for t in grid]
    out["model"]["own_waiting_mean"] = sum(own) / len(own)
    out["model"]["own_waiting_max"] = max(own)
    # (t, real pending, real running, model pending, model running, age of the real sample held at t in s)
    out["series"] = [(t, *_held(real.samples, t), *_held(model_samples, t),
                      t - max((ts for ts, _, _ in real.samples if ts <= t), default=0.0)) for t in grid]
    for name in ("real", "model"):
        del out[name]["_held"]
    return out


# ---------------------------------------------------------------------------------------------------- paper check


def paper_check(params: EngineParams | None = None, *, batches: Sequence[int] = (1, 8, 32, 128),
                context_tokens: int = 1000) -> dict[str, Any]:
    """The model beside the paper's figure: the TTFT of one 512-token prompt on an idle ``EngineModel(params)``
    (default ``EngineParams()``: Llama-3.1-8B on an L4), and the decode step time (ms) at ``batches`` sequences of
    ``context_tokens`` tokens each (``EngineParams.step_seconds``)."""
    params = params or EngineParams()
    run = replay_model([CalRequest("paper-512", 0.0, 512, 1)], params, sample_every_s=None)
    return {
        "prefill_512_ms": 1000 * run.ttft_s["paper-512"],
        "paper_ms": PAPER_PREFILL_512_MS,
        "decode_ms": {b: 1000 * params.step_seconds(prefill_tokens=0, decode_seqs=b,
                                                    decode_kv_tokens=b * context_tokens) for b in batches},
        "context_tokens": context_tokens,
        "params": asdict(params),
    }


# ------------------------------------------------------------------------------------------------- llama-server


@contextlib.contextmanager
def llama_server(*, parallel: int, ctx_size: int, threads: int, binary: str | Path | None = None,
                 model_path: str | Path | None = None, n_batch: int = N_BATCH,
                 log_dir: Path | None = None) -> Iterator[dict[str, Any]]:
    """Start one llama-server (``--metrics -np parallel -c ctx_size -t threads -b n_batch -ub 512``, CPU only),
    wait until /health answers 200, yield ``{"url", "pid", "model", "binary", "total_slots", "log"}``, and stop it
    (its whole process group) on the way out, also on failure.

    Raises bench.launch.llamacpp.LlamaCppUnavailable when the binary (never built here) or the model is missing, and
    RuntimeError (with the log's tail) when it does not become ready within 120 s.
    """
    from bench.launch.llamacpp import gemma_model_path, llama_server_binary, llama_server_command, model_alias
    from bench.launch.procs import ProcGroup, free_port, wait_http
    binary = Path(binary) if binary else llama_server_binary(build=False)
    model_path = Path(model_path) if model_path else gemma_model_path()
    port = free_port()
    argv = llama_server_command(port, model_path=model_path, binary=binary, parallel=parallel, ctx_size=ctx_size,
                                threads=threads, extra_args=["-b", str(n_batch), "-ub", str(min(N_UBATCH, n_batch))])
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="skylb-calibrate-")))
        group = stack.enter_context(ProcGroup(log_dir))  # stops the server on every way out
        proc = group.start(argv, name="llama-server")
        url = f"http://127.0.0.1:{port}"
        # /health is 503 while loading; wait for 200.
        deadline = time.monotonic() + 120
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server was not ready within 120 s\n{proc.log()[-3000:]}")
            try:
                wait_http(f"{url}/health", timeout_s=max(1.0, deadline - time.monotonic()), proc=proc.popen)
                if json.loads(_get(url, "/health")).get("status") == "ok":
                    break
            except (TimeoutError, RuntimeError, OSError, ValueError) as exc:
                if time.monotonic() > deadline or proc.popen.poll() is not None:
                    raise RuntimeError(f"llama-server did not become ready: {exc}\n{proc.log()[-3000:]}") from exc
            time.sleep(0.2)
        props = json.loads(_get(url, "/props"))
        yield {"url": url, "pid": proc.popen.pid, "model": model_alias(model_path), "binary": str(binary),
               "total_slots": int(props.get("total_slots") or parallel), "build": props.get("build_info", "?"),
               "log": proc.log}


# ------------------------------------------------------------------------------------------------- the whole run


def _cpu_snapshot(server_pid: int) -> tuple[float, float, float]:
    """(the machine's busy CPU-s from /proc/stat: user + nice + system + irq + softirq; llama-server's CPU-s; this
    process's CPU-s, all its threads)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
        busy = (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = 0.0
    t = os.times()
    return busy, process_cpu_s(server_pid), t.user + t.system


def _load_window(load: MachineLoad, server_pid: int, snap0: tuple[float, float, float]) -> dict[str, Any]:
    """One measurement window's load: MachineLoad.stop()'s summary, with ``others_cpu_s`` taken from the machine's
    busy time (/proc/stat) less llama-server's and this process's CPU time, so processes that started and ended
    inside the window (other people's test runs) count too; MachineLoad's own figure (processes alive at both
    ends) stays as ``others_listed_cpu_s``, and ``server_cpu_s`` is llama-server's CPU time in the window."""
    w = load.stop()
    busy1, server1, self1 = _cpu_snapshot(server_pid)
    server_s = server1 - snap0[1]
    w["server_cpu_s"] = server_s
    w["client_cpu_s"] = self1 - snap0[2]
    w["others_listed_cpu_s"] = max(0.0, w["others_cpu_s"] - server_s)  # llama-server lived through the window
    w["others_cpu_s"] = max(w["others_listed_cpu_s"], busy1 - snap0[0] - server_s - w["client_cpu_s"])
    w["others_cpu_frac"] = w["others_cpu_s"] / (w["wall_s"] * (os.cpu_count() or 1)) if w["wall_s"] > 0 else 0.0
    listed = [t for t in w["top_others"] if f"[{server_pid}]" not in t]
    unlisted = w["others_cpu_s"] - w["others_listed_cpu_s"]
    w["top_others"] = ([f"processes that started and ended in the window: {unlisted:.1f} s"] if unlisted >= 1 else [])
    w["top_others"] += listed
    return w


def _fit_rows(params: EngineParams, pre_probes, pre_runs, dec_probes, dec_runs) -> tuple[list, list]:
    """The fit's measurements grouped for the report: per prompt length, llama-server's TTFTs (ms), the probes'
    slowdowns, their full-core TTFTs and its ``timings.prompt_ms`` beside the fitted model's TTFT; per decode probe
    shape, the gaps (ms), slowdowns and full-core gaps beside the model's step."""
    prefill: dict[int, dict[str, Any]] = {}
    for probe, run in zip(pre_probes, pre_runs):
        for r in probe:
            n = run.prompt_tokens.get(r.id, r.prompt_tokens)
            row = prefill.setdefault(n, {"prompt_tokens": n, "ttft_ms": [], "slowdown": [], "full_core_ms": [],
                                         "server_prompt_ms": [], "model_ms": None})
            if r.id in run.ttft_s:
                row["ttft_ms"].append(1000 * run.ttft_s[r.id])
                row["slowdown"].append(run.slowdown)
                row["full_core_ms"].append(1000 * run.ttft_s[r.id] / run.slowdown)
            if r.id in run.server_prompt_ms:
                row["server_prompt_ms"].append(run.server_prompt_ms[r.id])
    for n, row in prefill.items():
        m = replay_model([CalRequest("m", 0.0, n, 1)], params, sample_every_s=None)
        row["model_ms"] = 1000 * m.ttft_s["m"]
    decode: dict[tuple[int, int], dict[str, Any]] = {}
    for probe, run in zip(dec_probes, dec_runs):
        key = (len(probe), probe[0].prompt_tokens)
        row = decode.get(key)
        if row is None:
            [mp] = decode_points([probe], [replay_model(probe, params, sample_every_s=None, keep_tokens=True)])
            row = decode[key] = {"batch": key[0], "prompt_tokens": key[1], "kv_tokens": mp.kv_tokens,
                                 "gap_ms": [], "slowdown": [], "full_core_ms": [], "model_ms": mp.gap_ms}
        for p in decode_points([probe], [run]):
            row["gap_ms"].append(p.gap_ms)
            row["slowdown"].append(p.slowdown)
            row["full_core_ms"].append(p.full_core_ms)
    return sorted(prefill.values(), key=lambda r: r["prompt_tokens"]), list(decode.values())


def calibrate(server: dict[str, Any], *, slots: int, ctx_size: int, n_batch: int = N_BATCH,
              plan: FitPlan = FitPlan(), scenarios: Sequence[Scenario] | None = None, repeats: int = 3,
              progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Fit the model to a running llama-server (``server`` as :func:`llama_server` yields) and run every scenario
    ``repeats`` times on both sides. Returns a JSON-ready dict: the fit's points and parameters, per scenario the
    :func:`compare` figures of each repetition, and the machine's load per window.

    The fit is to llama-server on a core of its own: each probe's times are divided by its slowdown (how long
    the compute thread waited for a core, :func:`schedstat`), so the fitted step times do not depend on what else
    ran during the fit. Each repetition is then replayed twice: with the fitted times, and slowed by that window's
    own slowdown (``time_scale``), which separates the machine's share of the error from the model's.
    """
    url, model = server["url"], server["model"]
    scenarios = list(scenarios if scenarios is not None else default_scenarios(ctx_size // slots))
    pre_probes, dec_probes = fit_probes(plan)
    all_requests = ([r for p in pre_probes + dec_probes for r in p] + chunk_probe(plan)
                    + [r for s in scenarios for r in s.requests])
    for r in all_requests:
        if r.prompt_tokens + r.output_tokens > ctx_size // slots:
            raise ValueError(f"{r.id} does not fit one slot's context ({ctx_size // slots} tokens)")
    check_token_lengths(url, all_requests)
    windows: list[tuple[str, dict[str, Any]]] = []
    pid = server["pid"]

    progress("fit: idle-server TTFT and decode gaps")
    load, snap = MachineLoad().start(), _cpu_snapshot(pid)
    pre_runs = [run_real(url, p, model=model, sample_every_s=None, timeout_s=60, server_pid=pid)
                for p in pre_probes]
    dec_runs = [run_real(url, p, model=model, sample_every_s=None, keep_tokens=True, timeout_s=60, server_pid=pid)
                for p in dec_probes]
    windows.append(("fit", _load_window(load, pid, snap)))
    failed = {i: e for run in pre_runs + dec_runs for i, e in run.errors.items()}
    if failed:
        raise RuntimeError(f"fit requests failed: {dict(list(failed.items())[:3])}")
    p_points, d_points = prefill_points(pre_probes, pre_runs), decode_points(dec_probes, dec_runs)
    p_fit, d_fit = fit_prefill(p_points), fit_decode(d_points)
    params = fitted_params(p_fit, d_fit, slots=slots, ctx_size=ctx_size, n_batch=n_batch)
    prefill_rows, decode_rows = _fit_rows(params, pre_probes, pre_runs, dec_probes, dec_runs)
    chunk: dict[str, Any] = {}
    probe = chunk_probe(plan)
    if probe:
        progress("fit: a long prompt arriving while one stream decodes")
        real = run_real(url, probe, model=model, sample_every_s=None, keep_tokens=True, timeout_s=60, server_pid=pid)
        modeled = replay_model(probe, params, sample_every_s=None, keep_tokens=True)
        chunk = {"prompt_tokens": plan.chunk_prompt, "errors": real.errors, "slowdown": real.slowdown}
        for side, run in (("real", real), ("model", modeled)):
            chunk[side] = {"stalls_ms": stalls(run, "chunk-stream"),
                           "ttft_ms": 1000 * run.ttft_s["chunk-prompt"] if "chunk-prompt" in run.ttft_s else None}

    results: dict[str, Any] = {}
    for sc in scenarios:
        reps = []
        for k in range(repeats):
            progress(f"{sc.name}: repetition {k + 1} of {repeats}")
            load, snap = MachineLoad().start(), _cpu_snapshot(pid)
            real = run_real(url, sc.requests, model=model, server_pid=pid)
            windows.append((f"{sc.name} #{k + 1}", _load_window(load, pid, snap)))
            # The model gets the same requests at the times they were really sent, with their real lengths.
            replayed = [replace(r, at_s=real.sent_s.get(r.id, r.at_s),
                                prompt_tokens=real.prompt_tokens.get(r.id, r.prompt_tokens)) for r in sc.requests]
            modeled = replay_model(replayed, params)
            fig = compare(real, modeled, slots=slots)
            # The same model slowed by what the other processes did to llama-server in this window.
            at_load = compare(real, replay_model(replayed, replace(params, time_scale=real.slowdown)), slots=slots)
            fig["model_at_load"], fig["error_at_load"] = at_load["model"], at_load["error"]
            fig["slowdown"], fig["server_wait_s"] = real.slowdown, real.server_wait_s
            fig["cached_tokens"] = real.cached_tokens
            fig["errors"] = real.errors
            reps.append(fig)
            time.sleep(0.5)  # let the server go idle between repetitions
        results[sc.name] = {"title": sc.title, "requests": [asdict(r) for r in sc.requests], "repetitions": reps}
    return {
        "server": {k: v for k, v in server.items() if k != "log"}, "slots": slots, "ctx_size": ctx_size,
        "n_batch": n_batch, "plan": asdict(plan),
        "fit": {"prefill_points": [asdict(p) for p in p_points], "decode_points": [asdict(p) for p in d_points],
                "prefill": asdict(p_fit), "decode": asdict(d_fit), "params": asdict(params),
                "prefill_rows": prefill_rows, "decode_rows": decode_rows, "chunk": chunk},
        "scenarios": results, "windows": windows,
    }


# ------------------------------------------------------------------------------------------------------- report


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _spread(values: Sequence[float | None], fmt: str = "{:.2f}") -> str:
    """"mean (min-max)" of the values that are not None."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rel(model: float | None, real: float | None) -> float | None:
    return None if model is None or not real else (model - real) / real


def _paper_lines(paper: dict[str, Any]) -> list[str]:
    lines = ["## 1. The paper's figure: EngineParams defaults (Llama-3.1-8B, one L4)", ""]
    rows = [["TTFT of one 512-token prompt, idle engine (prefill step)", f"{paper['prefill_512_ms']:.1f} ms",
             f"about {paper['paper_ms']:.0f} ms (SkyLB paper §2.1, \"Latency metric\")",
             f"{100 * _rel(paper['prefill_512_ms'], paper['paper_ms']):+.1f}%"]]
    for b, ms in paper["decode_ms"].items():
        rows.append([f"decode step, {b} sequence(s) of {paper['context_tokens']} context tokens", f"{ms:.1f} ms",
                     "not given by the paper; weights (16.06 GB) / 300 GB/s = 53.5 ms floor", ""])
    lines += [markdown_table(["quantity", "model", "source", "model vs paper"], rows), ""]
    p = paper["params"]
    lines += [f"The model's prefill step is `decode_base_ms` + `prefill_ms_per_token` x tokens = {p['decode_base_ms']}"
              f" + {p['prefill_ms_per_token']} x 512; the derivations are in `EngineParams`'s docstring "
              "(bench/emulator/model.py). The paper gives no decode figure, so the decode rows rest on the L4's "
              "memory bandwidth alone.", ""]
    return lines


def _fit_lines(result: dict[str, Any]) -> list[str]:
    fit, srv = result["fit"], result["server"]
    pf, df, params = fit["prefill"], fit["decode"], fit["params"]
    slot_ctx = result["ctx_size"] // result["slots"]
    lines = ["## 2. Fit to a real llama-server", "",
             f"llama-server build {srv.get('build', '?')}, model {srv['model']} (Q4_K_M, CPU only), "
             f"`-np {result['slots']} -c {result['ctx_size']} -t {result.get('threads', '?')} -b {result['n_batch']} "
             f"-ub {min(N_UBATCH, result['n_batch'])} --metrics` ({srv['total_slots']} slots of {slot_ctx} tokens, "
             "/props `total_slots`). Idle server, one probe at a time; TTFT measured by the client (send to the "
             "first streamed token), gaps between streamed tokens. Slowdown: (time llama-server's compute thread "
             "ran + time it waited for a core) / time it ran, during the probe (/proc/PID/schedstat); the fit uses "
             "the full-core times = measured / slowdown, so it describes llama-server on a core of its own.", ""]
    passes = result["plan"]["prefill_passes"]
    rows = [[p["prompt_tokens"], _spread(p["ttft_ms"], "{:.0f}"), _spread(p.get("slowdown", []), "{:.2f}"),
             _spread(p.get("full_core_ms", p["ttft_ms"]), "{:.0f}"), _spread(p["server_prompt_ms"], "{:.0f}"),
             f"{p['model_ms']:.0f}", _f(_rel(p["model_ms"], _mean(p.get("full_core_ms", p["ttft_ms"]))), "{:+.1%}")]
            for p in fit["prefill_rows"]]
    lines += [f"Prefill (single requests, {passes} passes; mean (min-max) over them):", "",
              markdown_table(["prompt tokens", "llama-server TTFT ms", "slowdown", "full-core TTFT ms",
                              "its timings.prompt_ms", "fitted model ms", "model vs full-core"], rows), ""]
    rows = [[p["batch"], p["prompt_tokens"], f"{p['kv_tokens']:.0f}", _spread(p["gap_ms"], "{:.1f}"),
             _spread(p.get("slowdown", []), "{:.2f}"), _spread(p.get("full_core_ms", p["gap_ms"]), "{:.1f}"),
             f"{p['model_ms']:.1f}", _f(_rel(p["model_ms"], _mean(p.get("full_core_ms", p["gap_ms"]))), "{:+.1%}")]
            for p in fit["decode_rows"]]
    lines += [f"Decode (median inter-token gap while every stream decodes, {result['plan']['decode_passes']} "
              "passes):", "",
              markdown_table(["streams", "prompt tokens each", "context tokens (all)", "llama-server gap ms",
                              "slowdown", "full-core gap ms", "fitted model step ms", "model vs full-core"], rows),
              ""]
    rows = [["max_num_seqs", params["max_num_seqs"], "`-np` slots"],
            ["max_num_batched_tokens", params["max_num_batched_tokens"], "`-b` (tokens per llama_decode call)"],
            ["kv_cache_tokens", params["kv_cache_tokens"], "`-c` (all slots together)"],
            ["max_model_len", params["max_model_len"], "`-c / -np`: one slot's context"],
            ["prefill_ms_per_token", f"{params['prefill_ms_per_token']:.3f}",
             f"TTFT slope; intercept {pf['intercept_ms']:.1f} ms, largest residual {pf['max_residual_ms']:.1f} ms"],
            ["decode_base_ms", f"{params['decode_base_ms']:.2f}", "decode fit, intercept"],
            ["decode_ms_per_seq", f"{params['decode_ms_per_seq']:.2f}", "decode fit, per stream"],
            ["decode_ms_per_kv_token", f"{params['decode_ms_per_kv_token']:.5f}",
             "decode fit, per context token (one stream, short vs long prompt); largest residual of the decode fit "
             f"{df['max_residual_ms']:.1f} ms"]]
    lines += ["Fitted `EngineParams` (what `bench.emulator.model.EngineModel` gets below):", "",
              markdown_table(["parameter", "value", "from"], rows), ""]
    lines += [f"For comparison with the L4 defaults: this CPU prefills {1000 / params['prefill_ms_per_token']:.0f} "
              f"tokens/s and decodes one stream at {1000 / max(1e-9, df['base_ms'] + df['per_seq_ms']):.0f} "
              "tokens/s; a step's cost grows about "
              f"{params['decode_ms_per_seq'] / max(1e-9, params['decode_base_ms'] + params['decode_ms_per_seq']):.0%} "
              "of a one-stream step per extra stream (on the L4 model, 0.5%: decode there is bound by reading the "
              "weights, here largely by compute).", ""]
    chunk = fit.get("chunk") or {}
    if chunk.get("real"):
        rows = [[side, len(chunk[key]["stalls_ms"]), ", ".join(f"{x:.0f}" for x in chunk[key]["stalls_ms"]) or "-",
                 _f(chunk[key]["ttft_ms"], "{:.0f}")] for side, key in (("llama-server", "real"), ("model", "model"))]
        lines += [f"A {chunk['prompt_tokens']}-token prompt sent 1 s into a decoding stream (stalls: the stream's "
                  "inter-token gaps longer than 5x its median, i.e. steps spent on the prompt; llama-server's "
                  f"slowdown {chunk.get('slowdown', 1.0):.2f}):", "",
                  markdown_table(["", "stalls of the decoding stream", "their lengths (ms)", "the prompt's TTFT (ms)"],
                                 rows), ""]
    return lines


_FIGURES = [
    ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"), ("TTFT p90 (s)", "ttft_p90_s", "{:.2f}"),
    ("TTFT max (s)", "ttft_max_s", "{:.2f}"), ("last request done (s)", "makespan_s", "{:.1f}"),
    ("pending, mean", "pending_mean", "{:.2f}"), ("pending, max", "pending_max", "{:.0f}"),
    ("running, mean", "running_mean", "{:.2f}"), ("running, max", "running_max", "{:.0f}"),
]


def _scenario_lines(name: str, sc: dict[str, Any]) -> list[str]:
    reps = sc["repetitions"]
    reqs = sc["requests"]
    lines = [f"### `{name}`: {sc['title']}", "",
             f"{len(reqs)} requests, prompts {min(r['prompt_tokens'] for r in reqs)}-"
             f"{max(r['prompt_tokens'] for r in reqs)} tokens (sum {sum(r['prompt_tokens'] for r in reqs)}), outputs "
             f"{min(r['output_tokens'] for r in reqs)}-{max(r['output_tokens'] for r in reqs)} tokens (sum "
             f"{sum(r['output_tokens'] for r in reqs)}), last sent at {max(r['at_s'] for r in reqs):.2f} s. "
             f"{len(reps)} repetition(s); each cell is the mean (min-max) over them. Pending and running of the model "
             "are in llama-server's meaning (outstanding requests beyond the slots / holding a slot); the last row "
             "is the model's own `num_waiting` (vLLM's meaning), for reference. The last two columns replay the "
             "same model slowed by llama-server's slowdown in that repetition (other processes taking its core: "
             f"{_spread([r.get('slowdown') for r in reps], '{:.2f}')}), which separates the machine's share of "
             "the error from the model's.", ""]

    def diff(model: list, real: list, key: str) -> str:
        if key.startswith(("ttft", "makespan")):
            return _spread([100 * v if v is not None else None for v in map(_rel, model, real)], "{:+.0f}%")
        return _spread([m - x for m, x in zip(model, real)], "{:+.2f}")

    rows = []
    for label, key, fmt in _FIGURES:
        real = [r["real"][key] for r in reps]
        model = [r["model"][key] for r in reps]
        loaded = [r["model_at_load"][key] for r in reps if "model_at_load" in r]
        rows.append([label, _spread(real, fmt), _spread(model, fmt), diff(model, real, key), _spread(loaded, fmt),
                     diff(loaded, real, key) if len(loaded) == len(real) else ""])
    rows.append(["model's own num_waiting, mean / max", "",
                 f"{_spread([r['model']['own_waiting_mean'] for r in reps])} / "
                 f"{_spread([r['model']['own_waiting_max'] for r in reps], '{:.0f}')}", "", "", ""])
    lines += [markdown_table(["figure", "llama-server", "model (fitted)", "model - llama-server",
                              "model x slowdown", "model x slowdown - llama-server"], rows), ""]
    err = [r["error"] for r in reps]
    lines += [f"Per request, the model's TTFT is off by {_spread([e['ttft_mae_s'] for e in err])} s on average "
              f"(mean absolute error; signed mean {_spread([e['ttft_bias_s'] for e in err], '{:+.2f}')} s, "
              "positive = the model is slower). On the 100 ms grid its pending count differs from llama-server's by "
              f"{_spread([e['pending_mad'] for e in err])} requests on average and its running count by "
              f"{_spread([e['running_mad'] for e in err])}. Requests completed: llama-server "
              f"{_spread([r['real']['completed'] for r in reps], '{:.0f}')}, model "
              f"{_spread([r['model']['completed'] for r in reps], '{:.0f}')}; failed on llama-server: "
              f"{sum(r['real']['failed'] for r in reps)}; /metrics samples per run: "
              f"{_spread([r['real']['samples'] for r in reps], '{:.0f}')}; prompt tokens llama-server reported "
              f"cached: {sum(r['cached_tokens'] for r in reps)}.", ""]
    series = reps[0]["series"]
    end = series[-1][0] if series else 0.0
    picks = sorted({min(range(len(series)), key=lambda i: abs(series[i][0] - t))
                    for t in [0.5, 1, 2, 4, 6, 8] + [end * f for f in (0.5, 0.65, 0.8, 0.95)]})
    rows = [[f"{series[i][0]:.1f}", f"{series[i][1]} / {series[i][3]}", f"{series[i][2]} / {series[i][4]}",
             f"{series[i][5]:.1f}" if len(series[i]) > 5 else ""] for i in picks]
    lines += ["Pending and running over time, repetition 1 (llama-server / model, last sample held; the last column "
              "is how old llama-server's held sample is):", "",
              markdown_table(["t (s)", "pending", "running", "llama-server sample age (s)"], rows), ""]
    return lines


def _range(values: Sequence[float | None], fmt: str = "{:+.0%}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo} to {hi}"


def _findings(result: dict[str, Any]) -> list[str]:
    """Where the model is off, computed from the runs."""
    out = []
    fit = result["fit"]
    pf, df = fit["prefill"], fit["decode"]
    def full(row: dict[str, Any], key: str) -> list[float]:
        return row.get("full_core_ms") or row[key]

    spread = [max(r["ttft_ms"]) / min(r["ttft_ms"]) for r in fit["prefill_rows"] if r["ttft_ms"]]
    spread_full = [max(full(r, "ttft_ms")) / min(full(r, "ttft_ms")) for r in fit["prefill_rows"] if r["ttft_ms"]]
    near = abs(pf["intercept_ms"] - df["base_ms"]) <= max(20.0, 0.5 * df["base_ms"])
    out.append(f"Prefill is close to linear in the prompt: the full-core TTFT line's largest residual is "
               f"{pf['max_residual_ms']:.0f} ms and the fitted model's TTFT is "
               f"{_range([_rel(r['model_ms'], _mean(full(r, 'ttft_ms'))) for r in fit['prefill_rows']])} of the "
               f"full-core mean per length. The same prompt's measured TTFT varied by up to "
               f"{max(spread, default=1) - 1:.0%} between passes, its full-core TTFT by up to "
               f"{max(spread_full, default=1) - 1:.0%} (the part explained by waiting for a core is the "
               "difference between the two; the rest is not separated here). "
               f"The line's intercept ({pf['intercept_ms']:.1f} ms: HTTP, tokenizing, sampling) is "
               f"{'close to' if near else 'not close to'} the model's per-step overhead (`decode_base_ms` "
               f"{df['base_ms']:.1f} ms), which the model adds to every prefill step; the model's TTFT uses the slope "
               "and that overhead, not the intercept.")
    dec = fit["decode_rows"]
    errs = [(f"{r['batch']} x {r['prompt_tokens']}-token prompts", _rel(r["model_ms"], _mean(full(r, "gap_ms"))))
            for r in dec]
    by_batch = [(r["batch"], _mean(full(r, "gap_ms"))) for r in dec
                if r["prompt_tokens"] == result["plan"]["decode_prompt"]]
    dips = [f"{b2} streams cost less than {b1}" for (b1, g1), (b2, g2) in zip(by_batch, by_batch[1:])
            if g1 is not None and g2 is not None and g2 < g1]
    out.append("Decode is not a straight line in the batch on this CPU: full-core steps of "
               + ", ".join(f"{_f(g, '{:.1f}')} ms" for _, g in by_batch) + " at "
               + ", ".join(str(b) for b, _ in by_batch) + " streams"
               + (f" ({'; '.join(dips)})" if dips else "") + ", so the fitted step is off by "
               + ", ".join(f"{_f(v, '{:+.0%}')} at {k}" for k, v in errs)
               + ". Probably llama.cpp's CPU kernels change with the number of rows in a batch (matrix-vector "
               "for one, tiled matrix-matrix beyond); one `decode_ms_per_seq` cannot follow that.")
    fit_load = next((w["others_cpu_frac"] for label, w in result["windows"] if label == "fit"), 0.0)
    short = {r["batch"]: _rel(r["model_ms"], _mean(r.get("full_core_ms") or r["gap_ms"])) for r in dec
             if r["prompt_tokens"] == result["plan"]["decode_prompt"]}
    for name, sc in result["scenarios"].items():
        reps = sc["repetitions"]
        loads = [w["others_cpu_frac"] for label, w in result["windows"] if label.startswith(name + " #")]
        p50 = [_rel(r["model"]["ttft_p50_s"], r["real"]["ttft_p50_s"]) for r in reps]
        p90 = [_rel(r["model"]["ttft_p90_s"], r["real"]["ttft_p90_s"]) for r in reps]
        mk = [_rel(r["model"]["makespan_s"], r["real"]["makespan_s"]) for r in reps]
        pend = [r["model"]["pending_mean"] - r["real"]["pending_mean"] for r in reps]
        out.append(f"`{name}`: the model's TTFT p50 is {_range(p50)} and p90 {_range(p90)} off llama-server's, its "
                   f"last completion {_range(mk)}, its mean pending {_range(pend, '{:+.2f}')} requests; peak pending "
                   f"{_range([r['real']['pending_max'] for r in reps], '{:.0f}')} (llama-server) vs "
                   f"{_range([r['model']['pending_max'] for r in reps], '{:.0f}')} (model). Other processes used "
                   f"{_range(loads, '{:.0%}')} of the machine in these windows ({fit_load:.0%} during the fit).")
        busy = [row[2] for r in reps for row in r["series"] if row[2] > 0]  # llama-server's running count
        shares = {b: sum(1 for x in busy if x == b) / len(busy) for b in sorted(set(busy))} if busy else {}
        weighted = [(shares[b], short[b]) for b in shares if short.get(b) is not None]
        if weighted and sum(w for w, _ in weighted) > 0:
            err = sum(w * e for w, e in weighted) / sum(w for w, _ in weighted)
            p50_err = _mean([v for v in p50 if v is not None])
            effect = ("which moves queued requests' TTFT the same way" if p50_err is None
                      or abs(p50_err) >= abs(err) / 2 else
                      f"yet the TTFT p50 is only {p50_err:+.0%} off: another part of the model is faster than the "
                      "server by about as much (this report does not separate prefill, mixed and decode steps "
                      "inside a scenario), so part of this agreement is errors cancelling, not faithful step times")
            out.append(f"`{name}`: while busy, llama-server held " + ", ".join(
                f"{b} request(s) {100 * v:.0f}%" for b, v in shares.items()) + " of the time in its slots; "
                f"weighted by that, the fitted decode step is off by {err:+.0%} (decode table), {effect}.")
        slow = [r.get("slowdown") for r in reps if r.get("slowdown")]
        at_load = [_rel(r["model_at_load"]["ttft_p90_s"], r["real"]["ttft_p90_s"]) for r in reps
                   if "model_at_load" in r]
        if slow and at_load:
            out.append(f"`{name}`: other processes slowed llama-server by {_range(slow, '{:.2f}')}x in these "
                       f"windows (its compute thread waited for a core {_range([1 - 1 / x for x in slow], '{:.0%}')}"
                       f" of its busy time); the model slowed by the same factor is {_range(at_load)} off on TTFT "
                       "p90. What remains is the model's own error and llama-server's run-to-run variation that "
                       "waiting for a core does not explain (its TTFT p90 ranged "
                       f"{_range([r['real']['ttft_p90_s'] for r in reps], '{:.2f}')} s; the model's steps do not "
                       "vary).")
    out.append("The model's own spread comes only from the send times (its step times are fixed); llama-server's "
               "spread is the machine's and its own. Per-request TTFT errors exceed the percentile errors: in a "
               "queue a request's TTFT is the sum of every step before it, so a few percent per step accumulates "
               "along the queue, and a request served in a different order (slot order vs admission order) swaps "
               "TTFTs with another.")
    return out


def _structural(result: dict[str, Any]) -> list[str]:
    """The structural differences between llama-server and the model, with this run's numbers."""
    params = result["fit"]["params"]
    slots, slot_ctx = params["max_num_seqs"], params["max_model_len"]
    chunk = result["fit"].get("chunk") or {}
    if chunk.get("real"):
        real_n, model_n = len(chunk["real"]["stalls_ms"]), len(chunk["model"]["stalls_ms"])
        measured = (f"Measured here (section 2): a {chunk['prompt_tokens']}-token prompt arriving while one stream "
                    f"decodes stalled that stream {real_n} time(s) on llama-server ("
                    + (", ".join(f"{x:.0f}" for x in chunk["real"]["stalls_ms"]) or "-") + f" ms) and {model_n} "
                    "time(s) in the model (" + (", ".join(f"{x:.0f}" for x in chunk["model"]["stalls_ms"]) or "-")
                    + " ms). ")
        if real_n > model_n:
            measured += ("llama-server cut the prompt into more steps than the model's token budget does (in runs "
                         "here with `-ub` 512 and 256 the last `-ub` tokens of a long prompt went in a step of their "
                         "own, the rest before; gemma-3 uses sliding-window attention, for which llama-server keeps "
                         "checkpoints, probably the reason): a decoding stream's longest stall is shorter on the "
                         "server than in the model, and the prompt's TTFT gains one decode step. ")
    else:
        measured = ""
    ages = [row[5] for sc in result["scenarios"].values() for r in sc["repetitions"] for row in r["series"]
            if len(row) > 5 and row[0] < r["real"]["makespan_s"]]
    max_age = max(ages, default=None)
    return [
        "**Slots, not a shared KV pool.** llama-server gives each of its `-np` slots a fixed `-c / -np` context "
        "(`kv_unified = 'false'` in its log): a request either gets a whole slot or is deferred; it never waits for "
        f"KV memory and is never preempted. The fitted model behaves the same only because `kv_cache_tokens` = `-c` "
        f"and `max_model_len` = one slot's context ({slot_ctx}), so {slots} admitted requests always fit. vLLM and "
        "SGLang share one block pool and do run out of KV, which a llama-server cannot show: this calibration checks "
        "the model's slot queueing and step times, not its KV pressure or preemption. A llama-server request longer "
        "than its slot is rejected (or shifted) where vLLM would still take it.",
        "**Pending and running mean different things.** `llamacpp:requests_deferred` counts requests that found no "
        "free slot; `llamacpp:requests_processing` counts every slot with a task, also one whose prompt has not been "
        "scheduled yet. The model's `num_waiting` is vLLM's `num_requests_waiting`; when it counts a request that "
        "holds a slot but has not been prefilled as waiting (vLLM V1 does), it shows more pending than llama-server "
        "during long prefills (the table's last row). The comparison therefore maps the model to llama-server's "
        "meaning (outstanding requests beyond the slots = pending); a balancer reading `requests_deferred` from a "
        "llama-server sees fewer pending requests than from a vLLM in the same state.",
        "**Chunked prefill across slots, in slot order.** A llama-server step takes every generating slot's next "
        "token, then prompt tokens of the slots in slot order (not arrival order) up to `-b` tokens; the model does "
        "the same with `max_num_batched_tokens`, in admission order, so a freed low-numbered slot can take a later "
        "request ahead of one still prefilling in a higher slot. " + measured + "Every decoding stream on the "
        "server waits while a step computes prompt tokens, in both.",
        "**Prompt cache per slot.** llama-server keeps each slot's last prompt and reuses it only for a request that "
        "lands in that slot (it picks the slot by prompt similarity); the model's prefix cache is global, like vLLM's. "
        "These runs switch caching off (`cache_prompt: false`; unique words in the model), so they compare queueing "
        "and step times. With shared prefixes the model would hit more often than a multi-slot llama-server.",
        "**One CPU thread on a shared 2-core machine.** llama-server's steps are compute-bound and slow down with "
        "what else runs (the client's threads, the /metrics poller, other people's tests); the model's steps are "
        "fixed at the fit, and the tables show it also slowed by each window's measured slowdown. "
        + (f"llama-server answered /metrics during long prefills too: while requests were in flight, the sample "
           f"held at any 100 ms grid point was at most {max_age:.1f} s old." if max_age is not None else ""),
    ]


def format_markdown(result: dict[str, Any]) -> str:
    """The calibration report (Markdown): the paper check, the fit, the side-by-side scenarios, the structural
    differences, where the model is off, and the machine's conditions."""
    lines = ["# Engine model calibration", "",
             f"Produced by `skylb bench calibrate` ({result['wall_s']:.0f} s, "
             f"{result.get('started') or time.strftime('%Y-%m-%d %H:%M')}, "
             f"Python {platform.python_version()}). It checks `bench.emulator.model.EngineModel` twice: its default "
             "step times against the SkyLB paper's L4 figure, and its queueing against a real llama-server on this "
             "machine, fitted to that server and sent the same requests. Tests: tests/test_calibrate.py.", ""]
    if result.get("model_source"):
        lines += [f"Engine model measured: {result['model_source']}.", ""]
    lines += _paper_lines(result["paper"])
    if "fit" in result:
        lines += _fit_lines(result)
        lines += ["## 3. Queueing side by side: llama-server and the fitted model, the same requests", "",
                  "Both sides get the same requests (unique prompts of known token length, `ignore_eos`, exact "
                  "output lengths); the model submits each at the time it was really sent and with the prompt "
                  "length llama-server reported. Pending = `llamacpp:requests_deferred` / `num_waiting`, running = "
                  "`llamacpp:requests_processing` / `num_running`, sampled every 100 ms (llama-server: /metrics, "
                  "stamped when the answer arrived). TTFT: send to first streamed token (llama-server, client "
                  "side) / end of the step that sampled it (model).", ""]
        for name, sc in result["scenarios"].items():
            lines += _scenario_lines(name, sc)
        lines += ["## Where the model is off, and why", ""]
        lines += [f"- {x}" for x in _findings(result)] + [""]
        lines += ["Structural differences between llama-server and the model, and what they mean:", ""]
        lines += [f"- {x}" for x in _structural(result)] + [""]
        busy = [label for label, w in result["windows"] if w["others_cpu_frac"] > BUSY_FRACTION]
        lines += conditions_lines(result["load"], result["windows"],
                                  "shared with other people's processes; llama-server ran with one thread "
                                  "(`-t 1`), the client (one thread per request and a /metrics poller) on the rest")
        if busy:
            lines += [f"Windows measured under load (others above {BUSY_FRACTION:.0%} of the machine): "
                      f"{', '.join(busy)}. llama-server's steps there are slower than on an idle machine when it has "
                      "to wait for a core: the fit divides every probe by its slowdown, and the scenario tables "
                      "give the model slowed by each repetition's slowdown beside the plain fitted one.", ""]
        lines += ["Others' CPU time is the machine's busy time (/proc/stat) less llama-server's and this benchmark's "
                  "own, so short test runs that started and ended inside a window count too. Per window, "
                  "llama-server / the client (this process) used: " + "; ".join(
                      f"{label}: {w['server_cpu_s']:.0f} / {w['client_cpu_s']:.1f} CPU-s in {w['wall_s']:.0f} s"
                      for label, w in result["windows"]) + ". llama-server runs one thread: less CPU-s than "
                  "seconds in a window is time it waited (for requests, or for a core).", ""]
    elif result.get("unavailable"):
        lines += [f"The llama-server part did not run: {result['unavailable']}", ""]
    lines += ["## Reproduce", "", "```",
              "skylb bench calibrate            # about 3-4 minutes on 2 cores, longer when the machine is busy",
              "skylb bench calibrate --repeats 5 --out-json /tmp/calibration.json", "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live.calibrate` (`skylb bench calibrate`)."""
    p = argparse.ArgumentParser(prog="skylb bench calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each scenario (default 3, at most 10)")
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots, -np (default 4)")
    p.add_argument("--ctx-size", type=int, default=4096, help="llama-server context of all slots, -c (default 4096)")
    p.add_argument("--threads", type=int, default=1, help="llama-server CPU threads, -t (default 1)")
    p.add_argument("--binary", default=None, help="llama-server binary (default: the cached build)")
    p.add_argument("--model", default=None, help="GGUF model (default: gemma-3-270m from its package)")
    p.add_argument("--out-md", default="bench/results/calibration.md", help="Markdown report ('' for none)")
    p.add_argument("--out-json", default=None, help="also write the raw result as JSON here")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: write the report of a run saved earlier with --out-json")
    return p


def _model_source() -> str:
    """Which engine model ran: bench/emulator/model.py's last commit, and whether the working tree changed it."""
    import subprocess
    path = Path(EngineModel.__module__.replace(".", "/") + ".py")
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "log", "-1", "--format=%h %s", "--", str(path)], cwd=root, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(path)], cwd=root,
                               timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return ""
    if not commit:
        return ""
    sha, _, subject = commit.partition(" ")
    subject = subject if len(subject) <= 90 else subject[:87] + "..."
    return (f"`{path}` as of commit {sha} (\"{subject}\")"
            + (" plus uncommitted changes in the working tree" if dirty else ""))


def main(argv: list[str] | None = None) -> int:
    """Run the calibration and write the report; 0 when every request completed, 1 otherwise, 2 when no
    llama-server can run here (the report then holds the paper check only)."""
    from bench.launch.llamacpp import LlamaCppUnavailable
    args = build_parser().parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        # A result saved before provenance was recorded must not be stamped with today's commit and machine.
        saved.setdefault("provenance", {"commit": "not recorded", "date": "not recorded", "command": "not recorded",
                                        "machine": {}})
        emit_markdown(format_markdown(saved), saved, out_md=args.out_md or None, out_json=None)
        return 0
    if not 1 <= args.repeats <= 10:
        raise SystemExit("--repeats must be between 1 and 10")
    t_start = time.monotonic()
    result: dict[str, Any] = {"paper": paper_check(), "model_source": _model_source(),
                              "started": time.strftime("%Y-%m-%d %H:%M")}
    whole = MachineLoad().start()

    def say(text: str) -> None:
        print(f"[calibrate {time.monotonic() - t_start:5.0f} s] {text}", file=sys.stderr, flush=True)

    try:
        with llama_server(parallel=args.parallel, ctx_size=args.ctx_size, threads=args.threads,
                          binary=args.binary, model_path=args.model) as server:
            say(f"llama-server ready at {server['url']} ({server['total_slots']} slots)")
            result |= calibrate(server, slots=server["total_slots"], ctx_size=args.ctx_size, repeats=args.repeats,
                                progress=say)
            result["threads"] = args.threads
    except LlamaCppUnavailable as exc:
        result["unavailable"] = str(exc)
        print(f"skylb bench calibrate: no llama-server here ({exc}); writing the paper check only", file=sys.stderr)
    result["load"] = whole.stop()
    result["wall_s"] = time.monotonic() - t_start
    result["paper"]["decode_ms"] = {str(k): v for k, v in result["paper"]["decode_ms"].items()}
    emit_markdown(format_markdown(result), result, out_md=args.out_md or None, out_json=args.out_json)
    if result.get("unavailable"):
        return 2
    failed = sum(r["real"]["failed"] for sc in result["scenarios"].values() for r in sc["repetitions"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
