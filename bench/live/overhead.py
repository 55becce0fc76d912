"""The balancer's own cost: added latency, highest sustained request rate, SSE relay rate, routing decision time and
the memory of a full prefix trie, with HAProxy and the SGLang router measured beside SkyLB where that makes sense.

Entry points:

* ``.venv/bin/python -m bench.live.overhead [--parts a b c d e] [--out-md bench/results/overhead.md]
  [--out-json bench/results/overhead.json] [--quick]``; :func:`main` ``(argv) -> int`` is the same for a
  ``skylb bench overhead`` subcommand. Both files carry the run's provenance (commit, date, command, machine).
* ``.venv/bin/python -m bench.live.overhead --tracing [--rounds 3] [--n 300] [--baseline CHECKOUT]``: tracing's cost
  instead (:func:`tracing_cost`, :func:`format_tracing`): part (a) with tracing off and on, beside a twin of the
  balancer (the noise floor) and optionally another checkout; printed, written only where ``--out-md`` says.
* One function per part, each returning a JSON-ready dict: :func:`added_latency` (a), :func:`max_rate` (b, and
  with ``stream`` the streamed requests of c), :func:`sse_rate` (c), :func:`decision_time` (d, in-process, no
  I/O), :func:`trie_memory` (e, in a child process); :func:`run_overhead` runs the chosen parts,
  :func:`targets` judges them and :func:`format_markdown` renders the report.

Targets (from the issue, :func:`targets`): p50 added latency <= 1 ms and <= 1.5 x the SGLang router's, measured in
the same interleaved rounds; routing decision p99 <= 1 ms at 32k-token prompts with a full trie, alone and with 64
such prompts queued. They are reported as measured, never tuned for.

"Through a balancer" systems: ``direct`` (the client calls the replica), SkyLB with its default config
(``skylb``: probe every 100 ms, each replica's batch learned from its probes, no dispatch ceiling), HAProxy
(``roundrobin``) and the SGLang router (``cache_aware``, its default).
Every process of a part is stopped when the part ends, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import http.client
import io
import json
import os
import pstats
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import aiohttp
from tqdm import tqdm

from bench.live.baselines import SYSTEMS
from bench.live.harness import now_label
from bench.launch.launchers import (MODEL, System, Unavailable, start_emulator, start_skylb, start_system,
                             unavailable_reason, versions, warm_up)
from bench.replay.report import emit_markdown, markdown_table, percentile
from bench.replay.sampling import MachineLoad, conditions_lines
from bench.replay.workload import VOCABULARY
from skylb.config import BalancerConfig
from skylb.core import Request, Router, build_policy, build_router
from skylb.core.plugins.scoring import trie_key
from skylb.core.policies.skylb_paper import SkyLBPaperOptions
from bench.launch.procs import Proc, ProcGroup, free_ports

#: The shipped default of the ``skylb`` policy's ``trie_chunk_chars``, so part (d) measures what users run.
DEFAULT_CHUNK_CHARS = SkyLBPaperOptions().trie_chunk_chars
#: ... and of its ``trie_chunk_doubling`` (chunks double in length after every this many).
DEFAULT_CHUNK_DOUBLING = SkyLBPaperOptions().trie_chunk_doubling


def _settings(trie_max_chars: int, chunk_chars: int, **overrides) -> BalancerConfig:
    """The balancer's default settings with the ``skylb`` policy's trie bound and chunk size set."""
    return BalancerConfig(policies={"skylb": {"trie_max_chars": trie_max_chars, "trie_chunk_chars": chunk_chars}},
                          **overrides)

__all__ = [
    "OVERHEAD_SYSTEMS", "RATES", "STREAM_RATES", "added_latency", "balancer_profile", "max_rate", "sse_rate",
    "decision_time", "targets",
    "chunk_whatif", "GcPauses", "trie_memory", "conversation_words", "fill_trie", "rss_kib", "run_overhead",
    "format_markdown", "main", "tracing_cost", "format_tracing",
]

#: The systems of parts (a)-(c), by name; "direct" means no balancer.
OVERHEAD_SYSTEMS: dict[str, System | None] = {
    "direct": None,
    "skylb": SYSTEMS["skylb"],
    "haproxy": SYSTEMS["haproxy-roundrobin"],
    "sglang": SYSTEMS["sglang-cache_aware"],
}
#: Emulated durations x this in parts (a)-(c): a replica that answers at once (the model's floor is a few us).
FAST_TIME_SCALE = 1e-4
#: Words per user turn appended to a known conversation in part (d): the new text the trie has not seen.
NEW_TURN_WORDS = 100
#: Shared system prompt of every conversation in part (d) (words).
SYSTEM_PROMPT_WORDS = 500

_Progress = Callable[[str], None]


def _say(msg: str) -> None:
    print(f"[bench.live.overhead] {msg}", file=sys.stderr, flush=True)


def _start(procs: ProcGroup, name: str, replica_urls: list[str], run_dir: Path) -> tuple[str, Proc | None]:
    """Start system ``name`` of OVERHEAD_SYSTEMS in front of ``replica_urls``: (URL, the balancer's process or
    None). ``Proc.cpu_seconds`` counts its whole process group (HAProxy's and the SGLang router's children too)."""
    system = OVERHEAD_SYSTEMS[name]
    if system is None:
        return replica_urls[0], None
    url = start_system(procs, System(name, system.kind, system.policy, system.skylb_overrides), replica_urls,
                       run_dir=run_dir)
    # The balancer is the newest process of the group (SkyLB starts its controller first).
    return url, procs.procs[-1]


def _available(names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(names that can run here, {name: why not} for the others)."""
    ok, skipped = [], {}
    for name in names:
        system = OVERHEAD_SYSTEMS[name]
        reason = unavailable_reason(system.kind) if system is not None else None
        if reason:
            skipped[name] = reason
        else:
            ok.append(name)
    return ok, skipped


def _prompt(i: int, words: int = 48) -> str:
    """A small prompt: a fixed shared prefix and a request number (so prefix tries see distinct prompts)."""
    return " ".join(VOCABULARY[:words]) + f" request {i}"


# ------------------------------------------------------------------------------------------ (a) added latency


def added_latency(*, n: int = 500, systems: Sequence[str] = tuple(OVERHEAD_SYSTEMS), run_dir: Path,
                  warmup: int = 20, checkouts: dict[str, Path] | None = None,
                  variants: dict[str, dict] | None = None, floor: bool = True) -> dict[str, Any]:
    """Part (a): latency of small non-streamed completions, direct and through each balancer.

    ``floor``: also run system ``aiohttp``, bench/live/aiohttp_floor.py (a pass-through aiohttp proxy on uvloop with no
    routing, metrics or logs): what Python and aiohttp cost by themselves, so SkyLB's own work per request is the
    gap between the two.

    ``checkouts``: {name: path} of other SkyLB checkouts (earlier commits) whose balancer, in its default
    configuration, runs beside this one's as system ``name`` (an A/B comparison, interleaved like the rest).
    ``variants``: {name: balancer settings} of more balancers of this checkout, each with those settings laid over
    the defaults (tracing on, say), run beside the rest as system ``name``.

    One emulated replica (time scale :data:`FAST_TIME_SCALE`, so it answers in about a millisecond); ``n``
    sequential requests per system over one keep-alive connection each (``http.client``), interleaved: request
    i goes to every system in turn, so a burst of machine load hits all systems alike. ``max_tokens`` 1, a
    ~50-word prompt. Returns ``{"n", "systems": {name: {"p50_ms", "p99_ms", "mean_ms", "errors",
    "added_p50_ms", "added_p99_ms", "cpu_ms_per_request", "added_p50_vs_sglang"}}, "skipped": {name: reason},
    "load"}``; added = the system's percentile minus the direct one's; ``cpu_ms_per_request``: the CPU time of the
    balancer's process group over the measured requests (its own background work, probes, included) per request;
    ``added_p50_vs_sglang`` (SkyLB systems): its added p50 over the SGLang router's, measured in the same rounds.
    """
    names, skipped = _available(systems)
    if "direct" not in names:
        names.insert(0, "direct")
    load = MachineLoad().start()
    with ProcGroup(Path(run_dir) / "a-logs") as procs:
        replicas = start_emulator(procs, free_ports(1), time_scale=FAST_TIME_SCALE, max_num_seqs=256,
                                  name="a-emulator")
        started = {name: _start(procs, name, replicas, Path(run_dir) / "a") for name in names}
        urls = {name: url for name, (url, _) in started.items()}
        balancers = {name: proc for name, (_, proc) in started.items() if proc is not None}
        if floor:
            port = free_ports(1)[0]
            urls["aiohttp"] = f"http://127.0.0.1:{port}"
            balancers["aiohttp"] = procs.start(
                [sys.executable, str(Path(__file__).with_name("aiohttp_floor.py")), "--port", str(port),
                 "--upstream", replicas[0]], name="a-aiohttp-floor", wait_url=urls["aiohttp"] + "/healthz")
            names.append("aiohttp")
        extra = [(name, {"checkout": path}) for name, path in (checkouts or {}).items()]
        extra += [(name, {"overrides": overrides}) for name, overrides in (variants or {}).items()]
        for name, how in extra:
            urls[name] = start_skylb(procs, replicas, run_dir=Path(run_dir) / "a", name=name, **how)
            balancers[name] = procs.procs[-1]
            warm_up(urls[name])
            names.append(name)
        conns = {name: http.client.HTTPConnection(url.removeprefix("http://"), timeout=10) for name, url in
                 urls.items()}
        lat: dict[str, list[float]] = {name: [] for name in names}
        errors = {name: 0 for name in names}
        cpu0: dict[str, float] = {}
        try:
            for i in tqdm(range(warmup + n), desc="(a) added latency", unit="round", file=sys.stderr,
                          disable=not sys.stderr.isatty()):
                if i == warmup:
                    cpu0 = {name: proc.cpu_seconds() for name, proc in balancers.items()}
                order = names[:]
                random.Random(i).shuffle(order)  # no system always goes first after the others warmed caches
                for name in order:
                    ms = _timed_completion(conns[name], i)
                    if ms is None:
                        errors[name] += 1
                        conns[name] = http.client.HTTPConnection(urls[name].removeprefix("http://"), timeout=10)
                    elif i >= warmup:
                        lat[name].append(ms)
            cpu = {name: proc.cpu_seconds() - cpu0.get(name, 0.0) for name, proc in balancers.items()}
        finally:
            for c in conns.values():
                c.close()
    base = lat["direct"]
    out = {}
    for name in names:
        v = lat[name]
        out[name] = {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99),
                     "mean_ms": sum(v) / len(v) if v else None, "errors": errors[name], "n": len(v),
                     "cpu_ms_per_request": 1000.0 * cpu[name] / len(v) if name in cpu and v else None}
        if v and base:
            out[name]["added_p50_ms"] = percentile(v, 50) - percentile(base, 50)
            out[name]["added_p99_ms"] = percentile(v, 99) - percentile(base, 99)
    sglang = (out.get("sglang") or {}).get("added_p50_ms")
    for name, row in out.items():
        if name.startswith("skylb") or name == "aiohttp" or name in (checkouts or {}) or name in (variants or {}):
            row["added_p50_vs_sglang"] = (row["added_p50_ms"] / sglang if sglang and sglang > 0
                                          and row.get("added_p50_ms") is not None else None)
    return {"n": n, "systems": out, "skipped": skipped, "load": load.stop()}


def tracing_cost(*, n: int = 300, rounds: int = 3, run_dir: Path, baseline: Path | None = None) -> dict[str, Any]:
    """What tracing costs a request: ``rounds`` interleaved runs of part (a) (:func:`added_latency`, ``n`` requests
    per system per round) through ``skylb`` (this checkout, tracing off: the default), ``skylb-twin`` (the same
    again: the spread between two identical balancers, the smallest difference this can measure), ``skylb-tracing``
    (tracing on, every request recorded: four spans, exported over OTLP/HTTP to a receiver process,
    bench/launch/otlp_sink.py) and, given ``baseline`` (another checkout, e.g. one from before tracing existed), its balancer
    as ``skylb@<commit>``. Returns ``{"n", "rounds": [part (a) results], "spans": spans the receiver decoded,
    "baseline": its system name or None}``."""
    run_dir = Path(run_dir)
    base = None
    if baseline is not None:
        commit = subprocess.run(["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "baseline"
        base = f"skylb@{commit}"
    with ProcGroup(run_dir / "sink-logs") as procs:
        [port] = free_ports(1)
        procs.start([sys.executable, "-m", "bench.launch.otlp_sink", "--port", str(port)], name="otlp-sink",
                    wait_url=f"http://127.0.0.1:{port}/")
        variants = {"skylb-twin": {}, "skylb-tracing": {"tracing": {"otlp_endpoint": f"http://127.0.0.1:{port}"}}}
        results = [added_latency(n=n, systems=("direct", "skylb"), floor=False, run_dir=run_dir / f"round-{i}",
                                 variants=variants, checkouts={base: baseline} if base else None)
                   for i in range(rounds)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
            spans = json.loads(resp.read())["spans"]
    return {"n": n, "rounds": results, "spans": spans, "baseline": base}


def format_tracing(result: dict[str, Any]) -> str:
    """The Markdown report of :func:`tracing_cost`: each round's added p50 and p99 per system, then the differences
    that matter over the rounds (median [min, max], ms)."""
    base, rounds = result["baseline"], result["rounds"]
    names = ["skylb", "skylb-twin", "skylb-tracing", *([base] if base else [])]
    rows = [[i, f"{r['systems']['direct']['p50_ms']:.3f}",
             *(f"{r['systems'][name]['added_p50_ms']:.3f} / {r['systems'][name]['added_p99_ms']:.3f} / "
               f"{r['systems'][name]['cpu_ms_per_request']:.3f}" for name in names),
             sum(r["systems"][name]["errors"] for name in names)]
            for i, r in enumerate(rounds)]
    lines = ["# Tracing's cost: added latency with tracing off and on", "",
             f"{len(rounds)} rounds of part (a), {result['n']} small non-streamed completions per system per "
             f"round, interleaved; added = the system's percentile minus the direct one's (ms); CPU = the "
             f"balancer's CPU time per request (ms). Spans received by the OTLP receiver: {result['spans']}.", "",
             markdown_table(["round", "direct p50 ms", *(f"{name} added p50 / p99 / CPU" for name in names),
                             "errors"], rows), ""]
    pairs = [("skylb-twin", "skylb", "two identical balancers, tracing off (the noise)"),
             ("skylb-tracing", "skylb", "tracing on minus off"),
             *([("skylb", base, f"tracing off minus {base}")] if base else [])]
    for a, b, what in pairs:
        for q in ("p50", "p99"):
            diffs = [r["systems"][a][f"added_{q}_ms"] - r["systems"][b][f"added_{q}_ms"] for r in rounds]
            lines.append(f"- {what}, {q}: {statistics.median(diffs):+.3f} [{min(diffs):+.3f}, {max(diffs):+.3f}] ms")
        cpu = [r["systems"][a]["cpu_ms_per_request"] - r["systems"][b]["cpu_ms_per_request"] for r in rounds]
        lines.append(f"- {what}, CPU per request: {statistics.median(cpu):+.3f} [{min(cpu):+.3f}, {max(cpu):+.3f}] ms")
    return "\n".join(lines) + "\n"


def _timed_completion(conn: http.client.HTTPConnection, i: int) -> float | None:
    """Time one non-streamed completion on ``conn`` (ms), or None when it failed."""
    body = json.dumps({"model": MODEL, "prompt": _prompt(i), "max_tokens": 1, "stream": False}).encode()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        ms = (time.perf_counter() - t0) * 1000.0
    except (OSError, http.client.HTTPException):
        conn.close()
        return None
    return ms if resp.status == 200 else None


def balancer_profile(*, n: int = 2000, run_dir: Path, top: int = 18) -> dict[str, Any]:
    """Where a SkyLB balancer's CPU goes on part (a)'s requests: cProfile (CPU-time clock) of the balancer process.

    Starts SkyLB (its default configuration) under cProfile in front of one
    fast emulated replica, sends ``n`` sequential small non-streamed completions, stops the balancer (SIGTERM,
    so cProfile writes its file) and returns ``{"n", "text": the top ``top`` entries by own time, "total_s"}``.
    """
    run_dir = Path(run_dir) / "profile"
    run_dir.mkdir(parents=True, exist_ok=True)
    prof_path = run_dir / "balancer.prof"
    with ProcGroup(run_dir / "logs") as procs:
        replicas = start_emulator(procs, free_ports(1), time_scale=FAST_TIME_SCALE, max_num_seqs=256,
                                  name="p-emulator")
        url = start_skylb(procs, replicas, run_dir=run_dir, name="profiled", profile_to=prof_path)
        balancer = procs.procs[-1]
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        try:
            for i in range(50):  # warm-up, not profiled
                _timed_completion(conn, i)
            os.kill(balancer.popen.pid, signal.SIGUSR1)  # start profiling
            time.sleep(0.2)
            for i in range(n):
                _timed_completion(conn, i)
        finally:
            conn.close()
        balancer.stop()  # SIGTERM: the balancer exits cleanly and the profiler writes its file
    buf = io.StringIO()
    stats = pstats.Stats(str(prof_path), stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    own = _pstats_table(buf.getvalue())
    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("cumulative").print_stats(r"skylb/(balancer|core)/", top)
    return {"n": n, "text": own, "skylb_cumulative": _pstats_table(buf.getvalue()), "total_s": stats.total_tt}


def _pstats_table(text: str) -> str:
    """pstats output without its header lines, paths shortened."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lines = [ln.replace(stdlib, "<stdlib>").replace(str(Path(sys.prefix)), "<venv>").replace(str(Path.cwd()) + "/", "")
             for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    head = next((ln.strip() for ln in lines if "function calls" in ln), "")
    return "\n".join([head, *lines[start:]])


# ---------------------------------------------------------------------------------------------- (b) max rate


#: Part (b)'s ramp: offered request rates, requests/s.
RATES = (50, 100, 200, 300, 400, 600, 800, 1200, 1600, 2400)
#: Part (c)'s ramp of streamed requests, requests/s.
STREAM_RATES = (50, 100, 200, 300, 400, 600, 800, 1200, 1600)
#: Tokens of each streamed completion of part (c)'s ramp (one SSE event each, then ``data: [DONE]``).
STREAM_TOKENS = 16
#: The systems of part (c)'s streamed ramp.
STREAM_SYSTEMS = ("direct", "skylb", "haproxy", "sglang")


def max_rate(*, systems: Sequence[str] = tuple(OVERHEAD_SYSTEMS), rates: Sequence[int] = RATES,
             step_s: float = 3.0, replicas: int = 4, stream: bool = False, max_tokens: int = 1,
             run_dir: Path, p99_limit_ms: float = 500.0, error_limit: float = 0.01) -> dict[str, Any]:
    """Part (b): the highest request rate one balancer process sustains (open loop, stepped ramp); with
    ``stream``, part (c)'s ramp of streamed requests.

    ``replicas`` fast emulated replicas (one process, ``--max-num-seqs 1024``, so they never queue). For each
    system the client sends completions of ``max_tokens`` tokens (streamed when ``stream``: a request counts once
    its whole stream, to ``data: [DONE]``, arrived without an error event) at each rate of ``rates`` (requests/s,
    evenly spaced) for ``step_s`` s, and stops at the first step that is not sustained: more than ``error_limit``
    of requests failed, the p99 latency (to the end of the answer) exceeded ``p99_limit_ms``, or fewer than 95% of
    the offered requests per second completed. Direct calls spread over the replicas round robin (the client and
    emulator ceiling). Returns ``{"systems": {name: {"sustained_rps", "steps": [{"rate", "sent", "ok", "errors",
    "achieved_rps", "p50_ms", "p99_ms", "send_lag_p99_ms", "balancer_cpu_ms_per_req"}]}}, "skipped", "load",
    "stream", "max_tokens", ...}``; ``balancer_cpu_ms_per_req``: the CPU of the balancer's process group during the
    step per completed request.
    """
    names, skipped = _available(systems)
    load = MachineLoad().start()
    out: dict[str, Any] = {}
    for name in names:
        with ProcGroup(Path(run_dir) / f"b-{name}-logs") as procs:
            urls = start_emulator(procs, free_ports(replicas), time_scale=FAST_TIME_SCALE, max_num_seqs=1024,
                                  name=f"b-{name}-emulator")
            url, balancer = _start(procs, name, urls, Path(run_dir) / "b")
            targets = urls if name == "direct" else [url]
            steps, sustained = [], 0
            for rate in rates:
                cpu0 = balancer.cpu_seconds() if balancer else 0.0
                step = asyncio.run(_open_loop_step(targets, rate, step_s, stream=stream, max_tokens=max_tokens))
                if balancer:
                    step["balancer_cpu_ms_per_req"] = ((balancer.cpu_seconds() - cpu0) * 1000.0 / step["ok"]
                                                       if step["ok"] else None)
                steps.append(step)
                ok = (step["errors"] <= error_limit * step["sent"] and step["p99_ms"] is not None
                      and step["p99_ms"] <= p99_limit_ms and step["achieved_rps"] >= 0.95 * rate)
                _say(f"({'c, streamed' if stream else 'b'}) {name} @ {rate}/s: achieved {step['achieved_rps']:.0f}/s, p99 "
                     f"{step['p99_ms'] or 0:.0f} ms, errors {step['errors']} -> {'ok' if ok else 'not sustained'}")
                if not ok:
                    break
                sustained = rate
            out[name] = {"sustained_rps": sustained, "steps": steps}
    return {"systems": out, "skipped": skipped, "rates": list(rates), "step_s": step_s, "replicas": replicas,
            "p99_limit_ms": p99_limit_ms, "error_limit": error_limit, "stream": stream, "max_tokens": max_tokens,
            "load": load.stop()}


async def _open_loop_step(targets: list[str], rate: int, step_s: float, timeout_s: float = 10.0, *,
                          stream: bool = False, max_tokens: int = 1) -> dict:
    """Send ``rate`` x ``step_s`` requests at evenly spaced times; the step's figures (see :func:`max_rate`)."""
    n = max(1, int(rate * step_s))
    lat: list[float] = []
    lags: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = loop.time() + 0.05

        async def one(k: int) -> None:
            nonlocal errors
            due = t0 + k / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            start = loop.time()
            lags.append((start - due) * 1000.0)
            body = {"model": MODEL, "prompt": _prompt(k), "max_tokens": max_tokens, "stream": stream}
            try:
                async with s.post(f"{targets[k % len(targets)]}/v1/completions", json=body) as resp:
                    data = await resp.read()
                    whole = not stream or (data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data)
                    if resp.status != 200 or not whole:
                        errors += 1
                        return
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                return
            lat.append((loop.time() - start) * 1000.0)

        await asyncio.gather(*(one(k) for k in range(n)))
        wall = loop.time() - t0
    return {"rate": rate, "sent": n, "ok": len(lat), "errors": errors, "achieved_rps": len(lat) / wall,
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "send_lag_p99_ms": percentile(lags, 99)}


# -------------------------------------------------------------------------------------------- (c) SSE relay


def sse_rate(*, systems: Sequence[str] = tuple(OVERHEAD_SYSTEMS), streams: int = 16, duration_s: float = 5.0,
             run_dir: Path) -> dict[str, Any]:
    """Part (c): SSE chunks per second relayed to the client, direct and through each balancer.

    One fast emulated replica (``--max-num-seqs 256``) streams ``streams`` concurrent completions of 4000
    tokens each (restarted when one ends); the client counts ``data:`` events received during ``duration_s``
    s after a 1 s warm-up. The emulator, the balancer and the client share the machine's cores, so the direct
    figure is the ceiling the setup allows. Returns ``{"systems": {name: {"chunks_per_s",
    "balancer_cpu_us_per_chunk"}}, "skipped", "streams", "duration_s", "load"}``.
    """
    names, skipped = _available(systems)
    load = MachineLoad().start()
    out = {}
    for name in names:
        with ProcGroup(Path(run_dir) / f"c-{name}-logs") as procs:
            urls = start_emulator(procs, free_ports(1), time_scale=FAST_TIME_SCALE, max_num_seqs=256,
                                  name=f"c-{name}-emulator")
            url, balancer = _start(procs, name, urls, Path(run_dir) / "c")
            result = asyncio.run(_count_chunks(url, streams, duration_s, balancer))
            out[name] = result
            _say(f"(c) {name}: {result['chunks_per_s']:.0f} chunks/s")
    return {"systems": out, "skipped": skipped, "streams": streams, "duration_s": duration_s, "load": load.stop()}


async def _count_chunks(url: str, streams: int, duration_s: float, balancer: Proc | None,
                        warmup_s: float = 1.0) -> dict:
    loop = asyncio.get_running_loop()
    start = loop.time()
    t_begin, t_end = start + warmup_s, start + warmup_s + duration_s
    counted = 0
    cpu = {}
    body = {"model": MODEL, "prompt": _prompt(0), "max_tokens": 4000, "ignore_eos": True, "stream": True}
    timeout = aiohttp.ClientTimeout(total=duration_s + warmup_s + 30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def reader() -> None:
            nonlocal counted
            while loop.time() < t_end:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    tail = b""
                    async for data in resp.content.iter_any():
                        buf = tail + data
                        # Count event starts; keep the last 5 bytes so a "data:" split across reads counts once.
                        n = buf.count(b"data:") - tail.count(b"data:")
                        tail = buf[-5:]
                        now = loop.time()
                        if t_begin <= now < t_end:
                            counted += n
                        elif now >= t_end:
                            break

        async def cpu_marks() -> None:
            await asyncio.sleep(max(0.0, t_begin - loop.time()))
            cpu["begin"] = balancer.cpu_seconds() if balancer else 0.0
            await asyncio.sleep(max(0.0, t_end - loop.time()))
            cpu["end"] = balancer.cpu_seconds() if balancer else 0.0

        await asyncio.gather(cpu_marks(), *(reader() for _ in range(streams)))
    rate = counted / duration_s
    per_chunk = ((cpu["end"] - cpu["begin"]) * 1e6 / counted) if balancer and counted else None
    return {"chunks_per_s": rate, "balancer_cpu_us_per_chunk": per_chunk, "chunks": counted}


# ----------------------------------------------------------------------------------------- (d) decision time


def conversation_words(conversation: int, words: int, *, seed: int = 0) -> list[str]:
    """The word stream of one synthetic conversation: a shared system prompt, then its own words.

    ``words`` words in all (tokens: one word = one token, the workload convention); the first
    :data:`SYSTEM_PROMPT_WORDS` are the same for every conversation, so prompts share a prefix the way chat
    prompts share a system prompt. Every turn of a conversation is a prefix of this stream.
    """
    system = random.Random(f"{seed}:system").choices(VOCABULARY, k=SYSTEM_PROMPT_WORDS)
    own = random.Random(f"{seed}:conv:{conversation}").choices(VOCABULARY, k=max(0, words - SYSTEM_PROMPT_WORDS))
    return (system + own)[:words]


#: Turn lengths (words) recorded for each conversation while filling a trie: a conversation growing turn by turn.
FILL_TURNS = (1000, 2000, 4000, 8000, 16000, 32000)


def fill_trie(trie, fraction: float, *, targets: Sequence[str], first_conversation: int = 0,
              stream_words: int = 32000 + NEW_TURN_WORDS, seed: int = 0) -> list[int]:
    """Insert conversations into ``trie`` (a PrefixTrie) until it stores ``fraction`` of its ``max_chars``.

    Each conversation is recorded at every length of :data:`FILL_TURNS` below ``stream_words`` and at
    ``stream_words``, as its turns would be, to target ``targets[conversation % len(targets)]``. At
    ``fraction >= 1`` it goes on until the trie has evicted records (the steady state of a full trie: the bound
    is never exceeded, so "stored == max_chars" may never happen). Returns the conversation numbers inserted,
    oldest first.
    """
    goal = min(fraction, 1.0) * trie.max_chars
    inserted: list[int] = []
    records = 0
    c = first_conversation
    while True:
        full = len(trie) < records  # something was evicted
        if (fraction >= 1.0 and full) or (fraction < 1.0 and trie.stored_chars >= goal):
            return inserted
        words = conversation_words(c, stream_words, seed=seed)
        target = targets[c % len(targets)]
        for n in (*(t for t in FILL_TURNS if t < stream_words), stream_words):
            trie.insert(trie.chunks(" ".join(words[:n])), target)
            records += 1
        inserted.append(c)
        c += 1


class GcPauses:
    """Records the garbage collector's pauses while active (a context manager on ``gc.callbacks``).

    ``pauses``: (generation, ms) of every collection that ran inside the ``with`` block.
    """

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0: int | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0 is not None:
            self.pauses.append((info.get("generation", -1), (time.perf_counter_ns() - self._t0) / 1e6))
            self._t0 = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, Any]:
        """``{"gc_runs", "gc_max_ms", "gc_total_ms", "gc_gen2_runs"}`` over the recorded pauses."""
        ms = [p for _, p in self.pauses]
        return {"gc_runs": len(ms), "gc_max_ms": max(ms, default=0.0), "gc_total_ms": sum(ms),
                "gc_gen2_runs": sum(1 for g, _ in self.pauses if g == 2)}


def _router(trie_max_chars: int, replicas: int, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Router:
    """A routing core with the "skylb" policy and ``replicas`` always-available local replicas."""
    router = build_router("us", _settings(trie_max_chars, chunk_chars, max_dispatch_per_probe=0))
    router.set_replicas([(f"r{i}", f"http://r{i}", "vllm") for i in range(replicas)])
    for i in range(replicas):
        router.observe_replica(f"r{i}", now=0.0, healthy=True, pending=0)
    return router


def _time_dispatch(router: Router, text: str, k: int) -> float:
    """Time one enqueue + dispatch of a fresh request with prompt ``text`` (ms); releases its decision."""
    req = Request(id=f"q{k}", text=text, arrived_at=0.1)
    t0 = time.perf_counter_ns()
    router.enqueue(req)
    decisions = router.dispatch(0.1)
    dt = (time.perf_counter_ns() - t0) / 1e6
    for d in decisions:
        router.finished(d)
    return dt


def decision_time(*, lengths: Sequence[int] = (1000, 4000, 8000, 16000, 32000),
                  fills: Sequence[float] = (0.0, 0.5, 1.0), trie_max_chars: int = 8_000_000, replicas: int = 4,
                  samples: Callable[[int], int] | None = None, seed: int = 0, profile: bool = True,
                  chunk_chars: int = DEFAULT_CHUNK_CHARS, progress: _Progress = _say) -> dict[str, Any]:
    """Part (d): time of ``Router.dispatch`` with the "skylb" policy, in-process, by prompt length and trie fill.

    For each fill fraction a router is built and its replica trie filled (:func:`fill_trie`) to that fraction
    of ``trie_max_chars``. A sample is one fresh request (its prompt not chunked yet) enqueued and dispatched:
    at fill 0 on an empty trie; otherwise the next turn of a conversation already in the trie (its first
    L - :data:`NEW_TURN_WORDS` words seen, then a new user turn), so the match walks almost the whole prompt
    and the insert adds the new turn. Column "new" (at the full trie only): a new conversation sharing only the
    system prompt, whose insert makes the trie evict old records. Lengths are in words (= tokens, about 5
    characters each). ``samples(L)`` gives the samples per cell (default 200 up to 4k, 60 to 16k, 30 above).
    ``chunk_chars``: characters per trie node (the balancer's ``trie_chunk_chars``; default: the config's).
    Returns ``{"cells": {f"{L}@{fill}": {"p50_ms", "p99_ms", "mean_ms", "n", "fill_before", "fill_after",
    "gc_runs", "gc_max_ms", "gc_total_ms", "gc_gen2_runs"}}, "fill_s": {fill: s}, "profile": top cProfile
    entries of the longest prompts' dispatches at the full trie, "load", ...}``. The gc_* figures are the
    garbage collector's pauses during the cell's samples (they explain most of the p99).
    """
    load = MachineLoad().start()
    samples = samples or (lambda L: 200 if L <= 4000 else 60 if L <= 16000 else 30)
    cells: dict[str, Any] = {}
    fill_s = {}
    longest = max(lengths)
    stream_words = longest + NEW_TURN_WORDS
    profile_text = None
    for fill in fills:
        t0 = time.monotonic()
        router = _router(trie_max_chars, replicas, chunk_chars)
        trie = router.policy.replica_trie
        targets = [f"r{i}" for i in range(replicas)]
        convs = fill_trie(trie, fill, targets=targets, stream_words=stream_words, seed=seed) if fill > 0 else []
        fill_s[str(fill)] = time.monotonic() - t0
        progress(f"(d) trie filled to {trie.stored_chars / trie_max_chars:.0%} of {trie_max_chars:,} chars "
                 f"({len(convs)} conversations, {trie.nodes:,} nodes) in {fill_s[str(fill)]:.1f} s")
        recent = convs[len(convs) // 2:] or [0]  # the newest half: surely not evicted yet
        k = 0
        for L in lengths:
            before = trie.stored_chars / trie_max_chars
            times = []
            with GcPauses() as pauses:
                for j in range(samples(L)):
                    c = recent[j % len(recent)]
                    words = conversation_words(c, L - NEW_TURN_WORDS, seed=seed)
                    words += random.Random(f"{seed}:turn:{L}:{j}").choices(VOCABULARY, k=NEW_TURN_WORDS)
                    if fill == 0:
                        router = _router(trie_max_chars, replicas, chunk_chars)  # one sample per empty trie
                    times.append(_time_dispatch(router, " ".join(words), k))
                    k += 1
            cells[f"{L}@{fill}"] = _summary(times, before, router.policy.replica_trie.stored_chars / trie_max_chars,
                                            pauses)
        if fill >= 1.0:
            # Before the new conversations, which evict what the next turns need: the look-ahead's queued next
            # turns, the queued decisions and the profile match conversations still in the trie.
            for L in lengths:
                cells[f"{L}@lookahead"] = _lookahead_time(router, recent, L, samples(L), seed)
            for L in lengths:
                cells[f"{L}@queued"] = _queued_decision_time(router, recent, L, samples(L), seed)
            if profile:
                profile_text = _profile_dispatch(router, recent, longest, seed)
            for L in lengths:
                before = trie.stored_chars / trie_max_chars
                times = []
                with GcPauses() as pauses:
                    for j in range(samples(L)):
                        words = conversation_words(10_000_000 + k, L, seed=seed)
                        times.append(_time_dispatch(router, " ".join(words), k))
                        k += 1
                cells[f"{L}@new"] = _summary(times, before, trie.stored_chars / trie_max_chars, pauses)
        progress(f"(d) fill {fill:.0%}: " + ", ".join(f"{L}: p50 {cells[f'{L}@{fill}']['p50_ms']:.2f} ms"
                                                      for L in lengths))
        del router, trie
    return {"cells": cells, "fill_s": fill_s, "lengths": list(lengths), "fills": list(fills),
            "trie_max_chars": trie_max_chars, "replicas": replicas, "profile": profile_text,
            "chunk_chars": chunk_chars, "load": load.stop()}


def _next_turns(recent: list[int], length: int, count: int, seed: int, tag: str, first: int = 0) -> list[Request]:
    """``count`` fresh requests, each the next turn (``length`` words) of a conversation of ``recent`` in turn."""
    out = []
    for j in range(first, first + count):
        words = conversation_words(recent[j % len(recent)], length - NEW_TURN_WORDS, seed=seed)
        words += random.Random(f"{seed}:{tag}:{length}:{j}").choices(VOCABULARY, k=NEW_TURN_WORDS)
        out.append(Request(id=f"{tag}{j}", text=" ".join(words), arrived_at=0.1))
    return out


def _lookahead_time(router: Router, recent: list[int], length: int, n: int, seed: int) -> dict[str, Any]:
    """The queue look-ahead's worst case at this trie: the policy's ``next_in_queue`` over ``queue_lookahead``
    queued next turns of ``length`` words whose conversations the local replicas hold, when no local replica is
    free and only a peer has room: the scan looks for the first request whose cache is not here, so every request
    in the window is walked to its deepest node and none is chosen. Prompts are chunked before timing (once per
    request). ``n`` samples each of the first scan (no match kept: what each queued request costs once, the first
    time a scan reaches it) and of a later scan (the matches kept on the requests while the trie does not change
    under them). Returns ``{"first": cell, "kept": cell, "window"}`` (:func:`_summary` cells)."""
    policy = router.policy
    k = max(1, policy.queue_lookahead)
    window = _next_turns(recent, length, k, seed, "la")
    replicas = list(router.replicas.values())
    for req in window:  # chunk every prompt once, untimed
        trie_key(req, policy.replica_trie)
    fill = policy.replica_trie.stored_chars / policy.replica_trie.max_chars
    cells = {}
    for mode in ("first", "kept"):
        times = []
        with GcPauses() as pauses:
            for _ in range(n):
                if mode == "first":
                    for req in window:
                        req.kept_match = None
                t0 = time.perf_counter_ns()
                policy.next_in_queue(window, [], [], replicas)
                times.append((time.perf_counter_ns() - t0) / 1e6)
        cells[mode] = _summary(times, fill, fill, pauses)
    return {**cells, "window": k}


def _queued_decision_time(router: Router, recent: list[int], length: int, n: int, seed: int) -> dict[str, Any]:
    """Routing decisions with ``queue_lookahead`` requests queued: each local replica takes one request at a time
    (``max_concurrency`` 1, as llama.cpp with one slot), all are busy and ``queue_lookahead`` next turns of
    ``length`` words wait. A sample: the oldest request in flight finishes (its replica frees up), a new next turn
    joins the queue, and ``Router.dispatch`` is timed: the look-ahead's scan, the placement of the request it picks
    (prefix match, estimate, trie insert with eviction) and the scan that finds no room left. Returns a
    :func:`_summary` cell with ``window`` and ``placed`` (decisions made over the samples); the router is left as
    it was found (its queue emptied, its replicas unbounded again)."""
    k = max(1, router.policy.queue_lookahead)
    replicas = list(router.replicas.values())
    for r in replicas:
        r.max_concurrency = 1
    trie = router.policy.replica_trie
    t = 0.1
    in_flight = deque()
    for req in _next_turns(recent, length, len(replicas) + k, seed, "qd"):  # the replicas' first, then the queue
        router.enqueue(req)
    in_flight.extend(router.dispatch(t))
    times, placed = [], 0
    with GcPauses() as pauses:
        for j in range(n):
            router.finished(in_flight.popleft())
            (req,) = _next_turns(recent, length, 1, seed, "qd", first=len(replicas) + k + j)
            router.enqueue(req)
            t0 = time.perf_counter_ns()
            decisions = router.dispatch(t)
            times.append((time.perf_counter_ns() - t0) / 1e6)
            in_flight.extend(decisions)
            placed += len(decisions)
    fill = trie.stored_chars / trie.max_chars
    for d in in_flight:
        router.finished(d)
    for req in list(router.queue):
        router.cancel(req.id)
    for r in replicas:
        r.max_concurrency = None
    return _summary(times, fill, fill, pauses) | {"window": k, "placed": placed}


def chunk_whatif(*, chunk_sizes: Sequence[int] = (64, 256, 1024), length: int = 32000,
                 trie_max_chars: int = 8_000_000, samples: int = 30, progress: _Progress = _say) -> dict[str, Any]:
    """What the trie's chunk size (the ``trie_chunk_chars`` setting, not a code change) does to part (d)'s worst
    cell: ``length``-token prompts at the full trie. Returns ``{chunk: {"next": cell, "new": cell}}``."""
    out = {}
    for chunk in chunk_sizes:
        d = decision_time(lengths=(length,), fills=(1.0,), trie_max_chars=trie_max_chars, chunk_chars=chunk,
                          samples=lambda L: samples, profile=False, progress=progress)
        out[str(chunk)] = {"next": d["cells"][f"{length}@1.0"], "new": d["cells"][f"{length}@new"]}
    return {"length": length, "chunks": out}


def _summary(times: list[float], before: float, after: float, pauses: GcPauses) -> dict[str, Any]:
    return {"p50_ms": percentile(times, 50), "p99_ms": percentile(times, 99), "mean_ms": sum(times) / len(times),
            "max_ms": max(times), "n": len(times), "fill_before": before, "fill_after": after, **pauses.summary()}


def _profile_dispatch(router: Router, recent: list[int], length: int, seed: int, n: int = 20) -> str:
    """cProfile of ``n`` next-turn dispatches of ``length`` words: the top entries by own time, as text."""
    texts = []
    for j in range(n):
        words = conversation_words(recent[j % len(recent)], length - NEW_TURN_WORDS, seed=seed)
        words += random.Random(f"{seed}:profile:{j}").choices(VOCABULARY, k=NEW_TURN_WORDS)
        texts.append(" ".join(words))
    prof = cProfile.Profile()
    for j, text in enumerate(texts):
        req = Request(id=f"p{j}", text=text, arrived_at=0.1)
        prof.enable()
        router.enqueue(req)
        decisions = router.dispatch(0.1)
        prof.disable()
        for d in decisions:
            router.finished(d)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return _pstats_table(buf.getvalue())


# ------------------------------------------------------------------------------------------- (e) trie memory


def rss_kib() -> dict[str, int]:
    """This process's resident memory from /proc/self/status: ``{"rss_kib": VmRSS, "hwm_kib": VmHWM}`` (KiB)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key = "rss_kib" if line.startswith("VmRSS") else "hwm_kib"
            out[key] = int(line.split()[1])
    return out


def _trie_memory_child(trie_max_chars: int) -> dict[str, Any]:
    """Run in a fresh interpreter: fill both tries of a "skylb" policy to their bound and measure RSS."""
    policy = build_policy(_settings(trie_max_chars, DEFAULT_CHUNK_CHARS))
    gc.collect()
    before = rss_kib()
    t0 = time.monotonic()
    fill_trie(policy.replica_trie, 1.0, targets=["r0", "r1", "r2", "r3"])
    # The regional snapshot holds other conversations, forwarded to the peers.
    fill_trie(policy.snapshot_trie, 1.0, targets=["eu", "asia"], first_conversation=100_000)
    fill_s = time.monotonic() - t0
    gc.collect()
    after = rss_kib()
    tries = (policy.replica_trie, policy.snapshot_trie)
    return {"before": before, "after": after, "fill_s": fill_s, "stored_chars": [t.stored_chars for t in tries],
            "nodes": [t.nodes for t in tries], "records": [len(t) for t in tries], "max_chars": trie_max_chars}


def trie_memory(*, trie_max_chars: int = 8_000_000, timeout_s: float = 300.0) -> dict[str, Any]:
    """Part (e): resident memory of a process whose two tries (replicas, regional snapshot) are at their bound.

    Runs :func:`_trie_memory_child` in a fresh interpreter (so nothing else this process allocated counts) and
    returns its dict: RSS before and after (KiB) the fill, stored characters, nodes and records per trie.
    """
    load = MachineLoad().start()
    code = (f"import json, bench.live.overhead as o; "
            f"print(json.dumps(o._trie_memory_child({int(trie_max_chars)})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"trie memory child failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = load.stop()
    result["added_mib"] = (result["after"]["rss_kib"] - result["before"]["rss_kib"]) / 1024
    result["bytes_per_stored_char"] = ((result["after"]["rss_kib"] - result["before"]["rss_kib"]) * 1024
                                       / max(1, sum(result["stored_chars"])))
    return result


# ------------------------------------------------------------------------------------------------ the run


def _part_d(quick: bool) -> dict[str, Any]:
    """Part (d) with its chunk-size what-if (quick: tiny trie and prompts)."""
    d = decision_time(lengths=(1000, 4000) if quick else (1000, 4000, 8000, 16000, 32000),
                      trie_max_chars=200_000 if quick else 8_000_000, samples=(lambda L: 5) if quick else None)
    d["chunk_whatif"] = chunk_whatif(length=4000 if quick else 32000, trie_max_chars=d["trie_max_chars"],
                                     samples=5 if quick else 30)
    return d


PARTS = ("a", "b", "c", "d", "e")


def run_overhead(parts: Sequence[str] = PARTS, *, run_dir: Path | None = None, quick: bool = False) -> dict:
    """Run the chosen parts; returns ``{"parts": {letter: result}, "errors": {letter: message}, "versions",
    "wall_s", "load"}``. ``quick`` shrinks every part (for a smoke run: a few seconds each)."""
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="overhead-"))
    load = MachineLoad().start()
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    jobs = {
        "a": lambda: {**added_latency(n=30 if quick else 500, run_dir=run_dir, warmup=5 if quick else 20),
                      "profile": balancer_profile(n=50 if quick else 2000, run_dir=run_dir)},
        "b": lambda: max_rate(run_dir=run_dir, rates=(20, 50) if quick else RATES,
                              step_s=1.0 if quick else 3.0),
        "c": lambda: {**sse_rate(run_dir=run_dir, duration_s=1.0 if quick else 5.0),
                      "streamed": max_rate(run_dir=run_dir, systems=STREAM_SYSTEMS, stream=True,
                                           max_tokens=STREAM_TOKENS, rates=(20, 50) if quick else STREAM_RATES,
                                           step_s=1.0 if quick else 3.0)},
        "d": lambda: _part_d(quick),
        "e": lambda: trie_memory(trie_max_chars=200_000 if quick else 8_000_000),
    }
    for part in parts:
        _say(f"part ({part}) ...")
        started = time.monotonic()
        try:
            results[part] = jobs[part]()
            results[part]["wall_s"] = time.monotonic() - started
        except (RuntimeError, Unavailable, OSError, subprocess.TimeoutExpired) as exc:
            errors[part] = str(exc)[:2000]
            _say(f"part ({part}) failed: {exc}")
        _say(f"part ({part}) done in {time.monotonic() - started:.0f} s")
    return {"parts": results, "errors": errors, "targets": targets(results), "versions": versions(),
            "wall_s": time.monotonic() - t0,
            "load": load.stop(), "run_dir": str(run_dir), "quick": quick, "generated": now_label()}


# ----------------------------------------------------------------------------------------------------- report


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("MET" if ok else "MISSED")


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The overhead result as the Markdown report bench/results/overhead.md; ``notes`` is appended as is."""
    parts, v = result["parts"], result["versions"]
    lines = ["# The balancer's own cost", "",
             f"Generated by `python -m bench.live.overhead` on {result.get('generated') or now_label()}; whole run "
             f"{result['wall_s']:.0f} s{' (QUICK run: small sizes, not the real figures)' if result['quick'] else ''}. "
             f"Versions: sglang-router {v['sglang-router']}, {v['haproxy']}, Python {v['python']}.", ""]
    lines += _targets(parts)
    if "a" in parts:
        a = parts["a"]
        lines += ["## (a) Added latency (small non-streamed requests, sequential)", "",
                  f"{a['n']} requests per system, interleaved (request i goes to every system in a shuffled order), "
                  "one keep-alive connection each, `max_tokens` 1, ~50-word prompt, one emulated replica answering "
                  "in about 1 ms. Added = the system's percentile minus the direct one's; x SGLang = SkyLB's added "
                  "p50 over the SGLang router's, in the same rounds. CPU ms/request: the CPU time of the balancer's "
                  "processes (/proc, its process group: HAProxy's and the SGLang router's threads and children "
                  "too; SkyLB's controller, a process of its own, not) over the measured requests, per request; "
                  "each balancer's background work (SkyLB's probes every 100 ms) included. `aiohttp` (when run): "
                  "bench/live/aiohttp_floor.py, a pass-through aiohttp proxy on uvloop with no routing, queue, metrics or "
                  "log line, the floor of any balancer built on aiohttp; SkyLB's own work per request is its gap to "
                  "that row.", "",
                  markdown_table(["system", "p50 ms", "p99 ms", "mean ms", "added p50 ms", "added p99 ms",
                                  "x SGLang (added p50)", "CPU ms/request", "errors"],
                                 [[name, _f(s["p50_ms"]), _f(s["p99_ms"]), _f(s["mean_ms"]),
                                   _f(s.get("added_p50_ms")), _f(s.get("added_p99_ms")),
                                   _f(s.get("added_p50_vs_sglang")), _f(s.get("cpu_ms_per_request"), "{:.3f}"),
                                   s["errors"]]
                                  for name, s in a["systems"].items()])]
        lines += _skipped(a) + [""]
        if a.get("profile"):
            p = a["profile"]
            lines += [f"Where the SkyLB balancer's CPU goes on these requests: cProfile (clock: the process's CPU "
                      f"time, so waiting does not count; from after a warm-up) of the balancer process "
                      f"(default configuration) serving {p['n']} sequential requests: {p['total_s']:.2f} CPU-s, "
                      f"{1000 * p['total_s'] / p['n']:.2f} ms per request. Top entries by own time:", "", "```",
                      p["text"], "```", "", "The balancer's own functions (skylb/balancer, skylb/core) by cumulative "
                      "CPU time:", "", "```", p["skylb_cumulative"], "```", ""]
    if "b" in parts:
        b = parts["b"]
        lines += ["## (b) Highest sustained request rate of one balancer process", "",
                  f"Open loop, evenly spaced non-streamed 1-token completions, steps of {b['step_s']:g} s at "
                  f"{', '.join(map(str, b['rates']))} req/s until a step is not sustained (errors > "
                  f"{100 * b['error_limit']:g}%, p99 > {b['p99_limit_ms']:g} ms, or < 95% of the offered rate "
                  f"completed); {b['replicas']} fast emulated replicas that never queue. The client (one Python "
                  "process) and the emulator share the 2 cores with the balancer: `direct` is the ceiling of this "
                  "setup.", ""]
        lines.append(_rate_table(b, "sustained req/s"))
        lines += _skipped(b) + [""]
    if "c" in parts:
        c = parts["c"]
        lines += ["## (c) Streaming: SSE chunks relayed per second, sustained streamed requests per second", "",
                  f"{c['streams']} concurrent streamed completions of 4000 tokens from one fast emulated replica, "
                  f"chunks (`data:` events) counted at the client for {c['duration_s']:g} s after a 1 s warm-up.", "",
                  markdown_table(["system", "chunks/s at the client", "balancer CPU us/chunk"],
                                 [[name, f"{s['chunks_per_s']:.0f}", _f(s["balancer_cpu_us_per_chunk"], "{:.1f}")]
                                  for name, s in c["systems"].items()])]
        lines += _skipped(c) + [""]
        if c.get("streamed"):
            st = c["streamed"]
            lines += [f"Sustained streamed requests per second: open loop as in part (b), streamed completions of "
                      f"{st['max_tokens']} tokens (each an SSE event, then `data: [DONE]`; a request counts once its "
                      f"whole stream arrived without an error event), steps of {st['step_s']:g} s at "
                      f"{', '.join(map(str, st['rates']))} req/s, the same limits; {st['replicas']} fast emulated "
                      "replicas.", "", _rate_table(st, "sustained streamed req/s")] + _skipped(st) + [""]
    if "d" in parts:
        lines += _decision_section(parts["d"])
    if "e" in parts:
        e = parts["e"]
        lines += ["## (e) Resident memory with both tries at their bound", "",
                  f"A fresh interpreter builds a `skylb` policy (trie_max_chars {e['max_chars']:,}, chunks of "
                  f"{DEFAULT_CHUNK_CHARS} characters doubling after every {DEFAULT_CHUNK_DOUBLING}, the defaults) and fills the replica trie and the regional snapshot with the conversations of part "
                  f"(d) until each reaches its bound ({e['fill_s']:.0f} s).", "",
                  markdown_table(["", "replica trie", "regional snapshot"],
                                 [[label, f"{e[key][0]:,}", f"{e[key][1]:,}"] for label, key in
                                  (("stored characters", "stored_chars"), ("nodes", "nodes"),
                                   ("records", "records"))]), "",
                  f"RSS before the fill {e['before']['rss_kib'] / 1024:.0f} MiB, after "
                  f"{e['after']['rss_kib'] / 1024:.0f} MiB (peak {e['after']['hwm_kib'] / 1024:.0f} MiB): "
                  f"**{e['added_mib']:.0f} MiB for both tries**, {e['bytes_per_stored_char']:.1f} bytes of RSS per "
                  "stored character.", ""]
    if result["errors"]:
        lines += ["## Parts that failed", ""] + [f"- ({k}): {m.splitlines()[0]}" for k, m in result["errors"].items()]
        lines += [""]
    windows = [(f"part ({k}), {r['wall_s']:.0f} s", r["load"]) for k, r in parts.items() if "load" in r]
    cond = conditions_lines(result["load"], windows, "client, emulator and balancer share them; parts (d) and (e) "
                            "run in one process (one core)")
    lines += cond
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def _rate_table(part: dict, head: str) -> str:
    """A ramp's table (:func:`max_rate`): per system the sustained rate, the first failing step, the CPU."""
    body = []
    for name, s in part["systems"].items():
        ok_steps = [st for st in s["steps"] if st["rate"] <= s["sustained_rps"]]
        bad = next((st for st in s["steps"] if st["rate"] > s["sustained_rps"]), None)
        fail = ("none (ramp ended)" if bad is None else
                f"{bad['rate']}/s: achieved {bad['achieved_rps']:.0f}/s, p99 {_f(bad['p99_ms'], '{:.0f}')} ms, "
                f"{bad['errors']} errors, client send lag p99 {_f(bad['send_lag_p99_ms'], '{:.0f}')} ms")
        cpu = ok_steps[-1].get("balancer_cpu_ms_per_req") if ok_steps else None
        body.append([name, s["sustained_rps"], fail, _f(cpu, "{:.3f}")])
    return markdown_table(["system", head, "first failing step", "balancer CPU ms/request (last ok step)"], body)


def _skipped(part: dict) -> list[str]:
    return [f"\nSkipped: {name} ({why})." for name, why in part.get("skipped", {}).items()]


#: Part (a)'s second target: SkyLB's added p50 at most this many times the SGLang router's (same run, interleaved).
SGLANG_RATIO_TARGET = 1.5


def targets(parts: dict) -> list[dict[str, Any]]:
    """The issue's targets with what this run measured: ``[{"target", "measured", "met"}]`` (``met`` None when the
    part did not run); also in the JSON result (``"targets"``), which bench/reporting/glance.py quotes."""
    a_val = ratio = sg = d_val = q_val = None
    if "a" in parts and "skylb" in parts["a"]["systems"]:
        row = parts["a"]["systems"]["skylb"]
        a_val, ratio = row.get("added_p50_ms"), row.get("added_p50_vs_sglang")
        sg = (parts["a"]["systems"].get("sglang") or {}).get("added_p50_ms")
    if "d" in parts and max(parts["d"]["lengths"]) >= 32000:
        longest = max(parts["d"]["lengths"])
        d_val = (parts["d"]["cells"].get(f"{longest}@1.0") or {}).get("p99_ms")
        q_val = (parts["d"]["cells"].get(f"{longest}@queued") or {}).get("p99_ms")
    rows = [("p50 added latency through SkyLB <= 1 ms", a_val, f"{_f(a_val)} ms", lambda v: v <= 1.0),
            (f"p50 added latency through SkyLB <= {SGLANG_RATIO_TARGET:g} x the SGLang router's (interleaved)",
             ratio, f"{_f(ratio)} x ({_f(a_val)} ms / {_f(sg)} ms)", lambda v: v <= SGLANG_RATIO_TARGET),
            ("routing decision p99 <= 1 ms at 32k-token prompts, full trie", d_val, f"{_f(d_val)} ms",
             lambda v: v <= 1.0),
            ("routing decision p99 <= 1 ms with 64 queued 32k-token prompts, full trie", q_val, f"{_f(q_val)} ms",
             lambda v: v <= 1.0)]
    return [{"target": name, "value": value, "measured": text, "met": None if value is None else ok(value)}
            for name, value, text, ok in rows]


def _targets(parts: dict) -> list[str]:
    return ["## Targets", "",
            markdown_table(["target", "measured", "verdict"],
                           [[t["target"], t["measured"], _verdict(t["met"])] for t in targets(parts)]),
            ""]


def _decision_section(d: dict) -> list[str]:
    fills = d["fills"]
    heads = [f"{int(100 * f)}% full" for f in fills] + (["full, new conversation"] if 1.0 in fills else [])
    lines = ["## (d) Routing decision time (routing core, in-process, no I/O)", "",
             "`Router.dispatch` with the `skylb` policy and 4 available replicas, one fresh request per sample "
             "(chunking, trie match, least-load pick and trie insert included; eviction too when the trie is "
             f"full). Trie bound {d['trie_max_chars']:,} characters; chunks of {d['chunk_chars']} characters, doubling in "
             f"length after every {DEFAULT_CHUNK_DOUBLING} (`trie_chunk_doubling`). A prompt of L tokens is L "
             "words (~5 characters each). At a fill > 0 the request is the next turn of a conversation already in "
             f"the trie (the first L - {NEW_TURN_WORDS} words known, then a new user turn); at 0% the trie is empty; "
             "'new conversation' shares only the 500-word system prompt. Cells: p50 / p99 ms.", ""]
    # One row per prompt length: a column per fill, then the new-conversation column (full trie only).
    cells = {L: [d["cells"][f"{L}@{f}"] for f in fills] + ([d["cells"][f"{L}@new"]] if 1.0 in fills else [])
             for L in d["lengths"]}
    lines.append(markdown_table(["prompt tokens", *heads],
                                [[f"{L:,}", *(f"{_f(c['p50_ms'])} / {_f(c['p99_ms'])}" for c in row)]
                                 for L, row in cells.items()]))
    lines += ["", "Garbage-collector pauses during each cell's samples (collections (of which gen-2) / largest pause, "
              "ms):", "",
              markdown_table(["prompt tokens", *heads],
                             [[f"{L:,}", *(f"{c['gc_runs']} ({c['gc_gen2_runs']}) / {c['gc_max_ms']:.1f}" for c in row)]
                              for L, row in cells.items()])]
    if f"{d['lengths'][0]}@lookahead" in d["cells"]:
        look = {L: d["cells"][f"{L}@lookahead"] for L in d["lengths"]}
        window = next(iter(look.values()))["window"]
        lines += ["", f"Queue look-ahead at the full trie, its worst case (the `skylb` policy's `next_in_queue`): "
                  f"{window} queued next turns whose conversations the local replicas hold, no local replica free "
                  "and only a peer with room, so the scan looks for a request whose cache is not here: every "
                  "request in the window is walked to its deepest node and none is chosen. 'First scan': no match "
                  "kept yet (each queued request pays this once, the first time a scan reaches it); 'later scans': "
                  "each request's match kept while the trie does not change under its key. p50 / p99 ms.", "",
                  markdown_table(["prompt tokens", "first scan", "later scans"],
                                 [[f"{L:,}", *(f"{_f(c[m]['p50_ms'])} / {_f(c[m]['p99_ms'])}"
                                               for m in ("first", "kept"))] for L, c in look.items()])]
    if f"{d['lengths'][0]}@queued" in d["cells"]:
        queued = {L: d["cells"][f"{L}@queued"] for L in d["lengths"]}
        window = next(iter(queued.values()))["window"]
        lines += ["", f"Routing decision with {window} requests queued, at the full trie: every replica takes one "
                  f"request at a time and is busy; a sample is one request finishing (its replica frees up), a "
                  f"new next turn joining the queue, and the timed `Router.dispatch`: the look-ahead's scan over "
                  f"the {window} queued, the placement of the one it picks (prefix match, estimate, trie insert "
                  "with eviction) and the scan that finds no room left. p50 / p99 ms (max).", "",
                  markdown_table(["prompt tokens", f"{window} queued"],
                                 [[f"{L:,}", f"{_f(c['p50_ms'])} / {_f(c['p99_ms'])} ({_f(c['max_ms'])})"]
                                  for L, c in queued.items()])]
    w = d.get("chunk_whatif")
    if w:
        lines += ["", f"What-if, `trie_chunk_chars` (a setting, not a code change): {w['length']:,}-token prompts at "
                  "the full trie, p50 / p99 ms.", "",
                  markdown_table(["chunk chars", "next turn", "new conversation"],
                                 [[chunk, f"{_f(c['next']['p50_ms'])} / {_f(c['next']['p99_ms'])}",
                                   f"{_f(c['new']['p50_ms'])} / {_f(c['new']['p99_ms'])}"]
                                  for chunk, c in w["chunks"].items()])]
    lines += ["", "Fill of the trie during each column (fraction of the bound, before -> after the samples): " +
              "; ".join(f"{int(100 * f)}%: {min(d['cells'][f'{L}@{f}']['fill_before'] for L in d['lengths']):.2f}"
                        f" -> {max(d['cells'][f'{L}@{f}']['fill_after'] for L in d['lengths']):.2f}" for f in fills)
              + ". Fill time: " + ", ".join(f"{int(100 * float(k))}%: {v:.1f} s" for k, v in d["fill_s"].items())
              + ".", ""]
    if d.get("profile"):
        lines += [f"Profile (cProfile, 20 next-turn dispatches of {max(d['lengths']):,}-token prompts at the full "
                  "trie, by own time):", "", "```", d["profile"], "```", ""]
    return lines


# -------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live.overhead`."""
    p = argparse.ArgumentParser(prog="python -m bench.live.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run; the figures mean little)")
    p.add_argument("--out-md", default=None, help="Markdown report ('' for none; default "
                   "bench/results/overhead.md, none with --tracing)")
    p.add_argument("--out-json", default=None,
                   help="the raw result as JSON, beside the report (bench/reporting/glance.py quotes it; '' for none; default "
                        "bench/results/overhead.json, none with --tracing)")
    p.add_argument("--tracing", action="store_true", help="instead of the parts: tracing's cost, off and on, "
                   "beside two identical balancers (tracing_cost)")
    p.add_argument("--rounds", type=int, default=3, help="with --tracing: interleaved rounds (default 3)")
    p.add_argument("--n", type=int, default=300, help="with --tracing: requests per system per round (default 300)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="with --tracing: another SkyLB checkout run beside (e.g. one without tracing code)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report (analysis, suggestions)")
    p.add_argument("--run-dir", default=None, help="logs and configs (default: a new temporary directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the parts and write the report; 0 when every part ran (targets missed still give 0)."""
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir) if args.run_dir else None
    if args.tracing:
        result = tracing_cost(n=args.n, rounds=args.rounds, run_dir=run_dir or Path(tempfile.mkdtemp(
            prefix="overhead-tracing-")), baseline=args.baseline.resolve() if args.baseline else None)
        emit_markdown(format_tracing(result), result, out_md=args.out_md or "", out_json=args.out_json or "")
        return 0
    args.out_md = "bench/results/overhead.md" if args.out_md is None else args.out_md
    args.out_json = "bench/results/overhead.json" if args.out_json is None else args.out_json
    result = run_overhead(args.parts, run_dir=run_dir, quick=args.quick)
    notes = Path(args.notes).read_text() if args.notes else ""
    text = format_markdown(result, notes)
    emit_markdown(text, result, out_md=args.out_md, out_json=args.out_json)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
