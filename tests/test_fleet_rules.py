"""The pure Ollama fleet rules (skylb/core/fleet_rules.py): thermal state, load time, elimination and fit, hot preference,
runner-up choice, through the Router."""

from __future__ import annotations

from skylb.core import Request, Router, make_policy
from skylb.core.fleet_rules import (ABSENT, DISK, HOT, RECENT, FleetReplica, FleetRules, FleetSettings, FleetView,
                                    ModelSlot, load_s, resolve_name, thermal)
from skylb.core.state import ReplicaState

GIB = 2**30


def _replica(rid: str, *, disk=("m:latest",), loaded=(), now=0.0, outstanding=0, size=4 * GIB) -> ReplicaState:
    r = ReplicaState(id=rid, url=f"http://{rid}", engine="ollama", healthy=True, probed_at=now,
                     models=frozenset(disk), apis=frozenset({"openai", "ollama"}), outstanding=outstanding,
                     max_concurrency=1)
    r.fleet = FleetView()
    r.fleet.observe_tags({n: ModelSlot(size) for n in disk})
    r.fleet.observe_ps({n: ModelSlot(size) for n in loaded}, now)
    return r


def test_replica_state_has_what_the_fleet_rules_read():
    """ReplicaState has every attribute and method of the FleetReplica Protocol the rules name a replica by, with
    the same annotation for each attribute."""
    replica = _replica("a")
    wanted = FleetReplica.__annotations__
    assert set(wanted) <= set(ReplicaState.__annotations__)
    assert {name: ReplicaState.__annotations__[name] for name in wanted} == wanted
    assert callable(replica.serves) and replica.serves("m:latest", "ollama")


def test_thermal_states_and_load_time():
    r = _replica("a", disk=("m:latest", "n:latest"), loaded=("m:latest",), now=0.0)
    assert thermal(r, "m", 10.0) == HOT and thermal(r, "n:latest", 10.0) == DISK
    assert thermal(r, "x", 10.0) == ABSENT
    r.fleet.observe_ps({}, 20.0)  # m unloaded at 20 s: recent for the window, then on disk
    assert thermal(r, "m", 100.0, recent_window_s=1800) == RECENT
    assert thermal(r, "m", 2000.0, recent_window_s=1800) == DISK
    assert load_s(r, "m", 7.0) == 7.0  # no load measured: the default
    r.fleet.observe_load("m", 2.0)
    r.fleet.observe_load("m:latest", 4.0)
    assert load_s(r, "m", 7.0) == 3.0 and load_s(r, "n", 7.0) == 3.0  # any model's loads when n has none
    r.fleet.observe_ps({"m:latest": ModelSlot(4 * GIB)}, 30.0)
    assert load_s(r, "m") == 0.0 and load_s(r, "x", now=30.0) == float("inf")
    plain = ReplicaState(id="v", url="http://v", models=frozenset({"m"}))  # not Ollama: always loaded
    assert thermal(plain, "m", 0.0) == HOT and load_s(plain, "m") == 0.0


def test_elimination_paused_draining_absent_and_memory_fit():
    rules = FleetRules(FleetSettings(paused=["p"], memory_bytes={"small": 6 * GIB}, default_memory_bytes=64 * GIB))
    assert rules.eliminated(_replica("p"), "m", 0.0) == "paused"
    router = _router(rules.settings, [_replica("p"), _replica("a")], policy="skylb")
    assert [r.id for r in router.available_replicas(0.0)] == ["a"]  # a paused replica is not available
    assert router.replica_unavailable_reason(router.replicas["p"], 0.0) == "paused"
    drained = _replica("d")
    drained.draining = True
    assert rules.eliminated(drained, "m", 0.0) == "draining"
    assert rules.eliminated(_replica("a"), "zzz", 0.0) == "does not have zzz"
    # 6 GiB replica, another 4 GiB model loaded and a request in flight: the 4 GiB model m cannot load.
    small = _replica("small", disk=("m:latest", "o:latest"), loaded=("o:latest",), outstanding=1)
    assert rules.eliminated(small, "m", 0.0) == "not enough memory to load m"
    small.outstanding = 0  # idle: Ollama unloads o to make room
    assert rules.eliminated(small, "m", 0.0) is None
    huge = _replica("small", size=8 * GIB)
    assert rules.eliminated(huge, "m", 0.0) == "not enough memory to load m"
    assert rules.eliminated(_replica("big", size=8 * GIB), "m", 0.0) is None  # 64 GiB default


def test_without_any_fleet_view_only_paused_replicas_are_tested(monkeypatch):
    """Before any Ollama replica is seen (no FleetView made) and with none paused, the candidates pass untested
    (the router's never drain); a pause, or any fleet view, brings the test back."""
    plain = [ReplicaState(id=rid, url=f"http://{rid}") for rid in ("a", "b")]
    monkeypatch.setattr(FleetView, "made", False)
    assert FleetRules(FleetSettings()).candidates("m", "openai", plain, plain, 0.0) == plain
    assert [r.id for r in FleetRules(FleetSettings(paused=["a"])).candidates("m", "openai", plain, plain, 0.0)] == ["b"]
    view = FleetView()
    assert FleetView.made
    mixed = [*plain, ReplicaState(id="o", url="http://o", fleet=view)]  # an Ollama replica without the model
    assert [r.id for r in FleetRules(FleetSettings()).candidates("m", "openai", mixed, mixed, 0.0)] == ["a", "b"]


def _router(settings: FleetSettings, replicas: list[ReplicaState], policy: str = "round-robin") -> Router:
    router = Router(region="r", policy=make_policy(policy), fleet=FleetRules(settings))
    for r in replicas:
        router.replicas[r.id] = r
    return router


def test_hot_preference_routes_to_the_hot_replica():
    """Both idle, m hot on b only: with hot_preference every request for m goes to b; without, round robin
    alternates."""
    for prefer, expected in ((True, ["b"] * 4), (False, ["a", "b", "a", "b"])):
        router = _router(FleetSettings(hot_preference=prefer), [_replica("a"), _replica("b", loaded=("m:latest",))])
        targets = []
        for i in range(4):
            router.enqueue(Request(id=f"q{i}", text="hi", arrived_at=0.0, model="m:latest", api="ollama"))
            decision, = router.dispatch(0.0)
            targets.append(decision.target)
            router.finished(decision)
        assert targets == expected


def test_hot_preference_waits_for_a_busy_hot_replica_when_sooner():
    """b has m hot but is busy; a is idle but must load m (10 s). With service_s 2 s, waiting for b (2 s) is
    cheaper: the request waits. With service_s 0 it goes to a at once (selective pushing: b has no room)."""
    for service_s, expected in ((2.0, []), (0.0, ["a"])):
        busy = _replica("b", loaded=("m:latest",), outstanding=1)
        router = _router(FleetSettings(hot_preference=True, service_s=service_s, default_load_s=10.0),
                         [_replica("a"), busy], policy="skylb")
        router.enqueue(Request(id="q", text="hi", arrived_at=0.0, model="m:latest", api="ollama"))
        assert [d.target for d in router.dispatch(0.0)] == expected


def test_runner_up_is_not_the_winner_and_not_hot():
    rules = FleetRules(FleetSettings())
    a, b, c = _replica("a", loaded=("m:latest",)), _replica("b", outstanding=2), _replica("c")
    assert rules.runner_up("m:latest", "ollama", a, [a, b, c], 0.0) is c
    assert rules.runner_up("m:latest", "ollama", a, [a, _replica("d", loaded=("m:latest",))], 0.0) is None


def test_embedding_slot_admits_one_embedding_beside_a_generation():
    """A one-slot Ollama replica busy with a generation takes one embedding with embedding_slot, none without."""
    for slot, expected in ((True, ["b"]), (False, [])):
        busy = _replica("b", outstanding=1)
        router = _router(FleetSettings(embedding_slot=slot), [busy], policy="skylb")
        router.enqueue(Request(id="e", text="x", arrived_at=0.0, model="m:latest", api="ollama", embedding=True))
        router.enqueue(Request(id="g", text="x", arrived_at=0.0, model="m:latest", api="ollama"))
        decisions = router.dispatch(0.0)
        assert [d.target for d in decisions] == expected
        if slot:  # an embedding in the slot: no second one until it finished
            router.queue.clear()
            router.enqueue(Request(id="e2", text="x", arrived_at=0.0, model="m:latest", api="ollama",
                                   embedding=True))
            assert busy.fleet.embeddings == 1 and router.dispatch(0.0) == []
            router.finished(decisions[0])
            assert busy.fleet.embeddings == 0 and [d.target for d in router.dispatch(0.0)] == ["b"]


def test_resolve_name_as_ollama_resolves_model_names():
    """A request's model resolves to the one served name with the same canonical form (default tag ``latest``, any
    case, as Ollama's types/model/name.go); an exact or unknown name, or an ambiguous one, stays as asked."""
    served = {"gemma3:latest", "llama3:8b", "Qwen/Qwen2.5-7B", "phi:latest", "PHI:latest"}
    assert resolve_name("gemma3", served) == "gemma3:latest"
    assert resolve_name("Gemma3:Latest", served) == "gemma3:latest"
    assert resolve_name("llama3:8b", served) == "llama3:8b"
    assert resolve_name("llama3", served) == "llama3"  # no llama3:latest: another tag is another model
    assert resolve_name("qwen/qwen2.5-7b", served) == "Qwen/Qwen2.5-7B"
    assert resolve_name("phi", served) == "phi"  # two served names equally close
    assert resolve_name("", served) == "" and resolve_name("gemma3", set()) == "gemma3"
