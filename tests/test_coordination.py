"""The coordination measurement's plumbing (bench/micro/coordination.py): real router state, status round trip, sizes."""

from __future__ import annotations

from bench.micro.coordination import MODEL, build_router_state, decision_times, probe_traffic, status_message


def test_router_state_has_the_replicas_and_peers_asked_for():
    """The measured router holds every replica and peer, all observed healthy."""
    router, peers = build_router_state(20, 3)
    assert len(router.replicas) == 20 and len(router.peers) == 3 == len(peers)
    assert all(r.healthy for r in router.replicas.values()) and all(p.healthy for p in router.peers.values())


def test_status_message_decodes_to_what_was_encoded():
    """The peer status is packed and unpacked by the real protocol functions, to the same status."""
    s = status_message(20, 3, rounds=20)
    assert s["bytes"] > 0 and s["round_trip_ok"] and s["encode_us"] > 0 and s["decode_us"] > 0


def test_decisions_are_timed_and_probe_traffic_is_positive():
    """Every timed decision is counted with its route; probe traffic grows with the replicas probed."""
    prompts = [" ".join(["word"] * n) for n in (50, 80, 120)]
    d = decision_times(10, 2, decisions=30, prompts=prompts, seed=0, warm=10)
    assert sum(d["routes"].values()) == 30 and 0 < d["p50_us"] <= d["p99_us"]
    small, big = probe_traffic(10, 2, 100), probe_traffic(200, 2, 100)
    assert 0 < small["total"]["bytes_per_s"] < big["total"]["bytes_per_s"]
    assert big["replica /metrics"]["requests_per_s"] == 2000.0  # 200 replicas every 100 ms


def test_replicas_reporting_kv_capacity_bound_the_measured_trie():
    """With a KV capacity per replica (the bounded-trie shape), each replica's records in the trie stay within it
    (4 characters per token: 60 prompts of 500 characters do not all fit) while decisions are timed."""
    from skylb.core import Request
    router, _ = build_router_state(3, 1, kv_capacity_tokens=1000)
    for k in range(60):
        router.enqueue(Request(id=f"q{k}", text=f"prompt {k} " + "word " * 100, arrived_at=0.0, model=MODEL))
        for d in router.dispatch(0.0):
            router.finished(d)
    trie = router.policy.replica_trie
    held = [trie.target_chars(r) for r in router.replicas]
    assert max(held) > 0 and all(chars <= 4000 for chars in held) and len(trie) < 60
    d = decision_times(3, 1, decisions=20, prompts=["word " * 300], seed=0, warm=5, kv_capacity_tokens=100)
    assert sum(d["routes"].values()) == 20


def test_measured_replicas_learn_their_speeds_from_the_answers():
    """With answers reported (the "replicas measured" shape), each replica that served is measured (OllamaRouter's
    time per token, in proportion to its speed); timed decisions still count every route."""
    from bench.micro.coordination import _answer
    from skylb.core import Request
    router, _ = build_router_state(12, 1)
    speed = {rid: (0.8 if i % 2 else 1.25) for i, rid in enumerate(router.replicas)}
    served = set()
    for k in range(40):
        router.enqueue(Request(id=f"q{k}", text="word " * 400, arrived_at=0.0, model=MODEL))
        for d in router.dispatch(0.0):
            if d.route == "local":
                _answer(router, d, speed)
                served.add(d.target)
            router.finished(d)
    per_token = {rid: router.replicas[rid].rates.overall.time_per_token_s for rid in served}
    assert served and None not in per_token.values()
    per_unit = [v / speed[rid] for rid, v in per_token.items()]  # the same prompts: time per token x its speed
    assert max(per_unit) - min(per_unit) < 1e-9 * max(per_unit)
    d = decision_times(3, 1, decisions=20, prompts=["word " * 300], seed=0, warm=5, measured=True)
    assert sum(d["routes"].values()) == 20


def test_decision_ab_times_both_checkouts_in_turns():
    """bench/micro/decision_ab.py runs a worker per checkout (here the same one twice) and gathers each one's
    timed decisions, round by round."""
    from pathlib import Path

    from bench.micro.decision_ab import measure
    root = str(Path(__file__).resolve().parents[1])
    got = measure(root, root, replicas=4, peers=1, rounds=2, batch=5, warm=5, trace="/nonexistent")  # generated prompts
    assert set(got["checkouts"]) == {"base", "new"}
    assert all(0 < c["p50_us"] <= c["p99_us"] for c in got["checkouts"].values())
    assert got["round_p50_ratio"]["min"] <= got["round_p50_ratio"]["median"] <= got["round_p50_ratio"]["max"]
