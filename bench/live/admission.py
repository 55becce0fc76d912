"""Seed 001's motivating case: a backlog of tasks across 10 models of different speeds and limits, drained three ways.

Entry point: ``.venv/bin/python -m bench.live.admission [--tasks N] [--seeds 1 2 3] [--out-md bench/results/admission.md]``
(:func:`main` ``(argv) -> int``).

Setup (real processes): 10 emulated vLLM replicas, one per model ``m0`` .. ``m9``, whose task latency spans 0.25 s
to 6 s (the seed's "~1 s - 2 min", scaled down ~1/20 so a run takes seconds); each model has a concurrency cap and
most a tokens-per-minute limit (:data:`MODELS`), given to SkyLB as ``quotas.models`` and the group ``all`` of the 10
models weighted by their throughput under those limits. Every task may be solved by any model (the seed's router
picks ``model_backend_id``); a task is a completion of ``prompt words + MAX_TOKENS`` tokens.

Ways to drain (each run on a fresh SkyLB controller and balancer, so buckets start full):

* ``skylb-admission``: SkyLB's admission API (seed iterations 1 and 2). Workers call ``POST /skylb/v1/schedule``
  ``{"model": "all", "estimated_tokens"}``, sleep ``wait_for_ms`` or call the chosen model through the balancer
  with ``X-SkyLB-Lease``, then ``POST /skylb/v1/complete`` with the tokens used. The number of workers follows
  ``GET /skylb/v1/advice``'s ``suggested_parallelism`` (polled every second; starting at 4).
* ``batch-direct``: the seed's as-is setup: 20 workers, each with a 20th of the backlog, send batches of 10 to the
  Models Backend's batch endpoint, answered when all 10 are done; the backend spreads a batch's tasks over the
  models round robin and calls the replicas directly, knowing nothing of the limits.
* ``batch-gated``: the same fixed batching, the backend calling through SkyLB with the group ``all`` (each call
  waits in the balancer until a model admits it): the limits are kept, the batching is the seed's.

Measured, from the replicas' own request logs (start = finish time - e2e): time to drain (first task sent to last
answered), limit overruns (a request that started while its model already ran ``max_concurrent`` requests, or
whose tokens broke the model's token bucket over some sliding window: tokens started in [t1, t2] > TPM + TPM/60 x
(t2 - t1 + 50 ms), the (sigma, rho) conformance of a bucket of TPM tokens refilled at TPM/60 per s, with 50 ms for
the jitter between admission and a replica's start: see :func:`overruns`), and per-model
utilisation (busy slots / cap over the drain; tokens / what the bucket allowed over the drain). Each way is run
once per seed (the seed draws the prompts' lengths and the backlog's order); the report gives the mean and the
spread (min - max) over seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from bench.launch.launchers import start_skylb
from bench.replay.report import emit_markdown, markdown_table
from bench.replay.sampling import MachineLoad, conditions_lines
from bench.launch.procs import ProcGroup, free_ports, wait_http

__all__ = ["ModelSpec", "MODELS", "MAX_TOKENS", "run_benchmark", "overruns", "format_markdown", "main"]

#: Completion tokens of every task (tokens); a task's latency is MAX_TOKENS decode steps.
MAX_TOKENS = 10
#: The group every task is sent to.
GROUP = "all"
MODES = ("skylb-admission", "batch-direct", "batch-gated")
#: The seed's fixed batching: 20 workers, batches of 10.
BATCH_WORKERS, BATCH_SIZE = 20, 10


@dataclass(frozen=True)
class ModelSpec:
    """One model: ``latency_s`` per task (s), ``max_concurrent`` (requests), ``tpm`` (tokens per minute; None:
    no token limit)."""

    name: str
    latency_s: float
    max_concurrent: int
    tpm: int | None

    def rate(self, task_tokens: float) -> float:
        """Tasks per second this model can take under its limits, once its initial bucket is spent."""
        by_slots = self.max_concurrent / self.latency_s
        return by_slots if self.tpm is None else min(by_slots, self.tpm / 60.0 / task_tokens)


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("m0", 0.25, 2, 1500), ModelSpec("m1", 0.35, 2, 2500), ModelSpec("m2", 0.5, 3, None),
    ModelSpec("m3", 0.7, 2, 2000), ModelSpec("m4", 1.0, 3, 3000), ModelSpec("m5", 1.4, 2, None),
    ModelSpec("m6", 2.0, 4, 2500), ModelSpec("m7", 2.8, 2, 1000), ModelSpec("m8", 4.0, 3, None),
    ModelSpec("m9", 6.0, 2, 600),
)


@dataclass
class Task:
    """One backlog item: its prompt and tokens (prompt words + MAX_TOKENS)."""

    id: int
    prompt: str
    tokens: int


def backlog(n: int, seed: int) -> list[Task]:
    """``n`` tasks with prompts of 20 to 60 words, in a seeded order."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        words = rng.randint(20, 60)
        prompt = " ".join(f"w{rng.randrange(10_000)}" for _ in range(words))
        tasks.append(Task(i, prompt, words + MAX_TOKENS))
    return tasks


def quotas(task_tokens: float) -> dict:
    """SkyLB's quotas for MODELS: per-model limits, and the group ``all`` weighted by each model's throughput."""
    return {"models": {m.name: {"max_concurrent": m.max_concurrent, **({"tokens_per_minute": m.tpm} if m.tpm else {})}
                       for m in MODELS},
            "groups": {GROUP: {m.name: round(m.rate(task_tokens), 3) for m in MODELS}}}


# ---- processes ---------------------------------------------------------------------------------------------------

def start_models(procs: ProcGroup) -> dict[str, str]:
    """One emulator process per model (its latency set by the decode step time); returns {model: URL}."""
    ports = free_ports(len(MODELS))
    urls = {}
    for spec, port in zip(MODELS, ports):
        step_ms = spec.latency_s * 1000.0 / MAX_TOKENS
        procs.skylb("emulator", "--engine", "vllm", "--model", spec.name, "--port", str(port),
                    "--decode-base-ms", f"{step_ms:g}", "--decode-ms-per-seq", "0", "--decode-ms-per-kv-token", "0",
                    "--prefill-ms-per-token", "0", name=f"emu-{spec.name}")
        urls[spec.name] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_http(f"{url}/health", timeout_s=30)
    return urls


def _read_requests(log: Path, offset: int) -> list[tuple[float, float, int]]:
    """(start, end, tokens) of the requests an emulator logged after byte ``offset`` of its log (wall clock, s)."""
    out = []
    with log.open("rb") as f:
        f.seek(offset)
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") != "request_finished":
                continue
            end = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((end - rec["e2e_ms"] / 1000.0, end, rec["prompt_tokens"] + rec["completion_tokens"]))
    return out


# ---- measures ------------------------------------------------------------------------------------------------------

def overruns(requests: Sequence[tuple[float, float, int]], spec: ModelSpec, *, tolerance_s: float = 0.002,
             lag_s: float = 0.05) -> dict:
    """Requests beyond ``spec``'s limits among ``requests`` [(start, end, tokens)] (wall clock, s).

    ``concurrency``: requests that started while ``max_concurrent`` others were running (an interval counts as
    running until ``tolerance_s`` before its logged end, which is taken a moment after the replica finished).
    ``tpm``: requests ending a window [t1, t2] of starts whose tokens exceed TPM + TPM/60 x (t2 - t1 + ``lag_s``).
    ``lag_s``: the starts are the replicas', a few ms after the balancer admitted each request, by a lag that
    varies from request to request; a bucket drained exactly to empty (as SkyLB's is when the limit binds) sits on
    the boundary, where that jitter alone would count fractions of a token as overruns. 50 ms is TPM/1200 tokens:
    1.25 tokens for the smallest TPM here, far below one task (about 50).
    """
    reqs = sorted(requests)
    concurrency = 0
    for i, (start, _, _) in enumerate(reqs):
        running = sum(1 for s, e, _ in reqs[:i] if s <= start < e - tolerance_s)
        if running >= spec.max_concurrent:
            concurrency += 1
    tpm = 0
    if spec.tpm is not None:
        rate = spec.tpm / 60.0
        for j, (t2, _, _) in enumerate(reqs):
            total = 0
            for i in range(j, -1, -1):
                t1, _, tokens = reqs[i]
                total += tokens
                if total > spec.tpm + rate * (t2 - t1 + lag_s) + 1e-6:
                    tpm += 1
                    break
    return {"concurrency": concurrency, "tpm": tpm}


def utilisation(requests: Sequence[tuple[float, float, int]], spec: ModelSpec, drain_s: float) -> dict:
    """``slots``: busy time / (cap x drain); ``tokens``: tokens / (TPM + TPM/60 x drain) (None without a TPM)."""
    busy = sum(e - s for s, e, _ in requests)
    tokens = sum(t for _, _, t in requests)
    return {"tasks": len(requests), "slots": busy / (spec.max_concurrent * drain_s) if drain_s > 0 else 0.0,
            "tokens": None if spec.tpm is None else tokens / (spec.tpm + spec.tpm / 60.0 * drain_s)}


# ---- the ways to drain ---------------------------------------------------------------------------------------------

async def _complete(http: aiohttp.ClientSession, url: str, model: str, task: Task,
                    headers: dict | None = None) -> dict:
    body = {"model": model, "prompt": task.prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"task {task.id} on {model}: HTTP {resp.status}: {data}")
        return data


async def drain_admission(balancer: str, tasks: list[Task], *, seed: int) -> dict:
    """Workers following /advice; each task: schedule (wait as told), call the chosen model with the lease,
    complete. Returns {"parallelism": [...], "schedule_calls": n}."""
    queue = deque(tasks)
    target = 4
    workers: set[asyncio.Task] = set()
    active = 0  # workers not yet leaving: the excess over ``target`` leave after their current task
    calls = 0
    parallelism = []
    rng = random.Random(seed)

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal calls, active
        while queue:
            if active > target:
                break
            task = queue.popleft()
            while True:
                calls += 1
                async with http.post(f"{balancer}/skylb/v1/schedule",
                                     json={"model": GROUP, "estimated_tokens": task.tokens}) as resp:
                    grant = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"schedule: HTTP {resp.status}: {grant}")
                if "wait_for_ms" in grant:
                    await asyncio.sleep(grant["wait_for_ms"] / 1000.0)
                    continue
                break
            data = await _complete(http, balancer, grant["model"], task, {"X-SkyLB-Lease": grant["lease_id"]})
            used = data["usage"]["total_tokens"]
            async with http.post(f"{balancer}/skylb/v1/complete",
                                 json={"lease_id": grant["lease_id"], "used_tokens": used}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"complete: HTTP {resp.status}: {await resp.text()}")
        active -= 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        while queue or workers:
            while queue and active < target:
                active += 1
                t = asyncio.create_task(worker(http))
                workers.add(t)
                t.add_done_callback(workers.discard)
            done = [t for t in list(workers) if t.done()]
            for t in done:
                t.result()
            await asyncio.sleep(1.0 + rng.uniform(-0.05, 0.05))
            async with http.get(f"{balancer}/skylb/v1/advice") as resp:
                advice = await resp.json()
            target = advice["suggested_parallelism"]
            parallelism.append(target)
            for t in [t for t in list(workers) if t.done()]:
                t.result()
    return {"parallelism": parallelism, "schedule_calls": calls}


async def drain_batches(tasks: list[Task], call) -> dict:
    """The seed's fixed batching: BATCH_WORKERS workers, each with an equal share of the backlog, send batches of
    BATCH_SIZE to the batch endpoint (``call`` for each task, all at once; the batch is answered when all are)."""
    shares = [tasks[i::BATCH_WORKERS] for i in range(BATCH_WORKERS)]
    counter = iter(range(10 ** 9))

    async def batch_endpoint(batch: list[Task]) -> None:
        await asyncio.gather(*(call(task, next(counter)) for task in batch))

    async def worker(share: list[Task]) -> None:
        for i in range(0, len(share), BATCH_SIZE):
            await batch_endpoint(share[i:i + BATCH_SIZE])

    await asyncio.gather(*(worker(s) for s in shares))
    return {}


async def run_mode(mode: str, tasks: list[Task], *, balancer: str, models: dict[str, str], seed: int) -> dict:
    """Drain ``tasks`` one way; returns its extra figures."""
    if mode == "skylb-admission":
        return await drain_admission(balancer, tasks, seed=seed)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        if mode == "batch-direct":
            names = [m.name for m in MODELS]

            async def call(task: Task, n: int) -> None:
                model = names[n % len(names)]
                await _complete(http, models[model], model, task)
        else:
            async def call(task: Task, n: int) -> None:
                await _complete(http, balancer, GROUP, task)
        return await drain_batches(tasks, call)


# ---- the benchmark --------------------------------------------------------------------------------------------------

def run_benchmark(*, n_tasks: int, seeds: Sequence[int], modes: Sequence[str] = MODES,
                  work_dir: Path | None = None) -> dict[str, Any]:
    """Run every mode once per seed; returns the JSON-ready result (per run: drain, overruns, utilisation)."""
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="skylb-bench-admission-"))
    mean_tokens = sum(t.tokens for t in backlog(n_tasks, seeds[0])) / n_tasks
    runs = []
    load = MachineLoad().start()
    with ProcGroup(work_dir / "logs") as procs:
        models = start_models(procs)
        logs = {m.name: work_dir / "logs" / f"emu-{m.name}.log" for m in MODELS}
        for seed in seeds:
            for mode in modes:
                tasks = backlog(n_tasks, seed)
                before = len(procs.procs)
                balancer = start_skylb(procs, list(models.values()), run_dir=work_dir, name=f"skylb-{mode}-{seed}",
                                       overrides={"quotas": quotas(mean_tokens), "quota": {"wait_s": 900},
                                                  "max_dispatch_per_probe": 0})
                _wait_models_known(balancer)
                offsets = {m: p.stat().st_size for m, p in logs.items()}
                started = time.time()
                extra = asyncio.run(run_mode(mode, tasks, balancer=balancer, models=models, seed=seed))
                drain_s = time.time() - started
                time.sleep(0.3)  # the emulators' last log lines
                per_model = {}
                for spec in MODELS:
                    reqs = [r for r in _read_requests(logs[spec.name], offsets[spec.name])]
                    per_model[spec.name] = {**overruns(reqs, spec), **utilisation(reqs, spec, drain_s)}
                done = sum(v["tasks"] for v in per_model.values())
                runs.append({"mode": mode, "seed": seed, "drain_s": drain_s, "tasks": n_tasks, "done": done,
                             "per_model": per_model, **extra})
                print(f"{mode} seed {seed}: {drain_s:.1f} s, {done} tasks, overruns "
                      f"{sum(v['concurrency'] + v['tpm'] for v in per_model.values())}", flush=True)
                for proc in reversed(procs.procs[before:]):  # this run's balancer and controller
                    proc.stop()
    return {"n_tasks": n_tasks, "seeds": list(seeds), "modes": list(modes), "runs": runs,
            "models": [m.__dict__ for m in MODELS], "mean_task_tokens": mean_tokens, "load": load.stop()}


def _wait_models_known(balancer: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with_models = [r for r in _get(f"{balancer}/skylb/v1/status?format=json")["replicas"] if r["models"]]
        if len(with_models) == len(MODELS):
            return
        time.sleep(0.1)
    raise RuntimeError("the balancer did not learn every replica's models")


def _get(url: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _spread(values: list[float], fmt: str = "{:.1f}") -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(values))} - {fmt.format(max(values))})"


def format_markdown(result: dict[str, Any]) -> str:
    """The report: the summary table per mode, per-model utilisation, the models, the conditions."""
    runs = result["runs"]
    lines = ["# Admission API vs fixed batching (seed 001's motivating case)", "",
             f"{result['n_tasks']} tasks (mean {result['mean_task_tokens']:.0f} tokens) across 10 emulated models; "
             f"seeds {', '.join(map(str, result['seeds']))}; mean (min - max) over seeds. Command: "
             f"`python -m bench.live.admission --tasks {result['n_tasks']} --seeds "
             f"{' '.join(map(str, result['seeds']))}`.", "",
             "## Summary", ""]
    rows = []
    for mode in result["modes"]:
        mine = [r for r in runs if r["mode"] == mode]
        conc = [sum(v["concurrency"] for v in r["per_model"].values()) for r in mine]
        tpm = [sum(v["tpm"] for v in r["per_model"].values()) for r in mine]
        slots = [sum(v["slots"] for v in r["per_model"].values()) / len(r["per_model"]) for r in mine]
        rows.append([mode, _spread([r["drain_s"] for r in mine]),
                     _spread([r["done"] / r["drain_s"] for r in mine], "{:.2f}"),
                     _spread([float(c) for c in conc], "{:.0f}"), _spread([float(t) for t in tpm], "{:.0f}"),
                     _spread([100 * s for s in slots], "{:.0f}"),
                     _spread([float(sum(r.get("parallelism", [0])) / max(1, len(r.get("parallelism", [0]))))
                              for r in mine], "{:.1f}") if mode == "skylb-admission" else
                     f"{BATCH_WORKERS} x {BATCH_SIZE}"])
    lines.append(markdown_table(["way", "time to drain (s)", "tasks/s", "concurrency overruns", "TPM overruns",
                                 "mean slot utilisation (%)", "parallelism"], rows))
    lines += ["", "Overruns: requests the replicas started beyond their model's cap, or whose tokens broke the "
              "model's token bucket over a sliding window (module docstring). Parallelism: mean of /advice's "
              "suggested_parallelism (workers), or the fixed workers x batch size.", "",
              "## Per model (mean over seeds)", ""]
    header = ["model", "latency (s)", "cap", "TPM"]
    for mode in result["modes"]:
        header += [f"{mode} tasks", f"{mode} slots %", f"{mode} TPM %"]
    rows = []
    for spec in result["models"]:
        row = [spec["name"], f"{spec['latency_s']:g}", spec["max_concurrent"], spec["tpm"] or "-"]
        for mode in result["modes"]:
            mine = [r["per_model"][spec["name"]] for r in runs if r["mode"] == mode]
            row.append(f"{sum(m['tasks'] for m in mine) / len(mine):.0f}")
            row.append(f"{100 * sum(m['slots'] for m in mine) / len(mine):.0f}")
            row.append("-" if spec["tpm"] is None else
                       f"{100 * sum(m['tokens'] for m in mine) / len(mine):.0f}")
        rows.append(row)
    lines.append(markdown_table(header, rows))
    lines += ["", "Slots %: busy time / (cap x time to drain). TPM %: tokens / (TPM + TPM/60 x time to drain), what "
              "a full bucket allows over the drain.", ""]
    lines += conditions_lines(result["load"], [], "shared with other engineers' work")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run, print and write the report."""
    parser = argparse.ArgumentParser(prog="python -m bench.live.admission", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=300, help="backlog size (tasks; default 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds (default 1 2 3)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out-md", default="bench/results/admission.md")
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    result = run_benchmark(n_tasks=args.tasks, seeds=args.seeds, modes=args.modes)
    emit_markdown(format_markdown(result), result, out_md=args.out_md, out_json=args.out_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
