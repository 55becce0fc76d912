"""Fixed concurrency, as the field's load generators run it: does any request wait behind a full batch?

The load of kubernetes-sigs inference-perf's (and guidellm's, AIPerf's) concurrency mode: ``clients`` closed-loop
clients, each sending ``per_client`` streamed completions one after the other, every prompt ``prompt_tokens``
random words (no prefix shared, so locality decides nothing) and ``max_tokens`` output tokens with ``ignore_eos``.
With as many clients as batch slots in all (16 clients, 4 emulated vLLM replicas of batch 4), a balancer that keeps
one request per free slot never lets a request wait in a replica's queue; one that pushes a request into a full
batch while another replica has a free slot makes it wait there for a whole generation.

Per system (SkyLB's default configuration, HAProxy ``leastconn`` with ``maxconn`` = the batch: bench/live/baselines.py
``SYSTEMS``) and run: TTFT p50 / p99 and throughput at the client, and from the replicas' own request log
(``request_finished``: ``queue_ms``, the time from arrival to the engine step that first scheduled it) how many
requests waited in a replica's queue longer than ``queued_ms`` (1 s: a request arriving during an engine step
waits for that step to end, and a step holding 512-token prefills lasts a few hundred ms at time scale 1, HAProxy's
requests waited up to 545 ms so; a request that waited for a batch slot waits for a whole generation, seconds)
and the longest such wait. Runs are paired
(every system runs each seed, seed by seed) and the report gives mean [min, max] over them.

    .venv/bin/python -m bench.live.concurrency [--runs 3] [--systems skylb haproxy-leastconn] [--out-md FILE]

Targets (issue of the project's tracker on routing that holds on unseen work): no request waits behind a full
batch; SkyLB's TTFT p99 at most 1.2x HAProxy leastconn's; its throughput at least HAProxy's. Judged for the
default configuration (``skylb``: the replicas' batch learned from their probes) and for any other SkyLB system
run, such as ``skylb-stated-batch`` (the batch stated with ``--max-concurrency``, the figure HAProxy's ``maxconn``
is given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from tabulate import tabulate

from bench.live.baselines import SYSTEMS, BaselinesSetup, configured
from bench.live.harness import summarize
from bench.launch.launchers import MODEL, Unavailable, start_emulator, start_system, unavailable_reason
from bench.launch.procs import ProcGroup, free_ports
from bench.reporting.provenance import provenance, provenance_line
from bench.replay.run import replay
from bench.replay.workload import VOCABULARY, Request

__all__ = ["ConcurrencySetup", "workload", "engine_queue_waits", "run", "format_markdown", "main"]

DEFAULT_SYSTEMS = ("skylb", "haproxy-leastconn")


@dataclass
class ConcurrencySetup:
    """The load and the replicas (module docstring); units in the names, lengths in tokens (= words)."""

    replicas: int = 4
    max_num_seqs: int = 4
    time_scale: float = 1.0
    clients: int = 16
    per_client: int = 10
    prompt_tokens: int = 512
    max_tokens: int = 64
    queued_ms: float = 1000.0
    request_timeout_s: float = 120.0
    deadline_s: float = 600.0


def workload(setup: ConcurrencySetup, seed: int) -> list[Request]:
    """``clients`` chains of ``per_client`` requests, each sent as soon as the one before it ended."""
    rng = random.Random(seed)
    out = []
    for c in range(setup.clients):
        prev = None
        for k in range(setup.per_client):
            rid = f"conc-{seed}-{c:02d}-{k:02d}"
            text = " ".join(rng.choices(VOCABULARY, k=setup.prompt_tokens))
            out.append(Request(id=rid, arrival_s=0.0, region="us", session_id=f"client-{c}",
                               prompt_tokens=setup.prompt_tokens, output_tokens=setup.max_tokens, turn=k,
                               after=prev, text=text))
            prev = rid
    return out


def engine_queue_waits(emulator_log: str, min_prompt_tokens: int) -> list[float]:
    """The ``queue_ms`` of every ``request_finished`` line of the emulator's log whose prompt had at least
    ``min_prompt_tokens`` tokens (the warm-up's tiny requests left out)."""
    waits = []
    for line in emulator_log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request_finished" and entry.get("prompt_tokens", 0) >= min_prompt_tokens:
            waits.append(float(entry["queue_ms"]))
    return waits


def run_one(name: str, setup: ConcurrencySetup, seed: int, run_dir: Path) -> dict[str, Any]:
    """One system, one seed, on fresh replicas: its figures, or ``status`` "skipped" / "failed" with the reason."""
    system = configured(SYSTEMS[name], BaselinesSetup(replicas=setup.replicas, max_num_seqs=setup.max_num_seqs,
                                                      request_timeout_s=setup.request_timeout_s))
    reason = unavailable_reason(system.kind)
    if reason:
        return {"system": name, "seed": seed, "status": "skipped", "reason": reason}
    requests = workload(setup, seed)
    try:
        with ProcGroup(run_dir / f"{name}-{seed}" / "logs") as procs:
            replica_urls = start_emulator(procs, free_ports(setup.replicas), time_scale=setup.time_scale,
                                          max_num_seqs=setup.max_num_seqs, name="emulator", request_log=True)
            url = start_system(procs, system, replica_urls, run_dir=run_dir / f"{name}-{seed}")
            result = asyncio.run(replay(requests, {"us": url}, model=MODEL, request_timeout_s=setup.request_timeout_s,
                                        deadline_s=setup.deadline_s, progress=False))
            log = next(p for p in procs.procs if p.name == "emulator").log()
    except (RuntimeError, Unavailable, OSError) as exc:
        return {"system": name, "seed": seed, "status": "failed", "reason": str(exc)[:2000]}
    figures = summarize(result.records, result.wall_s)
    waits = engine_queue_waits(log, setup.prompt_tokens)
    figures["engine_queued"] = sum(w > setup.queued_ms for w in waits)
    figures["engine_queue_max_ms"] = max(waits, default=0.0)
    figures["engine_logged"] = len(waits)
    figures["engine_queue_ms"] = sorted(round(w, 1) for w in waits)  # every request's, for another threshold
    return {"system": name, "seed": seed, "status": "ok", "figures": figures}


def run(systems: Sequence[str], setup: ConcurrencySetup, seeds: Sequence[int], run_dir: Path,
        progress: bool = True) -> dict[str, Any]:
    """Every system once per seed, seed by seed; returns ``{"setup", "seeds", "rows"}``."""
    rows = []
    for seed in seeds:
        for name in systems:
            if progress:
                print(f"[bench.live.concurrency] seed {seed} {name} ...", file=sys.stderr, flush=True)
            rows.append(run_one(name, setup, seed, run_dir))
    return {"setup": asdict(setup), "seeds": list(seeds), "systems": list(systems), "rows": rows}


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "-"
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def _ok(result: dict, name: str) -> list[dict]:
    return [r["figures"] for r in result["rows"] if r["system"] == name and r["status"] == "ok"]


def targets(result: dict, name: str = "skylb") -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for SkyLB system ``name`` against HAProxy leastconn; met is None when either did not
    run."""
    me, ha = _ok(result, name), _ok(result, "haproxy-leastconn")
    if not me or not ha:
        return [(t, f"{name} or haproxy-leastconn did not run", None) for t in (
            "no request waits in a replica's queue behind a full batch", "TTFT p99 <= 1.2x HAProxy leastconn's",
            "throughput >= HAProxy leastconn's")]
    queued = sum(f["engine_queued"] for f in me)
    p99, ha_p99 = statistics.fmean(f["ttft_p99_ms"] for f in me), statistics.fmean(f["ttft_p99_ms"] for f in ha)
    rps, ha_rps = statistics.fmean(f["throughput_rps"] for f in me), statistics.fmean(f["throughput_rps"] for f in ha)
    return [("no request waits in a replica's queue behind a full batch",
             f"{queued} of {sum(f['engine_logged'] for f in me)} waited > {result['setup']['queued_ms']:g} ms",
             queued == 0),
            ("TTFT p99 <= 1.2x HAProxy leastconn's", f"{p99:.0f} ms vs {ha_p99:.0f} ms ({p99 / ha_p99:.2f}x)",
             p99 <= 1.2 * ha_p99),
            ("throughput >= HAProxy leastconn's", f"{rps:.3f} vs {ha_rps:.3f} req/s", rps >= ha_rps)]


def format_markdown(result: dict) -> str:
    """The report: provenance, setup, per system mean [min, max] over the runs, each run, the targets."""
    s = result["setup"]
    lines = ["# Fixed concurrency: does any request wait behind a full batch?", "",
             provenance_line(result["provenance"]), "",
             f"{s['clients']} closed-loop clients x {s['per_client']} streamed completions each, prompts of "
             f"{s['prompt_tokens']} random words (no shared prefix), {s['max_tokens']} output tokens (`ignore_eos`); "
             f"{s['replicas']} emulated vLLM replicas, `--max-num-seqs {s['max_num_seqs']}`, time scale "
             f"{s['time_scale']:g}; seeds {', '.join(map(str, result['seeds']))}, paired (every system per seed). "
             f"Engine-queued: requests the replicas' own log shows waiting more than {s['queued_ms']:g} ms before "
             "their first engine step (`queue_ms`).", ""]
    summary = []
    for name in result["systems"]:
        f = _ok(result, name)
        summary.append([name, len(f), _spread([x["throughput_rps"] for x in f], "{:.3f}"),
                        _spread([x["ttft_p50_ms"] for x in f]), _spread([x["ttft_p99_ms"] for x in f]),
                        _spread([x["engine_queued"] for x in f], "{:.1f}"),
                        _spread([x["engine_queue_max_ms"] for x in f])])
    lines += [tabulate(summary, ["system", "runs", "req/s", "TTFT p50 ms", "TTFT p99 ms", "engine-queued",
                                 "longest engine queue ms"], tablefmt="github"), "", "Each run:", ""]
    each = [[r["system"], r["seed"], r["status"]] + ([
        f"{r['figures']['completed']}/{r['figures']['sent']}", f"{r['figures']['throughput_rps']:.3f}",
        f"{r['figures']['ttft_p50_ms']:.0f}", f"{r['figures']['ttft_p99_ms']:.0f}", r["figures"]["engine_queued"],
        f"{r['figures']['engine_queue_max_ms']:.0f}"] if r["status"] == "ok" else [r.get("reason", "")[:80]])
        for r in result["rows"]]
    lines += [tabulate(each, ["system", "seed", "status", "ok/sent", "req/s", "TTFT p50", "TTFT p99",
                              "engine-queued", "longest queue ms"], tablefmt="github"), ""]
    # The default configuration's targets, then those of any other SkyLB configuration run beside it.
    for name in ["skylb"] + [n for n in result["systems"] if n.startswith("skylb-")]:
        lines += ["## Targets" + ("" if name == "skylb" else f" of `{name}`"), ""]
        lines += [tabulate([[t, m, "not judged" if ok is None else "MET" if ok else "MISSED"]
                            for t, m, ok in targets(result, name)], ["target", "measured", "verdict"],
                           tablefmt="github"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live.concurrency", description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--runs", type=int, default=3, help="paired runs (seeds 0..runs-1)")
    d = ConcurrencySetup()
    for field in ("replicas", "max_num_seqs", "time_scale", "clients", "per_client", "prompt_tokens", "max_tokens",
                  "queued_ms"):
        p.add_argument("--" + field.replace("_", "-"), type=type(getattr(d, field)), default=getattr(d, field))
    p.add_argument("--out-md", default="bench/results/concurrency.md", help="report ('' for none)")
    p.add_argument("--out-json", default=None, help="raw result (default: beside the report)")
    args = p.parse_args(argv)
    setup = ConcurrencySetup(**{k: getattr(args, k) for k in ("replicas", "max_num_seqs", "time_scale", "clients",
                                                              "per_client", "prompt_tokens", "max_tokens",
                                                              "queued_ms")})
    prov = provenance()
    with tempfile.TemporaryDirectory(prefix="skylb-concurrency-") as tmp:
        result = run(args.systems, setup, list(range(args.runs)), Path(tmp))
    result["provenance"] = prov
    text = format_markdown(result)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")
        Path(args.out_json or str(Path(args.out_md).with_suffix(".json"))).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
