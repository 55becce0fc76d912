"""Routing by KV-cache events with real processes on loopback: two `skylb emulator` vLLM replicas publishing events
(vLLM's wire format, bench/emulator/kv_publisher.py) behind a static balancer given their endpoints
(`--replica URL#kv=...`). A prompt cached on replica B behind the balancer's back (sent to B directly, so the
balancer's trie never saw it) is routed to B by its events; once B's stream is gone, B is matched by the trie."""

from __future__ import annotations

import json
import secrets

import pytest
import requests

from skylb.balancer.protocol import decode_status
from skylb.core.kv_hash import request_block_hashes
from skylb.core.kv_index import summary_sampled
from tests.procs import free_ports, saturated, wait_for

pytestmark = pytest.mark.timeout(60)

MODEL = "m"


def _emulator(procs, name: str, *extra: str) -> tuple[str, str]:
    """Start one vLLM emulator publishing events (``extra``: more flags, the last of a flag given twice wins);
    returns (its base URL, its --replica flag for the balancer)."""
    http, pub, replay = free_ports(3)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    base = f"http://127.0.0.1:{http}"
    procs.skylb("emulator", "--port", str(http), "--time-scale", "0.01", "--kv-cache-tokens", "8192", "--model",
                MODEL, "--fault-control", "--kv-events-config", json.dumps(config), *extra, name=name,
                wait_url=f"{base}/health")
    return base, f"{base}#kv=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay}"


def _complete(base: str, prompt: str) -> requests.Response:
    resp = requests.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                         timeout=10)
    assert resp.status_code == 200, resp.text
    return resp


def test_a_prefix_cached_behind_the_balancers_back_is_found_by_events_and_by_the_trie_once_they_stop(procs,
                                                                                                      tmp_path):
    """Three prompts sent straight to B, then extended through the balancer: each goes to B (its events say B
    holds 96 of the prompt's tokens; by chance alone all three would reach B 1 time in 8). With B's stream stopped
    (the engine serves on), status says B is not live, A still is, and B's prompts still reach B: by the trie,
    which learned them from the balancer's own placements."""
    (a_url, a_flag), (b_url, b_flag) = _emulator(procs, "emu-a"), _emulator(procs, "emu-b")
    port, = free_ports(1)
    lb = f"http://127.0.0.1:{port}"
    config = tmp_path / "lb.yaml"
    config.write_text(json.dumps({"balancer": {"probe_interval_ms": 50}}))
    procs.skylb("balancer", "--replica", a_flag, "--replica", b_flag, "--engine", "vllm", "--config", str(config),
                "--port", str(port), name="lb", wait_url=f"{lb}/healthz")

    def status() -> dict:
        return requests.get(f"{lb}/skylb/v1/status?format=json", timeout=5).json()

    def kv(replica: str) -> dict:
        return status()["kv_events"]["replicas"][replica]

    wait_for(lambda: all(r["healthy"] and MODEL in r["models"] for r in status()["replicas"]), "healthy replicas")
    wait_for(lambda: kv("local-1")["live"] and kv("local-2")["live"], "both event streams live")
    prompts = [" ".join(f"{tag}{i}" for i in range(100)) for tag in ("alpha", "bravo", "charlie")]
    for n, prompt in enumerate(prompts, start=1):
        _complete(b_url, prompt)  # B caches 6 full blocks of 16; the balancer only hears of it by events
        wait_for(lambda: kv("local-2")["blocks"] >= 6 * n, "B's blocks in the index")
        served = _complete(lb, prompt + " and one question").headers["X-SkyLB-Served-By"]
        assert served == "local/local-2", f"prompt {n} went to {served}, not to B which holds its prefix"

    metrics = requests.get(f"{lb}/metrics", timeout=5).text
    assert 'skylb_kv_tokenize_seconds_count{outcome="ok",region="local"} 3.0' in metrics  # hashed before queueing

    # What peers read (the msgpack status): the region summary is the sampled blocks B's engine holds, of 16 tokens.
    held = set()
    for prompt in prompts:
        for text in (prompt, prompt + " and one question"):
            ids = requests.post(f"{b_url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=5).json()["tokens"]
            held.update(h for h in request_block_hashes(ids, 16) if summary_sampled(h))
    peer_view = decode_status(requests.get(f"{lb}/skylb/v1/status", timeout=5).content)
    assert peer_view.block_size == 16 and held and set(peer_view.blocks) == held

    requests.put(f"{b_url}/emulator/kv-events", json={"stop": True}, timeout=5).raise_for_status()
    wait_for(lambda: not kv("local-2")["live"], "B's stream stale")
    assert kv("local-1")["live"] and kv("local-2")["blocks"] == 0
    assert not decode_status(requests.get(f"{lb}/skylb/v1/status", timeout=5).content).blocks  # A holds none
    for prompt in prompts:
        served = _complete(lb, prompt + " and a second question").headers["X-SkyLB-Served-By"]
        assert served == "local/local-2"  # the trie: the balancer sent this prefix to B above
    assert _complete(a_url, "direct to A").status_code == 200  # A serves on, untouched


def test_a_full_region_forwards_to_the_region_whose_engine_holds_the_prefix(procs, tmp_path):
    """Three static balancers, us, eu and asia, each in front of emulated vLLM replicas publishing events. A prompt
    is cached on eu's replica behind every balancer's back (sent to it directly); us's only replica is kept full
    (one request running, one waiting); the prompt extended, sent to us, goes to eu, the region whose engine holds
    its prefix by eu's region summary of KV-cache blocks, although asia has two idle replicas to eu's one (with no
    match, the peer with most room would get it), and no balancer ever saw the prompt."""
    token = secrets.token_urlsafe(32)
    us_replica, us_flag = _emulator(procs, "emu-us", "--max-num-seqs", "1", "--time-scale", "1")
    eu_replica, eu_flag = _emulator(procs, "emu-eu")
    _, asia_flag_1 = _emulator(procs, "emu-asia-1")
    _, asia_flag_2 = _emulator(procs, "emu-asia-2")
    ports = dict(zip(("us", "eu", "asia"), free_ports(3)))
    urls = {region: f"http://127.0.0.1:{port}" for region, port in ports.items()}
    replicas = {"us": [us_flag], "eu": [eu_flag], "asia": [asia_flag_1, asia_flag_2]}
    config = tmp_path / "lb.yaml"
    config.write_text(json.dumps({"balancer": {"probe_interval_ms": 50}}))
    for region, port in ports.items():
        peers = [a for other in ports if other != region for a in ("--peer", f"{other}={urls[other]}")]
        procs.skylb("balancer", "--region", region, *(a for r in replicas[region] for a in ("--replica", r)),
                    *peers, "--engine", "vllm", "--config", str(config), "--port", str(port), name=f"lb-{region}",
                    env={"SKYLB_PEER_TOKEN": token}, wait_url=f"{urls[region]}/healthz")

    def status(region: str) -> dict:
        return requests.get(f"{urls[region]}/skylb/v1/status?format=json", timeout=5,
                            headers={"X-SkyLB-Token": token}).json()

    for region in ports:
        wait_for(lambda: all(r["healthy"] and MODEL in r["models"] for r in status(region)["replicas"])
                 and all(k["live"] for k in status(region)["kv_events"]["replicas"].values()),
                 f"{region}'s replicas healthy and their event streams live")
    prompt = next(p for p in (" ".join(f"{tag}{i}" for i in range(200)) for tag in ("alpha", "bravo", "charlie"))
                  if _sampled_depth(eu_replica, p + " and one question") >= 8)  # a summary can show >= half of it
    _complete(eu_replica, prompt)
    peer = lambda name: next(p for p in status("us")["peers"] if p["region"] == name)  # noqa: E731
    wait_for(lambda: (peer("eu")["kv_summary_blocks"] or 0) >= 1, "eu's region summary at us")
    with saturated(us_replica, MODEL, 2, max_tokens=4000):
        wait_for(lambda: status("us")["replicas"][0]["pending"] >= 1, "us's replica full, a request waiting")
        answer = requests.post(f"{urls['us']}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": prompt + " and one question", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-SkyLB-Route"] == "peer:eu", answer.headers["X-SkyLB-Route"]


def _sampled_depth(base: str, prompt: str) -> int:
    """How many leading blocks of ``prompt`` (blocks of 16 tokens) a region summary can show: 1 + the position of
    its deepest block hash that summaries sample (0: none)."""
    ids = requests.post(f"{base}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=5).json()["tokens"]
    hashes = request_block_hashes(ids, 16)
    return max((i + 1 for i, h in enumerate(hashes) if summary_sampled(h)), default=0)
