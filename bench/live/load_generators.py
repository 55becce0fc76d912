"""The field's load generators against a balancer: the README's recipe run as written, with AIPerf.

``skylb bench load_generators --aiperf PATH [--requests 40] [--concurrency 4] [--out-md PATH]``: starts two
emulated vLLM replicas (batch 4) and one static balancer in front of them on loopback, writes an offline tokenizer
(a Hugging Face ``tokenizer.json`` with a word-level vocabulary, made with the ``tokenizers`` library of AIPerf's own
environment: no network, no model download), runs AIPerf's ``profile`` with the README's options (streamed
``/v1/chat/completions``, 256-token synthetic prompts, 64 output tokens) and reports what AIPerf counted (requests,
errors, TTFT, throughput) beside what the balancer logged (its one line per request, by status). Every process it
starts is stopped at the end, also on failure. Returns 0 when AIPerf finished with no error and the balancer
answered every request 200, 1 otherwise, 2 when AIPerf is not there.

AIPerf is not one of the project's dependencies: it brings about 1.2 GB of packages (dash, plotly, scipy, pandas,
pyarrow, transformers, kubernetes clients). Install it apart: ``python3 -m venv .venv-aiperf &&
.venv-aiperf/bin/pip install aiperf``, then ``--aiperf .venv-aiperf/bin/aiperf``. guidellm (it requires torch) and
kubernetes-sigs inference-perf (Python 3.12 or later) are not run here; README, "Load generators against a
balancer", gives their commands from their documentation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.launch.procs import ProcGroup, free_ports, wait_http
from bench.replay.workload import VOCABULARY

__all__ = ["run", "main", "MODEL"]

MODEL = "gemma-3-270m-q4_k_m"  # the id the README's recipe uses (any id the replicas serve would do)

#: Writes a word-level tokenizer into argv[1] (run by AIPerf's interpreter, which has ``tokenizers``).
_TOKENIZER_SCRIPT = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
words = ["[UNK]"] + sorted(set(Path(sys.argv[2]).read_text().split()))
tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                       "unk_token": "[UNK]", "model_max_length": 1000000}))
"""


def _aiperf_python(aiperf: Path) -> Path:
    """The interpreter of AIPerf's environment (the ``python`` beside its entry point, else its shebang's)."""
    beside = aiperf.parent / "python"
    if beside.exists():
        return beside
    first = aiperf.read_text(errors="replace").splitlines()[0]
    return Path(first.removeprefix("#!").strip())


def _statuses(log: Path) -> Counter:
    """The balancer's request lines by status (its JSON log: one ``"event": "request"`` line per request)."""
    found: Counter = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if '"request"' in line and "{" in line:
            try:
                obj = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            if obj.get("event") == "request":
                found[obj.get("status")] += 1
    return found


def _figure(doc: dict, key: str, stat: str) -> float | None:
    value = doc.get(key)
    return value.get(stat) if isinstance(value, dict) else None


def run(aiperf: Path, work: Path, *, requests: int, concurrency: int) -> dict:
    """Start the replicas and the balancer, run AIPerf against the balancer; returns the figures (see the module
    docstring). Raises RuntimeError when a process does not start."""
    with ProcGroup(work / "logs") as procs:
        r1, r2, port = free_ports(3)
        for p in (r1, r2):
            procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", str(p), "--max-num-seqs", "4",
                        "--no-request-log", name=f"replica-{p}", wait_url=f"http://127.0.0.1:{p}/health")
        balancer = procs.skylb("balancer", "--replica", f"http://127.0.0.1:{r1}", "--replica",
                               f"http://127.0.0.1:{r2}", "--port", str(port), name="balancer",
                               wait_url=f"http://127.0.0.1:{port}/health")
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=20)
        words = work / "words.txt"
        words.write_text(" ".join(VOCABULARY))  # the benchmark workloads' words; AIPerf's own text maps to [UNK]
        subprocess.run([str(_aiperf_python(aiperf)), "-c", _TOKENIZER_SCRIPT, str(work / "tokenizer"), str(words)],
                       check=True, timeout=120, capture_output=True)
        argv = [str(aiperf), "profile", "--url", f"http://127.0.0.1:{port}", "--model", MODEL,
                "--endpoint-type", "chat", "--streaming", "--tokenizer", str(work / "tokenizer"),
                "--concurrency", str(concurrency), "--request-count", str(requests),
                "--synthetic-input-tokens-mean", "256", "--output-tokens-mean", "64",
                "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(work / "aiperf")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        export = work / "aiperf" / "profile_export_aiperf.json"
        doc = json.loads(export.read_text()) if export.exists() else {}
        statuses = _statuses(balancer.log_path)
    version = subprocess.run([str(aiperf), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    errors = doc.get("error_summary")
    return {"aiperf_version": version, "command": " ".join(["aiperf", *argv[1:]]), "exit": done.returncode,
            "requests": requests, "concurrency": concurrency,
            # AIPerf's export: request_count counts the valid ones; error_summary lists errors by kind with counts
            "aiperf_valid": None if _figure(doc, "request_count", "avg") is None
            else int(_figure(doc, "request_count", "avg")),
            "aiperf_errors": None if errors is None else sum(int(e.get("count", 1)) for e in errors),
            "error_summary": errors,
            "ttft_p50_ms": _figure(doc, "time_to_first_token", "p50"),
            "ttft_p99_ms": _figure(doc, "time_to_first_token", "p99"),
            "request_throughput": _figure(doc, "request_throughput", "avg"),
            "output_tokens_mean": _figure(doc, "output_sequence_length", "avg"),
            "balancer_statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
            "stderr_tail": done.stderr[-2000:] if done.returncode else ""}


def passed(result: dict) -> bool:
    """AIPerf finished, counted every request valid and none in error, and the balancer answered each with 200."""
    return (result["exit"] == 0 and result["aiperf_valid"] == result["requests"] and result["aiperf_errors"] == 0
            and not result["error_summary"] and result["balancer_statuses"] == {"200": result["requests"]})


def format_markdown(result: dict) -> str:
    """The report of one run."""
    ok = passed(result)
    return "\n".join([
        "# The field's load generators against a balancer: AIPerf", "",
        f"AIPerf {result['aiperf_version']} ran the README's recipe (\"Load generators against a balancer\") "
        "against one static balancer in front of two emulated vLLM replicas (batch 4) on loopback, offline, with a "
        "word-level tokenizer written for the run (bench/live/load_generators.py):", "",
        f"    {result['command']}", "",
        f"- AIPerf: exit {result['exit']}, {result['aiperf_valid']} valid requests and {result['aiperf_errors']} "
        f"errors of {result['requests']}; error summary {result['error_summary'] or 'empty'}",
        f"- the balancer's request lines by status: {result['balancer_statuses']}",
        f"- TTFT p50 {result['ttft_p50_ms']:.0f} ms, p99 {result['ttft_p99_ms']:.0f} ms; "
        f"{result['request_throughput']:.2f} requests/s; {result['output_tokens_mean']:.1f} output tokens per "
        "request (64 asked, `ignore_eos`)" if result["ttft_p50_ms"] is not None else "- no figures exported",
        "", f"Verdict: {'no error, every request answered 200' if ok else 'FAILED'}.", "",
        "Not run here: guidellm (it requires torch, whose PyPI wheels for Linux bring the CUDA libraries) and "
        "kubernetes-sigs inference-perf (it requires Python 3.12; this machine has 3.11). Their commands in the "
        "README come from their documentation.",
        *(["", "AIPerf's stderr (tail):", "", "```", result["stderr_tail"], "```"] if result["stderr_tail"] else [])])


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    from bench.replay.report import emit_markdown
    p = argparse.ArgumentParser(prog="skylb bench load_generators", description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", type=Path, default=Path(shutil.which("aiperf") or ".venv-aiperf/bin/aiperf"),
                   help="AIPerf's entry point (default: aiperf on PATH, else .venv-aiperf/bin/aiperf)")
    p.add_argument("--requests", type=int, default=40, help="requests AIPerf sends (default: 40)")
    p.add_argument("--concurrency", type=int, default=4, help="AIPerf's concurrency (default: 4)")
    p.add_argument("--out-md", default=None, metavar="PATH", help="also write the report here "
                   "(e.g. bench/results/load_generators.md)")
    p.add_argument("--out-json", default=None, metavar="PATH", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if not args.aiperf.is_file():
        print(f"AIPerf not found at {args.aiperf}: install it apart (python3 -m venv .venv-aiperf && "
              ".venv-aiperf/bin/pip install aiperf) and pass --aiperf .venv-aiperf/bin/aiperf", file=sys.stderr)
        return 2
    if args.requests < 1 or args.concurrency < 1:
        print("--requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="skylb-loadgen-") as tmp:
        result = run(args.aiperf.resolve(), Path(tmp), requests=args.requests, concurrency=args.concurrency)
    emit_markdown(format_markdown(result), result, out_md=args.out_md, out_json=args.out_json)
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
