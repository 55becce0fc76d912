"""How long the garbage collector stops a balancer, with its startup heap frozen (the default) and not.

Entry point: ``.venv/bin/python -m bench.live.gc_pauses [--requests 6000] [--clients 8] [--prompt-words 600]
[--repeats 2] [--out-md bench/results/gc_pauses.md]``; :func:`main` ``(argv) -> int``.

Method: per run, one emulator process serving 4 emulated vLLM replicas (batch 4, time scale 0.05) and one static
balancer (the default configuration, or with ``trie_kv_bound: false``: :data:`SETTINGS`) with ``SKYLB_GC_FREEZE``
unset (frozen) or ``0``; ``clients`` closed-loop threads send ``requests`` chat completions (whole answers of 8
tokens), each prompt ``prompt_words`` words of its own, so the balancer's prefix trie grows as a busy one's does: by
default to the replicas' KV caches (4 x 36k tokens x 4 characters), else to its own 8 M-character bound (6,000 x 600
words fill it), then it evicts as it inserts (its nodes at the end are reported). The balancer's
``skylb_gc_pause_seconds`` histogram (skylb/gc_pauses.py) is read before and after the load; the difference is the
load's collections: per generation, how many, their total, and how many lasted 10 ms or more and 25 ms or more
(bucket bounds). Also the balancer's CPU per request (/proc). The settings take turns within each repetition.
mean [min, max] over repetitions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.launch.procs import ProcGroup, free_port, free_ports, wait_http
from bench.reporting.provenance import provenance, provenance_line
from bench.replay.report import emit_markdown, markdown_table
from bench.replay.workload import VOCABULARY

__all__ = ["measure_once", "run", "render", "main"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPLICAS = 4
#: (label, SKYLB_GC_FREEZE, the replica trie bounded by the replicas' KV caches): the default, unfrozen, and both
#: with the trie kept to its own 8 M-character bound (``trie_kv_bound: false``; a fleet of large KV caches).
SETTINGS = (("frozen, trie bounded by KV (default)", None, True), ("not frozen, trie bounded by KV", "0", True),
            ("frozen, trie of 8 M characters", None, False), ("not frozen, trie of 8 M characters", "0", False))


def _pauses(url: str) -> dict[str, dict[str, float]]:
    """The balancer's ``skylb_gc_pause_seconds``: generation -> {"count", "sum", "le_0.01", "le_0.025"} (the
    cumulative bucket counts at 10 and 25 ms), parsed with prometheus_client's exposition parser."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {g: {} for g in ("0", "1", "2")}
    for family in text_string_to_metric_families(text):
        if family.name != "skylb_gc_pause_seconds":
            continue
        for sample in family.samples:
            kept = out[sample.labels["generation"]]
            if sample.name.endswith("_count"):
                kept["count"] = sample.value
            elif sample.name.endswith("_sum"):
                kept["sum"] = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) in (0.01, 0.025):
                kept[f"le_{float(sample.labels['le']):g}"] = sample.value
    return out


def _send(url: str, text: str) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 8, "ignore_eos": True,
                       "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        json.loads(resp.read())["choices"][0]  # a whole answer: ValueError / KeyError otherwise


def measure_once(*, freeze: str | None, kv_bound: bool, requests: int, clients: int, prompt_words: int, seed: int,
                 work: Path) -> dict:
    """One run: per generation {"count", "total_ms", "over_10ms", "over_25ms"} of the load's collections, and
    "cpu_ms_per_request", "requests_per_s". Raises RuntimeError when a request fails."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choices(VOCABULARY, k=prompt_words)) for _ in range(requests + 1)]
    with ProcGroup(work / "logs") as procs:
        ports = free_ports(REPLICAS)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", "0.05", "--max-num-seqs", "4",
                    "--no-request-log", *(a for p in ports for a in ("--port", str(p))), name="emulator",
                    wait_url=f"{urls[0]}/health")
        for url in urls[1:]:
            wait_http(f"{url}/health", timeout_s=10)
        url = f"http://127.0.0.1:{free_port()}"
        config = work / "balancer.yaml"
        config.write_text(json.dumps({"balancer": {"policies": {"skylb": {"trie_kv_bound": kv_bound}}}}))
        procs.skylb("balancer", "--config", str(config), "--region", "local", "--port", url.rsplit(":", 1)[1],
                    "--engine", "vllm", *(a for u in urls for a in ("--replica", u)), name="balancer",
                    wait_url=f"{url}/healthz", env={"SKYLB_GC_FREEZE": freeze or ""})
        deadline = time.monotonic() + 30
        while True:  # the first request waits for the replicas' first probes
            try:
                _send(url, prompts[-1])
                break
            except (OSError, ValueError, KeyError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the balancer did not answer within 30 s of its start") from None
                time.sleep(0.2)
        errors: list[str] = []
        jobs = iter(prompts[:-1])
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    text = next(jobs, None)
                if text is None:
                    return
                try:
                    _send(url, text)
                except Exception as exc:  # reported below: pauses measured over failures mean nothing
                    errors.append(repr(exc))

        threads = [threading.Thread(target=client) for _ in range(clients)]
        before, c0, t0 = _pauses(url), procs.cpu_seconds("balancer"), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after, c1, t1 = _pauses(url), procs.cpu_seconds("balancer"), time.monotonic()
        status = json.loads(urllib.request.urlopen(url + "/skylb/v1/status?format=json", timeout=10).read())
        trie = status.get("tries", {}).get("replica_trie", {})
    if errors:
        raise RuntimeError(f"{len(errors)} of {requests} requests failed, e.g. {errors[0]}")
    out = {"cpu_ms_per_request": 1000.0 * (c1 - c0) / requests, "requests_per_s": requests / (t1 - t0),
           "trie_nodes": trie.get("nodes"), "trie_chars": trie.get("chars")}
    for g in ("0", "1", "2"):
        a, b = after[g], before[g]
        count = a.get("count", 0) - b.get("count", 0)
        out[f"gen{g}"] = {"count": count, "total_ms": 1000.0 * (a.get("sum", 0) - b.get("sum", 0)),
                          "over_10ms": count - (a.get("le_0.01", 0) - b.get("le_0.01", 0)),
                          "over_25ms": count - (a.get("le_0.025", 0) - b.get("le_0.025", 0))}
    return out


def run(*, requests: int, clients: int, prompt_words: int, repeats: int) -> dict[str, list[dict]]:
    """Every setting ``repeats`` times, taking turns; setting label -> its runs."""
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="skylb-gc-pauses-") as tmp:
        for rep in range(repeats):
            for i, (label, freeze, kv_bound) in enumerate(SETTINGS):
                runs[label].append(measure_once(freeze=freeze, kv_bound=kv_bound, requests=requests, clients=clients,
                                                prompt_words=prompt_words, seed=rep,
                                                work=Path(tmp) / f"{i}-{rep}"))
                print(f"{label} run {rep}: {json.dumps(runs[label][-1])}", file=sys.stderr, flush=True)
    return runs


def _spread(values: list[float], fmt: str = "{:.1f}") -> str:
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def render(result: dict) -> str:
    """The Markdown report."""
    s = result["settings"]
    rows = []
    for label, runs in result["runs"].items():
        for g in ("0", "1", "2"):
            rows.append([label, g, _spread([r[f"gen{g}"]["count"] for r in runs], "{:.0f}"),
                         _spread([r[f"gen{g}"]["total_ms"] for r in runs]),
                         _spread([r[f"gen{g}"]["total_ms"] / max(1, r[f"gen{g}"]["count"]) for r in runs], "{:.2f}"),
                         _spread([r[f"gen{g}"]["over_10ms"] for r in runs], "{:.0f}"),
                         _spread([r[f"gen{g}"]["over_25ms"] for r in runs], "{:.0f}"),
                         _spread([r["cpu_ms_per_request"] for r in runs], "{:.2f}") if g == "0" else "",
                         _spread([r["requests_per_s"] for r in runs]) if g == "0" else "",
                         _spread([r["trie_nodes"] for r in runs], "{:.0f}") if g == "0" else ""])
    lines = ["# Garbage-collector pauses of a balancer: startup heap frozen or not (real processes)", "",
             provenance_line(result["provenance"]), "",
             f"{s['requests']} requests per run from {s['clients']} closed-loop clients, each prompt "
             f"{s['prompt_words']} words of its own, whole answers of 8 tokens, {result['repeats']} repetition(s) "
             "taking turns: mean [min, max]. Method: bench/live/gc_pauses.py (one static balancer, 4 emulated vLLM "
             "replicas in one emulator process; the balancer's `skylb_gc_pause_seconds` read before and after the "
             "load).", "",
             markdown_table(["Setting", "Generation", "Collections", "Total ms", "Mean ms", ">= 10 ms", ">= 25 ms",
                             "Balancer CPU ms/request", "Requests/s", "Trie nodes at the end"], rows), ""]
    if result.get("notes"):
        lines += [result["notes"].rstrip(), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.live.gc_pauses", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6000, help="requests per run")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--prompt-words", type=int, default=600, help="words in every prompt (each its own)")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of each setting")
    p.add_argument("--out-md", default=str(RESULTS / "gc_pauses.md"), help="report ('' for none; JSON beside it)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run, print the report and write it (and its JSON) unless ``--out-md ''``."""
    args = build_parser().parse_args(argv)
    runs = run(requests=args.requests, clients=args.clients, prompt_words=args.prompt_words, repeats=args.repeats)
    result = {"provenance": provenance(" ".join(["python -m bench.live.gc_pauses", *(argv or sys.argv[1:])])),
              "settings": {"requests": args.requests, "clients": args.clients, "prompt_words": args.prompt_words},
              "repeats": args.repeats, "runs": runs,
              "notes": Path(args.notes).read_text() if args.notes else None}
    emit_markdown(render(result), result, out_md=args.out_md or None,
                  out_json=str(Path(args.out_md).with_suffix(".json")) if args.out_md else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
