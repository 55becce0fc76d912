"""What one balancer hop costs per request: the CPU of one balancer relaying streamed and whole answers.

Entry point: ``.venv/bin/python -m bench.live.hop_cost [--time-scales 0.05 1] [--requests 160] [--clients 8]
[--output-tokens 18] [--prompt-words 300] [--repeats 2] [--out-md bench/results/hop_cost.md]`` (also
``skylb bench hop_cost ...``); :func:`main` ``(argv) -> int``.

Method: per cell (streamed or not, emulated time scale), one emulator process serving 4 emulated vLLM replicas
(batch 4) and one static balancer (``--replica URL`` each, no controller, no peer, the default configuration);
after one request warms the path, ``clients`` threads send ``requests`` chat completions in all, closed loop, each
a prompt of ``prompt_words`` words and ``max_tokens`` ``output_tokens`` with ``ignore_eos`` (streamed: an SSE event
per token, then ``[DONE]``). Measured: the balancer's CPU time (user + system, /proc) over those requests, per request, per relayed
SSE event, and per second (the probing of its 4 replicas included: the time scale spreads a request's events over
more wall time, so more of each second is probing). The time scale is the emulator's: at 1 the events of a stream
come one decode step apart (tens of ms) and each is its own wake-up of the balancer; at 0.05 they come close
together. mean [min, max] over repetitions. Peer forwarding is not in these figures (bench.live.peers has the deployment).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.launch.procs import ProcGroup, free_port, free_ports, wait_http
from bench.reporting.provenance import provenance, provenance_line
from bench.replay.report import emit_markdown, markdown_table

__all__ = ["measure_once", "run", "render", "main"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPLICAS = 4


def _send(url: str, body: bytes, stream: bool) -> int:
    """One chat completion through ``url``; returns the SSE events with data received (``[DONE]`` aside), 0 for a
    whole answer. Raises on an HTTP error or an answer without its end."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        data = resp.read()
    if not stream:
        json.loads(data)["choices"][0]  # a whole answer: ValueError / KeyError otherwise
        return 0
    lines = [line for line in data.split(b"\n") if line.startswith(b"data:")]
    if not lines or lines[-1].strip() != b"data: [DONE]":
        raise RuntimeError(f"a stream without its [DONE]: {data[-200:]!r}")
    return len(lines) - 1


def measure_once(*, stream: bool, time_scale: float, requests: int, clients: int, output_tokens: int,
                 prompt_words: int, work: Path) -> dict:
    """One cell's run: {"requests", "events_per_request", "wall_s", "cpu_ms_per_request", "cpu_us_per_event" (None
    unstreamed), "cpu_ms_per_s"}. Raises RuntimeError when a request fails."""
    # ``ignore_eos`` (vLLM's extension, as bench.live.peers sends it): every answer is ``output_tokens`` long.
    body = json.dumps({"model": MODEL, "stream": stream, "max_tokens": output_tokens, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hello " * prompt_words}]}).encode()
    with ProcGroup(work / "logs") as procs:
        ports = free_ports(REPLICAS)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", repr(time_scale),
                    "--max-num-seqs", "4", "--no-request-log", *(a for p in ports for a in ("--port", str(p))),
                    name="emulator", wait_url=f"{urls[0]}/health")
        for url in urls[1:]:
            wait_http(f"{url}/health", timeout_s=10)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.skylb("balancer", "--region", "local", "--port", str(port), "--engine", "vllm",
                    *(a for u in urls for a in ("--replica", u)), name="balancer", wait_url=f"{url}/healthz")
        deadline = time.monotonic() + 30
        while True:  # the first request waits for the replicas' first probes
            try:
                _send(url, body, stream)
                break
            except (OSError, ValueError, RuntimeError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the balancer did not answer within 30 s of its start") from None
                time.sleep(0.2)
        events, errors = [], []

        def client(n: int) -> None:
            for _ in range(n):
                try:
                    events.append(_send(url, body, stream))
                except Exception as exc:  # reported below: a cost measured over failures means nothing
                    errors.append(repr(exc))

        share = [requests // clients + (i < requests % clients) for i in range(clients)]
        threads = [threading.Thread(target=client, args=(n,)) for n in share]
        c0, t0 = procs.cpu_seconds("balancer"), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c1, t1 = procs.cpu_seconds("balancer"), time.monotonic()
    if errors:
        raise RuntimeError(f"{len(errors)} of {requests} requests failed, e.g. {errors[0]}")
    cpu_ms, wall = 1000.0 * (c1 - c0), t1 - t0
    per_request = statistics.fmean(events)
    return {"requests": len(events), "events_per_request": per_request, "wall_s": wall,
            "cpu_ms_per_request": cpu_ms / len(events),
            "cpu_us_per_event": 1000.0 * cpu_ms / sum(events) if stream and sum(events) else None,
            "cpu_ms_per_s": cpu_ms / wall}


def run(time_scales: list[float], *, requests: int, clients: int, output_tokens: int, prompt_words: int,
        repeats: int) -> list[dict]:
    """Every (streamed or not, time scale) cell, ``repeats`` times, interleaved (cell order within each
    repetition)."""
    cells = {(s, ts): [] for ts in time_scales for s in (True, False)}
    with tempfile.TemporaryDirectory(prefix="skylb-hop-cost-") as tmp:
        for rep in range(repeats):
            for (s, ts), runs in cells.items():
                runs.append(measure_once(stream=s, time_scale=ts, requests=requests, clients=clients,
                                         output_tokens=output_tokens, prompt_words=prompt_words,
                                         work=Path(tmp) / f"{int(s)}-{ts}-{rep}"))
    return [{"stream": s, "time_scale": ts, "runs": runs} for (s, ts), runs in cells.items()]


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def render(result: dict) -> str:
    """The Markdown report."""
    s = result["settings"]
    rows = [["streamed" if c["stream"] else "whole", f"{c['time_scale']:g}",
             f"{statistics.fmean(r['events_per_request'] for r in c['runs']):.1f}" if c["stream"] else "-",
             _spread([r["cpu_ms_per_request"] for r in c["runs"]]),
             _spread([r["cpu_us_per_event"] for r in c["runs"]], "{:.0f}") if c["stream"] else "-",
             _spread([r["cpu_ms_per_s"] for r in c["runs"]], "{:.0f}"),
             _spread([r["requests"] / r["wall_s"] for r in c["runs"]], "{:.1f}")] for c in result["cells"]]
    lines = ["# What one balancer hop costs per request (real processes)", "",
             provenance_line(result["provenance"]), "",
             f"{s['requests']} requests per run from {s['clients']} closed-loop clients, prompts of "
             f"{s['prompt_words']} words, {s['output_tokens']} output tokens, {result['repeats']} repetition(s): "
             "mean [min, max]. Method: bench/live/hop_cost.py (one static balancer, 4 emulated vLLM replicas of batch 4 "
             "in one emulator process, the balancer's CPU from /proc; per event: the streamed runs' CPU over their "
             "SSE events, so a request's own work is spread over its events too).", "",
             markdown_table(["Answer", "Time scale", "SSE events/request", "Balancer CPU ms/request",
                             "CPU us/event", "Balancer CPU ms/s", "Requests/s"], rows), ""]
    if result.get("notes"):
        lines += [result["notes"].rstrip(), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.live.hop_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--time-scales", type=float, nargs="+", default=[0.05, 1.0],
                   help="the emulator's time scale (1: an 8B model on an L4's step times)")
    p.add_argument("--requests", type=int, default=160, help="requests per run")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--output-tokens", type=int, default=18, help="max_tokens of every request")
    p.add_argument("--prompt-words", type=int, default=300, help="words in every prompt")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of every cell")
    p.add_argument("--out-md", default=str(RESULTS / "hop_cost.md"), help="report ('' for none; JSON beside it)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure, write the report and its JSON, print the report; returns the exit status."""
    args = build_parser().parse_args(argv)
    if (min(args.time_scales) <= 0 or args.requests < 1 or args.clients < 1 or args.output_tokens < 1
            or args.prompt_words < 1 or args.repeats < 1):
        print("python -m bench.live.hop_cost: positive time scales, and requests, clients, output tokens, prompt words "
              "and repeats of at least 1", file=sys.stderr)
        return 2
    prov = provenance("python -m bench.live.hop_cost " + " ".join(argv if argv is not None else sys.argv[1:]))
    settings = {"requests": args.requests, "clients": args.clients, "output_tokens": args.output_tokens,
                "prompt_words": args.prompt_words}
    result = {"provenance": prov, "settings": settings, "repeats": args.repeats,
              "cells": run(args.time_scales, repeats=args.repeats, **settings),
              "notes": Path(args.notes).read_text() if args.notes else ""}
    emit_markdown(render(result), result, out_md=args.out_md or None,
                  out_json=str(Path(args.out_md).with_suffix(".json")) if args.out_md else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
