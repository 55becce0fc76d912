"""Queues that cannot block one another: a request that cannot be placed holds back only requests of its own
candidate set, and a request whose model has no usable target ends (Router.dispatch, Router.unserved); the core
directly, and through a real balancer over emulated replicas."""

from __future__ import annotations

import concurrent.futures
import time

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skylb.core import AvailabilityRules, Request, Router, make_policy
from skylb.core.outlier import OutlierDetector
from tests.cluster import Cluster
from tests.procs import free_ports

GRACE_S = 2.0


def _router(models: dict[str, list[str]], *, policy: str = "skylb-paper", priorities: bool = False,
            slots: int = 1) -> Router:
    """Replicas named by ``models`` (id -> models served), each with ``slots`` parallel slots, no peers, probed
    healthy at 0."""
    router = Router(region="us", policy=make_policy(policy), rules=AvailabilityRules(), priorities=priorities)
    router.set_replicas([(rid, f"http://{rid}", "vllm") for rid in models],
                        max_concurrency={rid: slots for rid in models})
    for rid, served in models.items():
        router.set_replica_models(rid, served)
        router.observe_replica(rid, now=0.0, healthy=True, pending=0)
    return router


def test_a_request_for_an_unhealthy_model_does_not_hold_up_another_model():
    """The head's only replica is unhealthy; the request behind it, for a model a free replica serves, is placed."""
    router = _router({"ra": ["a"], "rb": ["b"]})
    router.observe_replica("ra", now=0.0, healthy=False)
    router.enqueue(Request("qa", "x", arrived_at=0.0, model="a"))
    router.enqueue(Request("qb", "x", arrived_at=0.0, model="b"))
    assert [(d.request.id, d.target) for d in router.dispatch(0.01)] == [("qb", "rb")]
    assert [r.id for r in router.queue] == ["qa"]


def test_a_retry_whose_only_replica_failed_it_goes_back_there():
    """A retry avoids the replica that failed it only while another replica of its model is usable: one of
    another model does not count, so the retry is placed and does not hold up the queue."""
    router = _router({"ra": ["a"], "rb": ["b"]})
    router.requeue(Request("qa", "x", arrived_at=0.0, model="a", avoid=frozenset({("local", "ra")})))
    router.enqueue(Request("qb", "x", arrived_at=0.0, model="b"))
    assert sorted((d.request.id, d.target) for d in router.dispatch(0.01)) == [("qa", "ra"), ("qb", "rb")]


def test_fcfs_holds_within_a_candidate_set():
    """Requests for the same model keep their order behind a blocked head; another model's request passes."""
    router = _router({"ra": ["a"], "rb": ["b"]})
    first = router.dispatch(0.0)
    assert first == []
    router.enqueue(Request("a1", "x", arrived_at=0.0, model="a"))
    router.enqueue(Request("a2", "x", arrived_at=0.0, model="a"))
    router.enqueue(Request("b1", "x", arrived_at=0.0, model="b"))
    router.enqueue(Request("a3", "x", arrived_at=0.0, model="a"))
    assert [d.request.id for d in router.dispatch(0.01)] == ["a1", "b1"]  # each replica has one slot
    assert [r.id for r in router.queue] == ["a2", "a3"]


def test_with_priority_classes_a_blocked_critical_request_lets_a_lower_class_pass():
    """With priority classes, a critical request whose model has no room holds up no lower class of another
    model; a lower request of its own model still waits behind it."""
    router = _router({"ra": ["a"], "rb": ["b"]}, priorities=True)
    router.observe_replica("ra", now=0.0, healthy=False)
    router.enqueue(Request("crit-a", "x", arrived_at=0.0, model="a", priority="critical"))
    router.enqueue(Request("low-a", "x", arrived_at=0.0, model="a", priority="low"))
    router.enqueue(Request("low-b", "x", arrived_at=0.0, model="b", priority="low", tenant="t2"))
    assert [d.request.id for d in router.dispatch(0.01)] == ["low-b"]
    router.observe_replica("ra", now=0.02, healthy=True, pending=0)
    assert [d.request.id for d in router.dispatch(0.03)] == ["crit-a"]


def test_a_request_whose_model_has_no_usable_replica_ends_after_the_grace():
    """``unserved`` gives back a request whose model's only replica is unhealthy once that lasted the grace, and
    none while a usable replica (busy or not) serves its model."""
    router = _router({"ra": ["a"], "rb": ["b"]})
    router.observe_replica("ra", now=0.0, healthy=False)
    router.enqueue(Request("qa", "x", arrived_at=0.0, model="a"))
    router.enqueue(Request("qb", "x", arrived_at=0.0, model="b"))
    router.enqueue(Request("qb2", "x", arrived_at=0.0, model="b"))  # waits for rb's one slot: busy is not gone
    router.dispatch(0.0)
    assert router.unserved(0.0, GRACE_S) == []
    router.observe_replica("rb", now=1.9, healthy=True, pending=0)
    assert router.unserved(1.9, GRACE_S) == []
    assert [r.id for r in router.unserved(2.0, GRACE_S)] == ["qa"]
    assert [r.id for r in router.queue] == ["qb2"]


def test_a_model_that_comes_back_within_the_grace_keeps_its_requests():
    """A replica that is usable again before the grace ends restarts the count: its requests stay queued."""
    router = _router({"ra": ["a"]})
    router.observe_replica("ra", now=0.0, healthy=False)
    router.enqueue(Request("qa", "x", arrived_at=0.0, model="a"))
    assert router.unserved(0.0, GRACE_S) == []
    router.observe_replica("ra", now=1.5, healthy=True, pending=0)
    router.requeue(Request("qa2", "x", arrived_at=0.0, model="a"))  # the first is placed; one more queued
    assert router.unserved(1.5, GRACE_S) == []
    router.observe_replica("ra", now=1.6, healthy=False)
    assert router.unserved(3.0, GRACE_S) == []  # unusable again from 3.0 (the first call that saw it)
    assert [r.id for r in router.unserved(5.0, GRACE_S)] == ["qa", "qa2"]


# -------------------------------------------------------------------------------------------- property-based

MODELS = ("m0", "m1", "m2")
STEP_S = 0.1

_op = st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(MODELS), st.sampled_from(("critical", "high", "normal", "low")),
              st.sampled_from(("t1", "t2"))),
    st.tuples(st.just("bad"), st.integers(0, 3)),
    st.tuples(st.just("back"), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("fail"), st.integers(0, 50)),
)


def _room_for(router: Router, request: Request, now: float) -> list[str]:
    """Replicas with room (the router's own availability rule) that serve ``request``'s model and that it may go
    to: a retry avoids the replicas that failed it while another usable replica serves its model."""
    serving = [r for r in router.replicas.values() if r.serves(request.model, request.api)]
    others = [r for r in serving if ("local", r.id) not in request.avoid and router._replica_usable(r, now)]
    allowed = [r for r in serving if not others or ("local", r.id) not in request.avoid]
    return [r.id for r in allowed if router.replica_available(r, now)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(served=st.lists(st.sets(st.sampled_from(MODELS), min_size=1), min_size=1, max_size=4),
       slots=st.integers(1, 2), priorities=st.booleans(), policy=st.sampled_from(("skylb-paper", "skylb")),
       ops=st.lists(_op, max_size=40))
def test_every_request_ends_and_none_waits_while_its_model_has_room(served, slots, priorities, policy, ops):
    """Random models, replicas going bad and back, failures before the first byte (retries, ejections) and
    priorities: after every dispatch no queued request has a replica of its model with room, and once the ops end
    every request is placed or given back by ``unserved`` within the grace plus a bounded number of steps."""
    router = _router({f"r{i}": sorted(models) for i, models in enumerate(served)}, policy=policy,
                     priorities=priorities, slots=slots)
    router.outlier = OutlierDetector(consecutive_gateway_failure=2)
    healthy = {rid: True for rid in router.replicas}
    in_flight, placed, gone, arrived = [], set(), set(), set()
    now = 0.0

    def step() -> None:
        for rid, ok in healthy.items():  # fresh probes: staleness is not what this checks
            router.observe_replica(rid, now=now, healthy=ok, pending=0)
        for d in router.dispatch(now):
            assert d.request.id not in placed
            placed.add(d.request.id)
            in_flight.append(d)
        for r in router.unserved(now, GRACE_S):
            gone.add(r.id)
        for queued in router.queue:
            assert not _room_for(router, queued, now), f"{queued.id} waits while a replica of its model has room"

    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "arrive":
            arrived.add(f"q{n}")
            router.enqueue(Request(f"q{n}", f"prompt {n}", arrived_at=now, model=op[1], priority=op[2],
                                   tenant=op[3]))
        elif kind in ("bad", "back") and op[1] < len(healthy):
            healthy[f"r{op[1]}"] = kind == "back"
        elif kind in ("finish", "fail") and in_flight:
            d = in_flight.pop(op[1] % len(in_flight))
            router.finished(d)
            if kind == "fail":  # failed before its first byte: counted, and retried elsewhere
                router.target_failed(d, now=now)
                placed.discard(d.request.id)
                d.request.avoid = d.request.avoid | {(d.route, d.target)}
                router.requeue(d.request)
        now += STEP_S
        step()

    for _ in range(len(arrived) + int(GRACE_S / STEP_S) + 5):
        if not router.queue:
            break
        while in_flight:
            router.finished(in_flight.pop())
        now += STEP_S
        step()
    assert not router.queue, f"still queued: {[r.id for r in router.queue]}"
    assert placed | gone == arrived and not placed & gone


# -------------------------------------------------------------------------------------------- the real balancer


def _emulators(procs, models: dict[str, str]) -> tuple[dict[str, str], dict]:
    """One emulated vLLM replica process per name in ``models`` (name -> model served), with fault control;
    returns ({name: url}, {name: Proc})."""
    urls, emulators = {}, {}
    for (name, model), port in zip(models.items(), free_ports(len(models))):
        urls[name] = f"http://127.0.0.1:{port}"
        emulators[name] = procs.skylb("emulator", "--engine", "vllm", "--model", model, "--time-scale", "0.1",
                                      "--fault-control", "--port", str(port), name=f"emu-{name}",
                                      wait_url=f"{urls[name]}/health")
    return urls, emulators


def _chat(url: str, model: str, *, path: str = "/v1/chat/completions", timeout: float = 20.0):
    """POST one short chat request; (status, JSON body, headers, seconds it took)."""
    started = time.monotonic()
    r = requests.post(f"{url}{path}", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 4, "stream": False}, timeout=timeout)
    return r.status_code, r.json(), r.headers, time.monotonic() - started


def test_a_failing_models_requests_hold_up_no_other_model_and_end_with_503(procs, tmp_path):
    """Through a real balancer: while the only replica of model a answers 502, a request for a ends (its retries
    go back to that replica) and one for b, queued behind it, is answered at once; once a's replica is down, a
    request for a gets 503 with Retry-After in the API's shape (OpenAI and Ollama) within no_target_timeout_s
    plus a little, not at the queue timeout."""
    replicas, emulators = _emulators(procs, {"a": "model-a", "b": "model-b"})
    cluster = Cluster(procs, tmp_path, balancer={"no_target_timeout_s": 1.0, "queue_timeout_s": 60})
    cluster.start_static_balancer(list(replicas.values()), engine="vllm")
    url = cluster.balancers["local"]
    requests.put(f"{replicas['a']}/emulator/faults", json={"error_status": 502}, timeout=5).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        failing = pool.submit(_chat, url, "model-a", timeout=30)
        time.sleep(0.05)  # a is queued (retrying) first
        status_b, _, _, took_b = _chat(url, "model-b", timeout=15)
        status_a, body_a, _, _ = failing.result(timeout=30)
    assert status_b == 200 and took_b < 5, (status_b, took_b)
    assert status_a == 502 and "error" in body_a

    emulators["a"].kill()
    cluster.wait_until(lambda: not any(r["healthy"] for r in cluster.status("local")["replicas"]
                                       if r["url"] == replicas["a"]), what="replica a unhealthy")
    for path in ("/v1/chat/completions", "/api/chat"):
        status, body, headers, took = _chat(url, "model-a", path=path, timeout=15)
        assert status == 503 and took < 4, (path, status, took)
        assert int(headers["Retry-After"]) >= 1
        if path == "/api/chat":
            assert isinstance(body["error"], str)
        else:
            assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == 503
    assert _chat(url, "model-b")[0] == 200
