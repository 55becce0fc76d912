"""Seed 000's Table 3 on emulated replicas of different speeds: estimated-wait routing against round robin, least
connections and SkyLB's default policy (issue 12, item 1).

Entry point: ``.venv/bin/python -m bench.live.heterogeneous [--systems NAME ...] [--seeds N] [--compression K]
[--out-md bench/results/heterogeneous.md] [--out-json PATH]``; :func:`main` ``(argv) -> int``.

The seed's setup (OllamaRouter, ../shared/seeds/000_b071411eabc9df88.txt §5.7-§5.9, Tables 2-3): two hosts running
one Ollama each, A with a GPU and B CPU-only; k6 sends one request every 40 s for 40 minutes (60 requests, constant
arrival rate, non-streamed ``/api/generate``), then allows a 30-minute graceful stop; requests not answered by then
(70 minutes after the start) count as not completed. Reproduced here, time compressed by ``compression``
(default 250: one request every 0.16 s, cut-off after 16.8 s):

* Host A is one emulated Ollama (``OLLAMA_NUM_PARALLEL`` 1) whose mean request takes what the seed's Single Host run
  implies: 60 requests in 3701 s on an overloaded queue, about 62 s each (seed time). Host B is the same emulator
  ``slow_factor`` times slower (default 4: the seed's Table 3 implies 3.4-4.5; see the report's notes).
* The workload stands in for the iRisk review analysis (§5.5-§5.6), which is not public: each request a review-like
  prompt of 200-1200 characters and 100-300 output tokens (uniform; ``ignore_eos``, so the length is exact), drawn
  from ``seed``. Every system gets the same requests for a given seed.
* Systems: ``estimated-wait`` (seed 000's algorithm, blind pushing), ``round-robin`` and ``least-load`` (the seed's
  HAProxy round robin and least connections, as SkyLB's blind-pushing baselines), ``skylb`` (the default policy:
  selective pushing from the balancer's queue, measured-speed tie-break), and ``single-host`` (round robin over host
  A alone, the seed's Single Host row; not run unless named).
* Figures, as k6 computed them: requests sent; completed (answered by the cut-off); completion time (start to the
  last answer, only when all completed, else N/A); mean waiting time of the completed requests (k6's
  ``http_req_waiting``; non-streamed, so time to the whole answer); throughput = completed / (start to the last
  answer). Each system runs ``seeds`` times on a fresh deployment (controller, balancer, two emulators: real
  processes); the report gives the mean and the range over seeds, in seed-equivalent units (ours x compression).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import requests

from bench.live.harness import now_label
from bench.launch.launchers import start_skylb
from bench.replay.report import emit_markdown, markdown_table
from bench.launch.procs import ProcGroup, free_ports

__all__ = ["SYSTEMS", "SEED_TABLE", "HeteroSetup", "workload", "run_once", "run_all", "format_markdown", "main"]

MODEL = "llama3.1:8b"
#: name -> (balancer policy, hosts used: 2 = A and B, 1 = A only)
SYSTEMS: dict[str, tuple[str, int]] = {
    "estimated-wait": ("estimated-wait", 2),
    "round-robin": ("round-robin", 2),
    "least-load": ("least-load", 2),
    "skylb": ("skylb", 2),
    "single-host": ("round-robin", 1),
}
DEFAULT_SYSTEMS = ("estimated-wait", "round-robin", "least-load", "skylb")
#: Seed 000 Table 3, as printed: strategy, sent, completed, completion time (s), mean waiting time (printed "(s)",
#: but the values are k6's http_req_waiting in ms: 280227.94 s would be 78 hours of a 70-minute test), throughput.
SEED_TABLE = [
    ("Least Connection", 60, 52, None, 280227.94, 1.8685e-2),
    ("Round Robin", 60, 50, None, 700479.01, 1.1970e-2),
    ("Single Host", 60, 60, 3701, 649019.42, 1.6212e-2),
    ("OllamaRouter (this work)", 61, 61, 3073, 407972.21, 1.9850e-2),
]
#: Our systems beside the seed's rows.
SEED_ROW_OF = {"least-load": "Least Connection", "round-robin": "Round Robin", "single-host": "Single Host",
               "estimated-wait": "OllamaRouter (this work)"}

# The emulator's Ollama timing at --time-scale 1 (its defaults: decode iteration 53.5 ms + 0.25 ms per sequence,
# prefill 0.48 ms per prompt token) and its tokens per prompt character (about one per 5 characters of English).
_DECODE_S, _PREFILL_S, _TOKENS_PER_CHAR = 0.05375, 0.00048, 0.2


@dataclass(frozen=True)
class HeteroSetup:
    """The scenario (seed-time units unless said).

    Attributes:
        requests: requests sent (seed: 60); interval_s: between two arrivals (seed: 40 s);
        graceful_s: after the last arrival, how long answers are still awaited (seed: 30 min after the 40-minute
            run, so 1800 s); compression: seed seconds per real second; slow_factor: how many times slower host B
            is than A; host_a_service_s: host A's mean time per request (seed's Single Host: 3701 s / 60);
        prompt_chars, output_tokens: uniform ranges of the workload; seeds: runs per system.
    """

    requests: int = 60
    interval_s: float = 40.0
    graceful_s: float = 1800.0
    compression: float = 250.0
    slow_factor: float = 4.0
    host_a_service_s: float = 3701.0 / 60
    prompt_chars: tuple[int, int] = (200, 1200)
    output_tokens: tuple[int, int] = (100, 300)
    seeds: int = 3

    @property
    def cutoff_s(self) -> float:
        """Real seconds from the start to the cut-off (k6's end of graceful stop)."""
        return (self.requests * self.interval_s + self.graceful_s) / self.compression

    def time_scales(self) -> tuple[float, float]:
        """The emulator --time-scale of host A and host B."""
        mean_out = sum(self.output_tokens) / 2
        mean_prompt = sum(self.prompt_chars) / 2 * _TOKENS_PER_CHAR
        emulated_s = mean_out * _DECODE_S + mean_prompt * _PREFILL_S
        a = self.host_a_service_s / self.compression / emulated_s
        return a, a * self.slow_factor


_WORDS = ("app crashes when I open the camera after the update and I lose my photos battery drains fast login "
          "fails payment screen freezes notifications stopped working sync is slow ads cover the button dark "
          "mode resets every time I restart the phone support never answered my ticket").split()


def workload(setup: HeteroSetup, seed: int) -> list[dict[str, Any]]:
    """The ``setup.requests`` request bodies for ``seed``: Ollama /api/generate, non-streamed, a review-like
    prompt and an exact output length."""
    rng = random.Random(seed)
    bodies = []
    for i in range(setup.requests):
        n = rng.randint(*setup.prompt_chars)
        text = ""
        while len(text) < n:
            text += rng.choice(_WORDS) + " "
        prompt = f"Review {i}: {text[:n].strip()}\nExtract the issue, the functionality, severity 1-5, likelihood."
        bodies.append({"model": MODEL, "prompt": prompt, "stream": False,
                       "options": {"num_predict": rng.randint(*setup.output_tokens), "ignore_eos": True}})
    return bodies


async def _drive(url: str, bodies: list[dict], setup: HeteroSetup) -> dict[str, Any]:
    """Send ``bodies`` at the constant arrival rate; await answers until the cut-off. Returns raw figures (real s)."""
    loop = asyncio.get_running_loop()
    interval = setup.interval_s / setup.compression
    done: list[tuple[float, float, str]] = []  # (sent after start, answered after start, served by)
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=setup.cutoff_s + 5)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = loop.time()

        async def one(i: int, body: dict) -> None:
            await asyncio.sleep(max(0.0, t0 + i * interval - loop.time()))
            sent = loop.time() - t0
            async with session.post(f"{url}/api/generate", json=body) as resp:
                data = await resp.read()
                if resp.status != 200:
                    errors.append(f"HTTP {resp.status}: {data[:120]!r}")
                    return
                done.append((sent, loop.time() - t0, resp.headers.get("X-SkyLB-Served-By", "?")))

        tasks = [asyncio.create_task(one(i, b)) for i, b in enumerate(bodies)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + setup.cutoff_s - loop.time()))
        for task in pending:  # not answered by the cut-off: k6's graceful stop ends them
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    served: dict[str, int] = {}
    for _, _, who in done:
        host = who.split("/", 1)[-1]
        served[host] = served.get(host, 0) + 1
    last = max((d for _, d, _ in done), default=None)
    return {"sent": len(bodies), "completed": len(done), "last_s": last,
            "waits_s": [d - s for s, d, _ in done], "served": served, "errors": errors}


def _status(url: str) -> dict:
    """The balancer's operator status (JSON)."""
    resp = requests.get(f"{url}/skylb/v1/status?format=json", timeout=10)
    resp.raise_for_status()
    return resp.json()


def run_once(system: str, seed: int, setup: HeteroSetup, *, run_dir: Path) -> dict[str, Any]:
    """One run of ``system`` on a fresh deployment (real processes, all stopped at the end); figures in real s."""
    policy, hosts = SYSTEMS[system]
    scale_a, scale_b = setup.time_scales()
    run_dir = Path(run_dir) / f"{system}-{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with ProcGroup(run_dir) as procs:
        urls = []
        for host, scale, port in zip("ab", (scale_a, scale_b), free_ports(2)):
            if len(urls) == hosts:
                break
            procs.skylb("emulator", "--engine", "ollama", "--model", MODEL, "--time-scale", repr(scale),
                        "--parallel", "1", "--no-request-log", "--port", str(port), name=f"host-{host}",
                        wait_url=f"http://127.0.0.1:{port}/")
            urls.append(f"http://127.0.0.1:{port}")
        url = start_skylb(procs, urls, run_dir=run_dir, policy=policy, engine="ollama")
        deadline = time.monotonic() + 20
        while not all(MODEL in (r["models"] or []) for r in _status(url)["replicas"]):
            if time.monotonic() > deadline:
                raise RuntimeError("the balancer did not learn the replicas' models in 20 s")
            time.sleep(0.05)
        raw = asyncio.run(_drive(url, workload(setup, seed), setup))
        status = _status(url)
    ids = {r["url"]: r["id"] for r in status["replicas"]}
    raw["hosts"] = {("A" if u == urls[0] else "B"): ids.get(u) for u in urls}
    raw["measured"] = {r["id"]: r.get("measured") for r in status["replicas"]}
    return raw


def _figures(raw: dict[str, Any], setup: HeteroSetup) -> dict[str, Any]:
    """Seed-equivalent figures of one run (times x compression)."""
    k = setup.compression
    all_done = raw["completed"] == raw["sent"]
    slow_id = raw["hosts"].get("B")
    return {
        "sent": raw["sent"], "completed": raw["completed"],
        "completion_s": raw["last_s"] * k if all_done and raw["last_s"] is not None else None,
        "mean_wait_ms": statistics.fmean(raw["waits_s"]) * k * 1000 if raw["waits_s"] else None,
        "throughput": raw["completed"] / (raw["last_s"] * k) if raw["last_s"] else None,
        "share_b": (raw["served"].get(slow_id, 0) / raw["completed"]) if slow_id and raw["completed"] else None,
    }


def run_all(systems: Sequence[str], setup: HeteroSetup, *, run_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Every system, ``setup.seeds`` runs each (seeds 1..N); returns the result dict the report renders."""
    rows = []
    started = time.monotonic()
    for system in systems:
        runs = []
        for seed in range(1, setup.seeds + 1):
            raw = run_once(system, seed, setup, run_dir=run_dir)
            runs.append({"seed": seed, "raw": raw, "figures": _figures(raw, setup)})
            if progress:
                f = runs[-1]["figures"]
                print(f"[{time.monotonic() - started:6.1f} s] {system} seed {seed}: {f['completed']}/{f['sent']} "
                      f"completed, share on B {f['share_b']}", file=sys.stderr, flush=True)
        rows.append({"system": system, "runs": runs})
    scales = setup.time_scales()
    return {"setup": {**asdict(setup), "time_scale_a": scales[0], "time_scale_b": scales[1],
                      "cutoff_real_s": setup.cutoff_s},
            "rows": rows, "generated": now_label(), "wall_s": time.monotonic() - started}


def _agg(values: list, fmt: str, scale: float = 1.0) -> str:
    """Mean and range over runs ("N/A" runs counted apart)."""
    vals = [v * scale for v in values if v is not None]
    missing = len(values) - len(vals)
    if not vals:
        return "N/A"
    text = fmt.format(statistics.fmean(vals))
    if len(vals) > 1:
        text += f" ({fmt.format(min(vals))}-{fmt.format(max(vals))})"
    if missing:
        text += f"; N/A in {missing} of {len(values)}"
    return text


def _tp(v: float | None) -> str:
    return "N/A" if v is None else f"{v:.4e}".replace("e-0", "x10^-")


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The report: setup, the seed's Table 3, ours beside it (mean and range over seeds), per-run details."""
    s = result["setup"]
    lines = ["# Heterogeneous replicas: seed 000's Table 3, reproduced on emulated Ollama hosts", "",
             f"Generated {result['generated']} by `python -m bench.live.heterogeneous` in {result['wall_s']:.0f} s. "
             f"Two emulated Ollama replicas (`OLLAMA_NUM_PARALLEL` 1): host A at --time-scale "
             f"{s['time_scale_a']:.4f}, host B {s['slow_factor']:g}x slower ({s['time_scale_b']:.4f}). "
             f"{s['requests']} requests, one every {s['interval_s']:g} s, answers awaited until "
             f"{s['requests'] * s['interval_s'] + s['graceful_s']:g} s (seed time; compressed {s['compression']:g}x: "
             f"cut-off {s['cutoff_real_s']:.1f} s real). Prompts {s['prompt_chars'][0]}-{s['prompt_chars'][1]} "
             f"characters, outputs {s['output_tokens'][0]}-{s['output_tokens'][1]} tokens; {s['seeds']} seeds per "
             "system, each a fresh deployment (controller, balancer, emulators as real processes). Our times are "
             f"real times x {s['compression']:g} (seed-equivalent); mean (min-max) over seeds.", "",
             "## Seed 000, Table 3 (as published)", "",
             markdown_table(["Strategy", "Requests sent", "Completed", "Completion time (s)",
                             "Avg. request waiting time (ms)*", "Throughput (req/s)"],
                            [[n, sent, c, "N/A" if t is None else t, f"{w:.2f}", _tp(tp)]
                             for n, sent, c, t, w, tp in SEED_TABLE]),
             "", "*printed as seconds in the seed; the values are k6's `http_req_waiting` in milliseconds.", "",
             "## Ours (seed-equivalent units)", ""]
    rows = []
    for row in result["rows"]:
        figs = [r["figures"] for r in row["runs"]]
        rows.append([row["system"], SEED_ROW_OF.get(row["system"], "-"),
                     _agg([f["sent"] for f in figs], "{:.0f}"), _agg([f["completed"] for f in figs], "{:.1f}"),
                     _agg([f["completion_s"] for f in figs], "{:.0f}"),
                     _agg([f["mean_wait_ms"] for f in figs], "{:.0f}"),
                     _agg([f["throughput"] for f in figs], "{:.3e}"),
                     _agg([f["share_b"] for f in figs], "{:.2f}")])
    lines += [markdown_table(["System", "Seed's row", "Requests sent", "Completed", "Completion time (s)",
                              "Avg. request waiting time (ms)", "Throughput (req/s)", "Share on host B"], rows), ""]
    lines += ["## Runs", ""]
    det = []
    for row in result["rows"]:
        for r in row["runs"]:
            f, raw = r["figures"], r["raw"]
            det.append([row["system"], r["seed"], f"{f['completed']}/{f['sent']}",
                        "N/A" if raw["last_s"] is None else f"{raw['last_s']:.2f}",
                        "N/A" if not raw["waits_s"] else f"{statistics.fmean(raw['waits_s']):.3f}",
                        ", ".join(f"{h}={raw['served'].get(i, 0)}" for h, i in raw["hosts"].items()),
                        "; ".join(raw["errors"][:2]) or "-"])
    lines += [markdown_table(["System", "Seed", "Completed", "Last answer (real s)", "Mean wait (real s)",
                              "Served per host", "Errors"], det), ""]
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    d = HeteroSetup()
    p = argparse.ArgumentParser(prog="python -m bench.live.heterogeneous", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(DEFAULT_SYSTEMS))
    p.add_argument("--seeds", type=int, default=d.seeds, help="runs per system (workload seeds 1..N)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--compression", type=float, default=d.compression, help="seed seconds per real second")
    p.add_argument("--slow-factor", type=float, default=d.slow_factor, help="host B's slowness relative to A")
    p.add_argument("--out-md", default="bench/results/heterogeneous.md", help="Markdown report ('' for none)")
    p.add_argument("--out-json", default=None)
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    p.add_argument("--run-dir", default=None, help="logs (default: a new temporary directory)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup = HeteroSetup(requests=args.requests, compression=args.compression, slow_factor=args.slow_factor,
                        seeds=args.seeds)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="skylb-hetero-"))
    result = run_all(args.systems, setup, run_dir=run_dir, progress=not args.no_progress)
    notes = Path(args.notes).read_text() if args.notes else ""
    emit_markdown(format_markdown(result, notes), result, out_md=args.out_md or None, out_json=args.out_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
