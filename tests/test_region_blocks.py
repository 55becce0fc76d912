"""Exact cache locality across regions: a balancer following its engines' KV-cache events tells its peers a bounded
summary of the blocks its region holds (BlockIndex.summary, PeerStatus.blocks), and a balancer forwarding a request
with block hashes sends it to the region that holds its prefix (PrefixLocality.peer_fractions), with in-process
Routers of the default profile and the status's wire format."""

from __future__ import annotations

from skylb.balancer.protocol import decode_status, encode_status
from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
from skylb.core.kv_events import BlockRemoved, BlockStored, apply_events
from skylb.core.kv_index import MAX_SUMMARY_BLOCKS, SUMMARY_STRIDE, BlockIndex, summary_sampled

BLOCK = 16
#: A prompt of 10 blocks whose hashes are sampled for summaries at positions 3 and 7 only.
HASHES = tuple(SUMMARY_STRIDE * (1000 + i) + (0 if i in (3, 7) else 1) for i in range(10))


def _stored(hashes, parent=None) -> BlockStored:
    return BlockStored(list(hashes), parent, [0] * (BLOCK * len(hashes)), BLOCK)


def test_the_summary_holds_the_sampled_blocks_live_replicas_hold_newest_first_and_bounded():
    index = BlockIndex()
    index.mark_live("r1")
    index.mark_live("r2")
    apply_events(index, "r1", [_stored(HASHES)])
    assert [summary_sampled(h) for h in HASHES].count(True) == 2
    assert index.summary() == (HASHES[7], HASHES[3])
    apply_events(index, "r1", [BlockRemoved([HASHES[7]])])  # evicted: no longer advertised
    assert index.summary() == (HASHES[3],)
    apply_events(index, "r2", [_stored(HASHES[:8])])  # held again, by another replica, and now the newest
    assert index.summary() == (HASHES[7], HASHES[3])
    index.mark_stale("r2")  # its stream is gone: what it held is not advertised
    assert index.summary() == (HASHES[3],)
    many = [SUMMARY_STRIDE * (10 ** 6 + i) for i in range(3 * MAX_SUMMARY_BLOCKS)]
    apply_events(index, "r1", [_stored(many)])
    summary = index.summary()
    assert len(summary) == MAX_SUMMARY_BLOCKS and summary[0] == many[-1] and len(index.summary(limit=5)) == 5


def test_the_summary_survives_the_wire_bounded_and_stripped_of_garbage():
    status = PeerStatus("asia", 1, 1, 0, blocks=HASHES, block_size=BLOCK)
    back = decode_status(encode_status(status))
    assert back.blocks == HASHES and back.block_size == BLOCK
    odd = decode_status(encode_status(PeerStatus("asia", 1, 1, 0, blocks=(8, True, -8, "x", 2.0, 16),
                                                 block_size=BLOCK)))
    assert odd.blocks == (8, 16)
    big = decode_status(encode_status(PeerStatus("asia", 1, 1, 0, blocks=tuple(range(2 * MAX_SUMMARY_BLOCKS)),
                                                 block_size=BLOCK)))
    assert big.blocks == tuple(range(MAX_SUMMARY_BLOCKS))  # the first ones: the newest
    assert decode_status(encode_status(PeerStatus("asia", 1, 1, 0))).blocks is None


def _router(region: str, replicas: list[str], peers: list[str], index: BlockIndex | None = None) -> Router:
    router = Router(region=region, policy=make_policy("skylb"), rules=AvailabilityRules())
    if index is not None:
        router.policy.attach_kv_index(index)
    router.set_replicas([(r, f"sim://{r}", "vllm") for r in replicas])
    router.set_peers([(p, f"sim://{p}") for p in peers])
    return router


def _tick(now: float, routers: dict[str, Router], busy: dict[str, int]) -> None:
    """Probe every replica at ``now`` (``busy``: replica -> pending requests) and pass every status over the wire."""
    for router in routers.values():
        for rid in router.replicas:
            router.observe_replica(rid, now=now, healthy=True, pending=busy.get(rid, 0), running=0)
    for router in routers.values():
        for name in router.peers:
            status = decode_status(encode_status(routers[name].status(now)))
            router.observe_peer(name, now=now, status=status, rtt_s=0.05)


def _forward(router: Router, rid: str, now: float, text: str, *, block_hashes=HASHES) -> str:
    router.enqueue(Request(rid, text * 160, arrived_at=now, prompt_tokens=len(HASHES) * BLOCK,
                           block_hashes=block_hashes))
    [decision] = router.dispatch(now)
    router.finished(decision)
    assert decision.route == "peer"
    return decision.target


def test_a_full_region_forwards_to_the_region_whose_engines_hold_the_prefix_and_not_once_it_is_evicted():
    """us's replica is busy; asia has more room (and wins ties: its name sorts first), eu's engine holds the prompt's
    first 8 blocks (its summary's deepest sampled block is the 8th: 128 of 160 tokens): the request goes to eu.
    Without block hashes (no events followed here), or once eu's engine evicted the 8th block (then 64 tokens: below
    the match threshold), it goes to asia, whatever the regional snapshot trie guesses."""
    eu_index = BlockIndex()
    eu_index.mark_live("e1")
    apply_events(eu_index, "e1", [_stored(HASHES[:8])])
    us = _router("us", ["u1"], ["eu", "asia"])
    eu = _router("eu", ["e1"], ["us", "asia"], index=eu_index)
    asia = _router("asia", ["a1", "a2", "a3"], ["us", "eu"])
    routers = {"us": us, "eu": eu, "asia": asia}
    _tick(0.0, routers, busy={"u1": 8})
    assert us.peers["eu"].blocks == {HASHES[7], HASHES[3]} and us.peers["asia"].blocks is None
    assert _forward(us, "q1", 0.01, "x ") == "eu"
    _tick(0.1, routers, busy={"u1": 8})
    assert _forward(us, "q2", 0.11, "y ", block_hashes=None) == "asia"
    apply_events(eu_index, "e1", [BlockRemoved([HASHES[7]])])
    _tick(0.2, routers, busy={"u1": 8})
    assert us.peers["eu"].blocks == {HASHES[3]}
    assert _forward(us, "q3", 0.21, "x ") == "asia"  # though the snapshot trie remembers q1's text sent to eu
