"""`skylb bench chaos`: the short fault schedule on the real three-region deployment (etcd, Redis, BIND, controllers,
balancers, emulated replicas), and the pieces its figures rest on: the client's outcome classes, the emulator's fault
control, the tracing of replica executions back to client attempts, the split brain's overlap."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests

from bench.chaos.client import classify
from bench.chaos.faults import Fault
from bench.chaos.measure import split_brain
from bench.chaos.observe import executions
from bench.sim.workloads import DEFAULT_TRACE
from tests.procs import free_port
from tests.system import require_binary


def _trace(tmp_path: Path) -> Path:
    """The real Mooncake trace when this workspace has it, else a small one in its format: sessions whose turns
    extend each other's hash ids (what bench/replay/workload.py derives sessions from)."""
    real = Path(os.environ.get("SKYLB_TRACE", DEFAULT_TRACE))
    if real.is_file():
        return real
    path = tmp_path / "trace.jsonl"
    lines, block = [], 0
    for session in range(500):  # more than 2 clients x 3 regions run in the short schedule
        ids: list[int] = []
        for turn in range(4):
            ids = ids + list(range(block, block + 3))
            block += 3
            lines.append(json.dumps({"timestamp": session * 100 + turn, "input_length": 512 * len(ids),
                                     "output_length": 300, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("cpu_heavy")  # one CPU-heavy test at a time (tests/test_llamacpp.py)
@pytest.mark.parametrize("siblings", [1, 2], ids=["one-balancer-per-region", "two-balancers-per-region"])
def test_short_chaos_schedule_loses_and_duplicates_nothing(tmp_path, siblings):
    """Under the short schedule (a replica SIGKILLed mid-stream, a balancer SIGKILLed and restarted, a region
    partitioned and healed, a split brain), with closed-loop clients resolving through BIND: every fault is
    detected and recovered from, no request is lost, no attempt runs on two replicas, and in the split brain both
    balancers held the region's replicas for a while and then only one did. With two balancers per region the
    balancer faults hit one sibling: a killed sibling's replicas serve through the other one with no cross-region
    failover."""
    for binary in ("etcd", "redis-server", "named"):
        require_binary(binary)
    from bench.chaos.run import run_once
    result = run_once(tmp_path / "run", 7, short=True, trace=_trace(tmp_path), clients=2, replicas=2,
                      siblings=siblings)
    faults = {f["fault"]["kind"]: f for f in result["faults"]}
    assert set(faults) == {"replica_kill", "balancer_kill", "partition", "split_brain"}
    for kind, f in faults.items():
        assert f["fault"]["started_s"] is not None and f["fault"]["ended_s"] is not None, kind
        assert f["lost"] == 0 and f["duplicated"] == 0, (kind, f["outcomes"])
        assert f["detected_s"] is not None and f["recovered_s"] is not None, (kind, f)
    assert result["outcomes"].get("lost", 0) == 0 and result["outcomes"].get("duplicated", 0) == 0
    assert result["duplicated_attempts"] == []
    assert result["outcomes"].get("ok", 0) > 50
    assert result["executions"] >= result["outcomes"]["ok"]  # every completion ran on a replica, logged there
    brain = faults["split_brain"]["split_brain"]
    assert brain["overlap_s"] > 0 and brain["shared"] >= 1
    assert brain["overlap_after_heal_s"] < 10  # the stale balancer gave the replicas back after the heal
    if siblings > 1:
        kill = faults["balancer_kill"]
        assert kill["fault"]["target"] in ("us-a", "us-b", "eu-a", "eu-b", "asia-a", "asia-b")
        assert kill["sibling_takeover"]["served_by_siblings_s"] is not None
        assert kill["sibling_takeover"]["cross_region_s"] == 0  # the region stayed its own while a sibling lived


def test_outcomes_of_a_response():
    """A whole stream is ok; an error chunk is an error event; two completion ids are a duplicate; a stream cut
    without [DONE] is lost; an error answer in the API's shape is http_N, any other body lost."""
    def chunk(cid: str, finish=None) -> bytes:
        return b"data: " + json.dumps({"id": cid, "choices": [{"text": "x", "finish_reason": finish}]}).encode()
    done = b"data: [DONE]"
    assert classify(200, b"\n\n".join([chunk("a"), chunk("a", "length"), done]))[0] == "ok"
    assert classify(200, b"\n\n".join([chunk("a"), b'data: {"error": {"message": "replica died"}}']))[:3:2] == \
        ("error_event", "replica died")
    assert classify(200, b"\n\n".join([chunk("a", "length"), chunk("b", "length"), done]))[0] == "duplicated"
    assert classify(200, chunk("a"))[0] == "lost"
    assert classify(503, b'{"error": {"message": "no replica"}}')[0] == "http_503"
    assert classify(502, b"<html>bad gateway</html>")[0] == "lost"


def test_emulator_fault_control_slows_and_fails_then_restores(procs):
    """`skylb emulator --fault-control`: PUT /emulator/faults makes generations answer 500 in vLLM's error shape
    while /health stays 200, then restores them; bad values are refused with 400; the request's X-Request-Id
    reaches the replica's request log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.skylb("emulator", "--port", str(port), "--time-scale", "0.01", "--fault-control",
                       name="emulator", wait_url=f"{url}/health")
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hello there", "max_tokens": 3}
    assert requests.put(f"{url}/emulator/faults", json={"error_status": 500}, timeout=5).json()["error_status"] == 500
    failed = requests.post(f"{url}/v1/completions", json=body, timeout=5)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert requests.put(f"{url}/emulator/faults", json={"slowdown": 0.5}, timeout=5).status_code == 400
    assert requests.put(f"{url}/emulator/faults", json={"error_status": None, "slowdown": 2},
                        timeout=5).json() == {"slowdown": 2.0, "error_status": None}
    ok = requests.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "client-42"}, timeout=5)
    assert ok.status_code == 200
    lines = [json.loads(x[x.index("{"):]) for x in proc.log().splitlines() if "request_finished" in x]
    assert [x["upstream_request_id"] for x in lines] == ["client-42"]


def test_executions_are_traced_through_both_balancers_to_the_client_attempt(tmp_path):
    """A replica's execution names the last balancer's id; that balancer's line names the first balancer's id,
    whose line names the client's attempt: the chain ends at the attempt. Two replicas finishing one attempt is a
    duplicate; an execution whose balancer never logged stays unattributed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "balancer-us-1.log").write_text(
        json.dumps({"event": "request", "id": "b1", "client_request_id": "s1-trace-1"}) + "\n")
    (logs / "balancer-eu-1.log").write_text(json.dumps({"event": "request", "id": "b2", "client_request_id": "b1"}))
    (logs / "replica-eu-1-1.log").write_text("\n".join(json.dumps(
        {"event": "request_finished", "replica": r, "upstream_request_id": u})
        for r, u in (("eu-1", "b2"), ("eu-2", "b2"), ("us-1", "gone"))))

    class Cluster:
        def logs(self, prefix):
            return sorted(logs.glob(f"{prefix}*.log"))

    assert executions(Cluster()) == {"s1-trace-1": ["eu-1", "eu-2"], "?gone": ["us-1"]}


def test_split_brain_overlap_is_the_span_both_balancers_list_the_replicas():
    """The overlap runs from the first to the last sample where another balancer lists the region's replicas
    while the region's own balancer does too; peak pending and outstanding are read on the shared replicas."""
    def sample(t, shared, pending=0):
        us = {"replicas": {"us-1": {"p": pending, "o": 1}, "us-2": {"p": 0, "o": 0}}}
        eu = {"replicas": {"eu-1": {"p": 0, "o": 0}, **({"us-1": {"p": pending, "o": 2}} if shared else {})}}
        return {"t": t, "b": {"us": us, "eu": eu, "asia": None}}
    samples = [sample(0.0, False), sample(0.3, False), sample(0.6, True, 3), sample(0.9, True, 5),
               sample(1.2, False)]
    fault = Fault("split_brain", "us", 0.0, 1.0, started_s=0.1, ended_s=0.8)
    got = split_brain(samples, fault, "us")
    assert got["overlap_s"] == pytest.approx(0.6) and got["shared"] == 1
    assert got["peak_pending"] == 5 and got["peak_outstanding"] == 3
    assert got["overlap_after_heal_s"] == pytest.approx(0.4)
    # two siblings of one region listing one replica at once share it too
    siblings = [{"t": t, "b": {"us-a": {"replicas": {"us-1": {"p": 1, "o": 1}}},
                               "us-b": {"replicas": {"us-2": {"p": 0, "o": 0}, **({"us-1": {"p": 2, "o": 1}} if both
                                                                                    else {})}}}}
                for t, both in ((0.0, False), (0.3, True), (0.6, False))]
    got = split_brain(siblings, Fault("split_brain", "us-a", 0.0, 1.0, started_s=0.0, ended_s=0.5), "us")
    assert got["overlap_s"] == pytest.approx(0.3) and got["peak_pending"] == 2 and got["peak_outstanding"] == 2


def test_a_killed_sibling_is_taken_over_by_its_sibling_within_the_region():
    """A sibling's kill: the takeover time is from the kill to the first sample where the live sibling lists all
    of the region's replicas healthy; time assigned to another region counts only samples that say so."""
    from bench.chaos.measure import sibling_takeover
    of = {"us-a": "us", "us-b": "us", "eu": "eu"}

    def sample(t, b_lists, assigned="us"):
        healthy = {rid: {"h": True} for rid in b_lists}
        return {"t": t, "assign": {"us": [assigned, 1], "eu": ["eu", 1]},
                "b": {"us-a": None, "us-b": {"replicas": healthy}, "eu": {"replicas": {}}}}
    samples = [sample(0.0, ["us-2"]), sample(0.3, ["us-2"]), sample(0.6, ["us-1", "us-2"]),
               sample(0.9, ["us-1", "us-2"], assigned="eu"), sample(1.2, ["us-1", "us-2"])]
    got = sibling_takeover(samples, Fault("balancer_kill", "us-a", 0.0, 2.0, started_s=0.1, ended_s=1.5), of, 2)
    assert got == {"served_by_siblings_s": 0.5, "cross_region_s": pytest.approx(0.3)}
