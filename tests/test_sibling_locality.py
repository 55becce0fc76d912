"""Prefix locality across siblings (balancers of one region), with in-process Routers of the default profile: a
session's later turn that reaches the other sibling goes to the sibling whose replica holds its prefix; unrelated
prompts stay local; with no sibling (every peer another region's) nothing changes."""

from __future__ import annotations

from skylb.balancer.protocol import decode_status, encode_status
from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
from skylb.core.held_prefixes import MAX_SIBLING_PREFIXES, MAX_STATUS_PREFIXES, HeldPrefixes, SiblingPrefixes

#: A session's first turn: long enough that its prefill dominates (about 1,500 tokens).
TURN_1 = "".join(f"user: tell me about topic {i} in some detail please. " for i in range(120))
TURN_2 = TURN_1 + "assistant: here is a long answer. " * 20 + "user: and one more thing? "
UNRELATED = "".join(f"user: something else entirely, number {i}. " for i in range(120))


def _router(name: str, replicas: list[str], peers: list[tuple[str, bool]]) -> Router:
    """A router of region ``name``'s region with local ``replicas`` and ``peers`` (name, is a sibling)."""
    router = Router(region=name, policy=make_policy("skylb"), rules=AvailabilityRules())
    router.set_replicas([(r, f"sim://{r}", "vllm") for r in replicas])
    router.set_peers([(p, f"sim://{p}") for p, _ in peers])
    for p, sibling in peers:
        router.peers[p].sibling = sibling
    return router


def _tick(now: float, routers: dict[str, Router]) -> None:
    """Probe every replica idle at ``now`` and give every router its peers' statuses (through the wire format)."""
    for router in routers.values():
        for rid in router.replicas:
            router.observe_replica(rid, now=now, healthy=True, pending=0, running=0)
    for router in routers.values():
        for name in router.peers:
            status = decode_status(encode_status(routers[name].status(now)))
            router.observe_peer(name, now=now, status=status, rtt_s=0.001)


def _place(router: Router, rid: str, text: str, now: float, forwarded_from: str | None = None):
    router.enqueue(Request(rid, text, arrived_at=now, forwarded_from=forwarded_from))
    [decision] = router.dispatch(now)
    router.finished(decision)
    return decision


def test_a_later_turn_at_the_other_sibling_goes_to_the_replica_holding_its_prefix():
    """us@a routes turn 1 to one of its replicas; turn 2 (turn 1 extended) reaches us@b, which forwards it to us@a
    (and us@a to that replica); an unrelated prompt at us@b stays on us@b's replicas; a third turn at us@b follows."""
    a = _router("us@a", ["a1", "a2"], [("us@b", True), ("eu", False)])
    b = _router("us@b", ["b1", "b2"], [("us@a", True), ("eu", False)])
    eu = _router("eu", ["e1"], [("us@a", False), ("us@b", False)])
    routers = {"us@a": a, "us@b": b, "eu": eu}
    _tick(0.0, routers)
    first = _place(a, "t1", TURN_1, 0.01)
    assert first.route == "local"
    _tick(0.1, routers)
    status = a.status(0.1)
    assert status.prefixes and len(status.prefixes) == 2 and status.prefix_seq == 2
    assert len(b.peers["us@a"].prefixes) == 2 and not len(eu.peers["us@a"].prefixes)  # only a sibling keeps them

    second = _place(b, "t2", TURN_2, 0.11)
    assert (second.route, second.target) == ("peer", "us@a")
    at_a = _place(a, "t2", TURN_2, 0.12, forwarded_from="us@b")
    assert (at_a.route, at_a.target) == ("local", first.target)

    other = _place(b, "u1", UNRELATED, 0.13)
    assert other.route == "local" and other.target in {"b1", "b2"}

    _tick(0.2, routers)
    third = _place(b, "t3", TURN_2 + "assistant: sure. user: thanks, last one? ", 0.21)
    assert (third.route, third.target) == ("peer", "us@a")


def test_a_sibling_that_holds_the_prefix_no_deeper_than_a_local_replica_does_not_get_it():
    """Turn 1 routed by both siblings: us@b's own replica holds it as deep, so turn 2 stays at us@b."""
    a = _router("us@a", ["a1"], [("us@b", True)])
    b = _router("us@b", ["b1"], [("us@a", True)])
    routers = {"us@a": a, "us@b": b}
    _tick(0.0, routers)
    _place(a, "t1a", TURN_1, 0.01)
    _place(b, "t1b", TURN_1, 0.02)
    _tick(0.1, routers)
    assert _place(b, "t2", TURN_2, 0.11).route == "local"


def test_a_busy_sibling_loses_to_an_idle_local_replica_and_a_full_region_keeps_the_holder():
    """The sibling's cost is priced: with a wait there far above the prefill saved, turn 2 stays local. With no
    local room, the holding sibling with room takes it."""
    a = _router("us@a", ["a1"], [("us@b", True)])
    b = _router("us@b", ["b1"], [("us@a", True)])
    routers = {"us@a": a, "us@b": b}
    _tick(0.0, routers)
    _place(a, "t1", TURN_1, 0.01)
    _tick(0.1, routers)
    busy = a.status(0.1)
    b.observe_peer("us@a", now=0.1, rtt_s=0.001, status=PeerStatus(
        "us@a", available_replicas=1, replicas=1, queue_len=0, wait_ms=30_000.0, prefixes=busy.prefixes,
        prefix_seq=busy.prefix_seq))
    assert _place(b, "t2", TURN_2, 0.11).route == "local"
    _tick(0.2, routers)
    b.observe_replica("b1", now=0.2, healthy=True, pending=3)  # no room at us@b
    decision = _place(b, "t3", TURN_2 + " again", 0.21)
    assert (decision.route, decision.target) == ("peer", "us@a")


def test_with_no_sibling_nothing_is_shared_and_routing_is_unchanged():
    """Two regions, one balancer each: no status carries prefixes, nothing is recorded, and turn 2 at the other
    region's balancer stays there (cross-region peers keep their behaviour: the snapshot and estimates alone)."""
    us = _router("us", ["u1"], [("eu", False)])
    eu = _router("eu", ["e1"], [("us", False)])
    routers = {"us": us, "eu": eu}
    _tick(0.0, routers)
    _place(us, "t1", TURN_1, 0.01)
    _tick(0.1, routers)
    assert us.status(0.1).prefixes is None and us.policy.learners[0].held is None
    assert _place(eu, "t2", TURN_2, 0.11).route == "local"
    # A status that carries prefixes anyway (a sibling elsewhere) is not kept for a peer of another region.
    held = HeldPrefixes()
    held.add(us.policy.learners[0].key(Request("x", TURN_1, 0.0)))
    hashes, seq = held.summary()
    eu.observe_peer("us", now=0.2, rtt_s=0.001, status=PeerStatus("us", 1, 1, 0, wait_ms=0.0, prefixes=hashes,
                                                                   prefix_seq=seq))
    assert not len(eu.peers["us"].prefixes)


def test_the_shared_prefixes_are_bounded_both_ways_and_survive_the_wire():
    """A sender keeps its newest MAX_STATUS_PREFIXES hashes, a receiver at most MAX_SIBLING_PREFIXES per sibling
    and merges only what is new (``prefix_seq``); the wire keeps unsigned 64-bit ints only."""
    held = HeldPrefixes()
    for i in range(MAX_STATUS_PREFIXES):  # two hashes per prompt
        held.add((f"prompt {i} ", "tail"))
    hashes, seq = held.summary()
    assert len(hashes) == MAX_STATUS_PREFIXES and seq == 2 * MAX_STATUS_PREFIXES
    kept = SiblingPrefixes()
    kept.merge(hashes, seq)
    assert len(kept) == MAX_STATUS_PREFIXES and hashes[0] in kept
    kept.merge(hashes, seq)  # nothing new: nothing merged
    assert len(kept) == MAX_STATUS_PREFIXES
    small = SiblingPrefixes(cap=4)
    small.merge(tuple(range(10)), 10)
    assert len(small) == 4 and 9 in small and 5 not in small
    assert MAX_SIBLING_PREFIXES >= MAX_STATUS_PREFIXES
    status = PeerStatus("us@a", 1, 1, 0, prefixes=hashes, prefix_seq=seq)
    wire = encode_status(status)
    assert len(wire) < 10 * MAX_STATUS_PREFIXES and decode_status(wire) == status
    odd = decode_status(encode_status(PeerStatus("us@a", 1, 1, 0, prefixes=(1, True, -1, "x", 2.0, 2), prefix_seq=3)))
    assert odd.prefixes == (1, 2)
