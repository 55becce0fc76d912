"""Load and soak: many concurrent streams over three regions of emulated replicas for minutes, with replicas killed
and restarted during the run; checks that no request is lost or answered twice and that the balancers' memory and
prefix tries stay flat after warm-up (issue 10, item 8).

Entry points: ``.venv/bin/python -m bench.live.soak [--duration-s 600] [--streams 200] [--out-md
bench/results/soak.md]`` or ``skylb bench soak``; :func:`main` ``(argv) -> int``. Every process is stopped at the
end, also on failure; the load is bounded in time (``--duration-s``) and each request in time (``--request-timeout-s``).

A request's outcome, as its client sees it:
- ``ok``: 200, a stream whose chunks all carry one completion id, one ``finish_reason``, one ``[DONE]``;
- ``error_event``: the stream ended with a well-formed ``data: {"error": ...}`` chunk (its replica died mid-stream);
- ``http_<status>``: an error answer in the API's shape (``{"error": {...}}``), e.g. 503 when nothing had room;
- ``lost``: anything else: a connection reset, a timeout, a stream cut without an error, an unparseable body;
- ``duplicated``: a stream with two completion ids, two ``finish_reason`` chunks or two ``[DONE]`` (spliced or
  retried generations).
The target is lost = 0 and duplicated = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.live.harness import now_label
from bench.replay.report import emit_markdown, markdown_table
from bench.launch.procs import ProcGroup, free_port, wait_http

__all__ = ["run_soak", "classify_stream", "format_markdown", "main"]

REGIONS = ("us", "eu", "asia")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: Shared system prompts (prefix reuse, so the tries fill and must stay bounded).
SYSTEMS = [f"You are assistant number {i}. " + "Follow the house style guide carefully. " * 40 for i in range(50)]


def classify_stream(status: int, body: bytes) -> str:
    """The outcome of one streamed chat completion (see the module docstring) from its HTTP status and raw body."""
    if status != 200:
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return "lost"
        return f"http_{status}" if isinstance(error, dict) and error.get("message") else "lost"
    ids, finishes, done, error = set(), 0, 0, False
    for line in body.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done += 1
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return "lost"
        if "error" in chunk:
            error = True
            continue
        ids.add(chunk.get("id"))
        finishes += sum(1 for c in chunk.get("choices", []) if c.get("finish_reason"))
    if len(ids) > 1 or finishes > 1 or done > 1:
        return "duplicated"
    if error:
        return "error_event"
    return "ok" if done == 1 and finishes == 1 else "lost"


def error_message(body: bytes) -> str | None:
    """The message of an error answer (``{"error": {"message"}}``) or of a stream's error chunk, or None."""
    for part in (body, *(line[6:] for line in body.split(b"\n") if line.startswith(b"data: {"))):
        try:
            error = json.loads(part).get("error")
        except (ValueError, AttributeError):
            continue
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return None


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


#: This run's peer token (several regions: the balancers need one), in the config of every process it starts.
_PEER_TOKEN = secrets.token_urlsafe(24)


def _get(url: str) -> dict:
    request = urllib.request.Request(url, headers={"X-SkyLB-Token": _PEER_TOKEN})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


async def _client(session: aiohttp.ClientSession, urls: list[str], rng: random.Random, until: float,
                  outcomes: Counter, timeout_s: float, errors: Counter) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        body = {"model": MODEL, "stream": True, "max_tokens": rng.randint(8, 48),
                "messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                             {"role": "user", "content": f"question {rng.random()} number {n}"}]}
        try:
            async with session.post(f"{rng.choice(urls)}/v1/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                raw = await resp.read()
                outcome = classify_stream(resp.status, raw)
                outcomes[outcome] += 1
                if outcome != "ok":  # what the client was told, for the report (ids and addresses vary: cut short)
                    errors[(outcome, (error_message(raw) or "")[:120])] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError):
            outcomes["lost"] += 1


def run_soak(work: Path, *, duration_s: float, streams: int, replicas: int, kill_every_s: float, down_s: float,
             sample_s: float, request_timeout_s: float, time_scale: float, trie_max_bytes: int = 4 * 2 ** 20,
             seed: int = 0) -> dict[str, Any]:
    """One soak run; returns {"outcomes", "samples": [{"t_s", "rss_mb": {region}, "trie_bytes": {region},
    "queue": {region}}], "kills", "settings"}."""
    rng = random.Random(seed)
    procs = ProcGroup(work / "logs")
    try:
        controller_port = free_port()
        controller = f"http://127.0.0.1:{controller_port}"
        path = work / "deployment.yaml"
        path.write_text(yaml.safe_dump({
            "controller": {"db": str(work / "controller.sqlite"), "peer_token": _PEER_TOKEN},
            # A small trie bound, so the tries fill during warm-up and the run shows whether they stay there.
            "balancer": {"state_dir": str(work / "state"), "peer_token": _PEER_TOKEN,
                         "policies": {"skylb": {"trie_max_bytes": trie_max_bytes}}},
            "regions": {r: {"replicas": 0} for r in REGIONS}}))
        procs.skylb("controller", "--config", str(path), "--port", str(controller_port), name="controller",
                    wait_url=f"{controller}/healthz")
        emulators: dict[str, tuple[int, Any]] = {}

        def start_emulator(replica_id: str, port: int, generation: int):
            return procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", str(port),
                               "--time-scale", str(time_scale), name=f"emulator-{replica_id}-{generation}",
                               wait_url=f"http://127.0.0.1:{port}/health")

        for region in REGIONS:
            for i in range(replicas):
                replica_id, port = f"{region}-{i + 1}", free_port()
                emulators[replica_id] = (port, start_emulator(replica_id, port, 0))
                body = json.dumps({"region": region, "url": f"http://127.0.0.1:{port}", "id": replica_id}).encode()
                urllib.request.urlopen(urllib.request.Request(
                    f"{controller}/v1/replicas", data=body, method="POST",
                    headers={"Content-Type": "application/json"}), timeout=5)
        balancers = {}
        for region in REGIONS:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = procs.skylb("balancer", "--config", str(path), "--region", region, "--port", str(port),
                               "--controller", controller, name=f"balancer-{region}", wait_url=f"{url}/healthz")
            balancers[region] = (url, proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                len(_get(f"{u}/skylb/v1/status?format=json")["replicas"]) == replicas for u, _ in balancers.values()):
            time.sleep(0.2)

        samples, kills, outcomes, errors = [], [], Counter(), Counter()
        started = time.monotonic()

        def sample() -> None:
            row: dict[str, Any] = {"t_s": round(time.monotonic() - started, 1), "rss_mb": {}, "trie_bytes": {},
                                   "queue": {}}
            for region, (url, proc) in balancers.items():
                row["rss_mb"][region] = _rss_mb(proc.popen.pid)
                try:
                    status = _get(f"{url}/skylb/v1/status?format=json")
                except OSError:
                    continue
                row["trie_bytes"][region] = sum(t["bytes"] for t in status.get("tries", {}).values())
                row["queue"][region] = status.get("queue_len")
            samples.append(row)

        async def chaos(until: float) -> None:
            generation = 0
            while time.monotonic() + kill_every_s + down_s < until:
                await asyncio.sleep(kill_every_s)
                replica_id = rng.choice(sorted(emulators))
                port, proc = emulators[replica_id]
                proc.kill()
                kills.append({"t_s": round(time.monotonic() - started, 1), "replica": replica_id})
                await asyncio.sleep(down_s)
                generation += 1
                emulators[replica_id] = (port, await asyncio.to_thread(start_emulator, replica_id, port, generation))

        async def sampler(until: float) -> None:
            while time.monotonic() < until:
                await asyncio.to_thread(sample)
                await asyncio.sleep(sample_s)

        async def load() -> None:
            until = started + duration_s
            urls = [u for u, _ in balancers.values()]
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                clients = [_client(session, urls, random.Random(seed * 1000 + i), until, outcomes, request_timeout_s,
                                   errors) for i in range(streams)]
                await asyncio.gather(*clients, chaos(until), sampler(until))

        asyncio.run(load())
        sample()
        leftover = {region: _get(f"{url}/skylb/v1/status?format=json").get("in_flight")
                    for region, (url, _) in balancers.items()}
        return {"outcomes": dict(outcomes), "samples": samples, "kills": kills, "in_flight_after": leftover,
                "errors": [{"outcome": o, "message": m, "requests": n} for (o, m), n in errors.most_common()],
                "settings": {"duration_s": duration_s, "streams": streams, "replicas_per_region": replicas,
                             "kill_every_s": kill_every_s, "down_s": down_s, "time_scale": time_scale,
                             "trie_max_bytes": trie_max_bytes, "seed": seed}, "generated": now_label()}
    finally:
        procs.stop_all()


def format_markdown(result: dict[str, Any]) -> str:
    """The report: outcomes, memory and trie size at the end of warm-up (the first fifth) and at the end."""
    s, samples, outcomes = result["settings"], result["samples"], result["outcomes"]
    warm = [x for x in samples if x["t_s"] >= s["duration_s"] / 5][:1] or samples[:1]
    end = samples[-1:]
    rows = []
    for region in REGIONS:
        rss = [x["rss_mb"].get(region) for x in samples if x["rss_mb"].get(region) is not None]
        trie = [x["trie_bytes"].get(region) for x in samples if x["trie_bytes"].get(region) is not None]
        rows.append((region, f"{warm[0]['rss_mb'].get(region) or 0:.1f}", f"{end[0]['rss_mb'].get(region) or 0:.1f}",
                     f"{max(rss) if rss else 0:.1f}",
                     f"{(warm[0]['trie_bytes'].get(region) or 0) / 1e6:.2f}",
                     f"{(end[0]['trie_bytes'].get(region) or 0) / 1e6:.2f}", f"{max(trie) / 1e6 if trie else 0:.2f}"))
    total = sum(outcomes.values())
    lost, dup = outcomes.get("lost", 0), outcomes.get("duplicated", 0)
    return "\n".join([
        "# Soak (real processes)", "",
        f"Generated {result['generated']} by `skylb bench soak`: {s['streams']} concurrent streamed chat completions "
        f"for {s['duration_s']:g} s over three regions of {s['replicas_per_region']} emulated vLLM replicas each "
        f"(time scale {s['time_scale']:g}); a random replica SIGKILLed every {s['kill_every_s']:g} s and restarted "
        f"{s['down_s']:g} s later ({len(result['kills'])} kills); 50 shared system prompts.", "",
        markdown_table(["outcome", "requests"], sorted(outcomes.items(), key=lambda kv: -kv[1])), "",
        f"Total {total}; **lost {lost}, duplicated {dup}** (target 0 and 0: "
        f"{'met' if lost == 0 and dup == 0 else 'MISSED'}). Requests the balancers still held at the end: "
        f"{result['in_flight_after']}.", "",
        f"Balancer memory (RSS, MB) and prefix tries (accounted MB, both tries of the `skylb` policy, each bounded "
        f"at {s['trie_max_bytes'] / 2 ** 20:g} MiB) at the end of warm-up (the first fifth), at the end, and the "
        "largest sample:", "",
        markdown_table(["region", "RSS warm", "RSS end", "RSS max", "tries warm", "tries end", "tries max"], rows),
        "", *_error_lines(result.get("errors"))])


def _error_lines(errors: list[dict] | None) -> list[str]:
    """What the clients of the outcomes other than ok were told (the error's message, cut at 120 characters)."""
    if not errors:
        return []
    return ["What the clients were told, for each outcome other than ok:", "",
            markdown_table(["outcome", "message", "requests"],
                           [(e["outcome"], e["message"].replace("|", "\\|") or "-", e["requests"]) for e in errors]),
            ""]


def build_parser() -> argparse.ArgumentParser:
    """`python -m bench.live.soak` / `skylb bench soak` options."""
    p = argparse.ArgumentParser(prog="python -m bench.live.soak", description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="length of the load (default: 600)")
    p.add_argument("--streams", type=int, default=200, help="concurrent clients (default: 200)")
    p.add_argument("--replicas", type=int, default=3, help="emulated replicas per region (default: 3)")
    p.add_argument("--kill-every-s", type=float, default=60.0, help="seconds between replica kills (default: 60)")
    p.add_argument("--down-s", type=float, default=10.0, help="seconds a killed replica stays down (default: 10)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples (default: 10)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="a request's longest wait (default: 120)")
    p.add_argument("--time-scale", type=float, default=0.2, help="emulated durations x this (default: 0.2)")
    p.add_argument("--trie-max-bytes", type=int, default=4 * 2 ** 20,
                   help="each prefix trie's byte bound (default: 4 MiB, small so the tries reach it within minutes; at 1 MiB both tries were full after about 250 s of the default load)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-md", default=None, metavar="PATH", help="also write the report here")
    p.add_argument("--out-json", default=None, metavar="PATH", help="also write the samples as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print the report; 0 when nothing was lost or duplicated, 1 otherwise."""
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skylb-soak-") as tmp:
        result = run_soak(Path(tmp), duration_s=args.duration_s, streams=args.streams, replicas=args.replicas,
                          kill_every_s=args.kill_every_s, down_s=args.down_s, sample_s=args.sample_s,
                          request_timeout_s=args.request_timeout_s, time_scale=args.time_scale,
                          trie_max_bytes=args.trie_max_bytes, seed=args.seed)
    emit_markdown(format_markdown(result), result, out_md=args.out_md, out_json=args.out_json)
    outcomes = result["outcomes"]
    return 0 if outcomes.get("lost", 0) == 0 and outcomes.get("duplicated", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
