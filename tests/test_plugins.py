"""Each routing plugin (skylb/core/plugins/) on its own: one or more tests per module, named after it.

The named policies that compose them are tested through the Router in tests/test_policy_*.py; here each plugin's own
rule is pinned with hand-built states, so a change to one plugin shows in its own test.
"""

from __future__ import annotations

import pkgutil

import pytest

import skylb.core.plugins as plugins
from skylb.core.candidates import Candidates
from skylb.core.estimate import WaitModel, prompt_tokens, text_tokens
from skylb.core.kv_index import BlockIndex
from skylb.core.plugins.engine_pressure import EnginePressure
from skylb.core.plugins.estimated_ttft import EstimatedTTFT, PrefillEstimate
from skylb.core.plugins.estimated_wait import EstimatedWait, QueueWait, pick_by_estimated_wait
from skylb.core.plugins.forward_queued import ForwardQueued
from skylb.core.plugins.hash_ring import PeerRing, ReplicaRing, SessionKey
from skylb.core.plugins.hold_for_faster import HoldForFaster, faster
from skylb.core.plugins.home_new_prefix import HomeNewPrefix
from skylb.core.plugins.kv_admission import KVAdmission
from skylb.core.plugins.kv_locality import CachedMatch, KVLocality
from skylb.core.plugins.least_load import LeastLoad
from skylb.core.plugins.most_room import MostRoom
from skylb.core.plugins.predicted_ttft import PredictedTTFTPlacement
from skylb.core.plugins.prefer_peer import PreferFasterPeer
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.plugins.prefix_lookahead import PrefixLookahead
from skylb.core.plugins.prefix_match import PrefixMatch, SnapshotMatch
from skylb.core.plugins.push_to_holder import PushToPrefixHolder
from skylb.core.plugins.round_robin import RoundRobin
from skylb.core.plugins.scoring import loads_imbalanced
from skylb.core.plugins.sglang_tree import SGLangTree
from skylb.core.plugins.sibling_holder import ForwardToSiblingHolder
from skylb.core.plugins.spread_cap import SpreadCap, mean_occupancy
from skylb.core.predicted_ttft import PredictedTTFT
from skylb.core.prefill_model import PrefillLine
from skylb.core.profile import HOLD, Turns
from skylb.core.rates import ModelRates, RateBook
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

A = "tenant alpha system prompt " * 40
B = "tenant bravo system prompt " * 40


def _replica(rid: str, outstanding: int = 0, **fields) -> ReplicaState:
    return ReplicaState(id=rid, url=f"sim://{rid}", healthy=True, probed_at=0.0, outstanding=outstanding, **fields)


def _peer(region: str, free: int = 1, **fields) -> PeerState:
    return PeerState(region=region, url=f"sim://{region}", healthy=True, probed_at=0.0, available_replicas=free,
                     replicas=4, **fields)


def _req(rid: str, text: str, key: str | None = None, **fields) -> Request:
    return Request(id=rid, text=text, arrived_at=0.0, session_key=key, **fields)


def _locality(threshold: float = 0.5) -> PrefixLocality:
    return PrefixLocality(max_chars=10 ** 6, max_bytes=2 ** 26, chunk_chars=64, double_every=0, threshold=threshold)


def _candidates(request, local, busy=(), peers=(), reachable=(), queued=1, now=0.0) -> Candidates:
    return Candidates(request, now, list(local), list(peers), queued, len(local) + len(busy),
                      _busy=lambda: list(busy), _reachable=lambda: list(reachable))


def test_every_plugin_module_has_a_test_here():
    """Each module under skylb/core/plugins/ is named by at least one test of this file."""
    names = {m.name for m in pkgutil.iter_modules(plugins.__path__)}
    tests = [n for n in globals() if n.startswith("test_")]
    assert names and all(any(t.startswith(f"test_{n}_") for t in tests) for n in names), names


def test_scoring_imbalance_is_sglangs_two_thresholds():
    """max - min > abs and max > rel x min, both needed."""
    assert loads_imbalanced([_replica("a", 10), _replica("b", 0)], 8, 1.5)
    assert not loads_imbalanced([_replica("a", 10), _replica("b", 3)], 8, 1.5)  # gap 7
    assert not loads_imbalanced([_replica("a", 30), _replica("b", 21)], 8, 1.5)  # 30 < 1.5 x 21


def test_least_load_takes_the_fewest_and_rotates_ties():
    picker = LeastLoad(Turns())
    assert picker.pick(_req("q", "x"), [_replica("a", 2), _replica("b", 1)]).id == "b"
    tied = [_replica("a"), _replica("b")]
    assert {picker.pick(_req("q", "x"), tied).id for _ in range(2)} == {"a", "b"}


def test_round_robin_cycles_in_id_order():
    picker = RoundRobin(Turns())
    cands = [_replica("b", 9), _replica("a"), _replica("c")]
    assert [picker.pick(_req("q", "x"), cands).id for _ in range(4)] == ["a", "b", "c", "a"]


def test_hash_ring_keeps_a_session_on_its_owner_at_both_layers():
    key = SessionKey(16)
    ring = ReplicaRing(key, 40, Turns())
    ring.set_members({"r1", "r2", "r3"}, set())
    cands = [_replica("r1"), _replica("r2"), _replica("r3")]
    owner = ring.pick(_req("a", "x", key="user-7"), cands).id
    assert all(ring.pick(_req(f"b{i}", f"y{i}", key="user-7"), cands).id == owner for i in range(5))
    rest = [c for c in cands if c.id != owner]
    assert ring.pick(_req("c", "x", key="user-7"), rest).id != owner  # walks past a member without room
    assert key(_req("d", "0123456789abcdefXYZ")) == "0123456789abcdef"  # no session key: the prompt's start
    peers = PeerRing(key, 40)
    peers.set_members(set(), {"eu", "asia"})
    chosen = peers.pick(_req("e", "x", key="user-7"), [_peer("eu"), _peer("asia")]).region
    assert peers.pick(_req("f", "z", key="user-7"), [_peer("eu"), _peer("asia")]).region == chosen


def test_sglang_tree_follows_its_tree_until_loads_are_imbalanced():
    tree = SGLangTree(threshold=0.3, abs_threshold=4, rel_threshold=1.5, max_chars=10 ** 6, chunk_chars=64)
    tree.set_members({"r1", "r2"}, set())
    tree.routed(_req("h", A), replica="r2")
    assert tree.tree_chars == {"r1": 0, "r2": len(A)}
    assert tree.pick(_req("q", A + "more"), [_replica("r1"), _replica("r2", 2)]).id == "r2"  # a match
    assert tree.pick(_req("q", B), [_replica("r1", 1), _replica("r2")]).id == "r1"  # no match: smallest tree
    assert tree.pick(_req("q", A), [_replica("r1"), _replica("r2", 9)]).id == "r1"  # imbalanced: least loaded


def test_estimated_wait_prefers_the_measured_faster_replica_and_explores_idle_ones():
    rates = RateBook()
    picker = EstimatedWait(rates, Turns())
    fast, slow = _replica("fast"), _replica("slow")
    fast.rates.models["m"] = ModelRates(time_per_token_s=0.01, samples=3)
    slow.rates.models["m"] = ModelRates(time_per_token_s=0.04, samples=3)
    rates.dispatched(fast.rates, "running", "m", "x" * 400)
    request = _req("q", "y" * 400, model="m")
    assert picker.pick(request, [fast, slow]).id == "fast"  # its queue is shorter than slow's service time
    assert picker.pick(request, [fast, slow, _replica("new")]).id == "new"  # unmeasured and idle: W^ 0
    fast.rates.overall = ModelRates(time_per_token_s=0.01, samples=3)
    assert QueueWait(rates).estimated_wait_s(fast) > 0 and QueueWait(rates).estimated_wait_s(slow) is None


@pytest.mark.parametrize("seed", range(12))
def test_estimated_wait_tie_set_equals_the_rate_books_own_estimate(seed):
    """pick_by_estimated_wait writes RateBook's estimate out in one pass (its inner loop runs over every idle
    replica): differential test against ReplicaRates.for_model and RateBook.estimate_measured_s / load_s,
    with measured and unmeasured replicas, requests in flight, a fixed or learned gamma and a model load time."""
    import random
    rng = random.Random(seed)
    book = RateBook(gamma=rng.choice([None, 0.5]))
    if seed % 2:
        book.load_s = lambda replica, model: 2.0 if replica.id in ("r1", "r3", "r5", "r7") else 0.0
    replicas = []
    for i in range(12):
        r = _replica(f"r{i}")
        if rng.random() < (1.0 if seed % 3 == 2 else 0.6):  # all measured in a third of the seeds: W^ decides
            r.rates.models["m"] = ModelRates(time_per_token_s=rng.choice([0.010, 0.011, 0.012]), samples=3)
            r.rates.gamma = rng.choice([0.0, 0.5, 2.0])  # the queue weight can reorder replicas
        # every replica busy in two thirds of the seeds: the queue term (gamma x queued characters) decides, and an
        # unmeasured replica with requests in flight must be left out
        for k in range(rng.randrange(3) if seed % 3 == 0 else rng.randrange(1, 4)):
            book.dispatched(r.rates, f"f{i}-{k}", "m", "x" * rng.choice([100, 400, 2000]))
        replicas.append(r)
    request = _req("q", "y" * 300, model="m")

    def reference():
        with_rates = [(c, c.rates.for_model("m")) for c in replicas]
        if any(m is not None for _, m in with_rates):
            with_rates = [(c, m) for c, m in with_rates if m is not None or not c.rates.inflight]
        chars, f = 300, book.token_factor
        keyed = [((0.0 if m is None else book.estimate_measured_s(c.rates, m, chars)) + book.load_s(c, "m"),
                  c.rates.queued_chars * f) for c, m in with_rates]
        best_w, best_q = min(keyed)
        return [c.id for (w, q), (c, _) in zip(keyed, with_rates) if w <= best_w + 1e-6 and q <= best_q + 1.0]
    assert [c.id for c in pick_by_estimated_wait(book, request, replicas)] == reference()


def test_prefix_match_routes_hits_to_their_holder_and_snapshot_hits_to_their_region():
    loc = _locality()
    loc.routed(_req("h1", A), replica="r2")
    loc.routed(_req("h2", B), peer="asia")
    picker = PrefixMatch(loc, Turns(), abs_threshold=8, rel_threshold=1.5)
    assert picker.pick(_req("q", A + "next"), [_replica("r1"), _replica("r2", 3)]).id == "r2"
    assert picker.pick(_req("q", "unrelated " * 80), [_replica("r1", 1), _replica("r2")]).id == "r2"  # least loaded
    assert picker.pick(_req("q", A), [_replica("r1"), _replica("r2", 20)]).id == "r1"  # the load guard
    peers = [_peer("eu", free=3), _peer("asia", free=1)]
    assert SnapshotMatch(loc).pick(_req("q", B + "next"), peers).region == "asia"
    assert SnapshotMatch(loc).pick(_req("q", A), peers).region == "eu"  # no snapshot match: most room


def test_prefix_locality_forgets_members_that_left_and_keeps_one_match_per_decision():
    loc = _locality()
    loc.set_members({"r1", "r2"}, {"eu"})
    loc.routed(_req("h", A), replica="r1")
    q = _req("q", A)
    assert loc.matched_fraction(q, "r1", {"r1", "r2"}) > 0.9
    first = loc.replica_match(q, {"r2"})
    assert loc.replica_match(q, {"r1", "r2"}) is first  # kept for this request until the next placement
    loc.routed(_req("x", B), replica="r2")
    assert loc.replica_match(q, {"r1", "r2"}) is not first
    loc.set_members({"r2"}, set())
    assert loc.matched(q, loc.replica_trie, {"r1", "r2"}) == (frozenset(), 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_locality_match_among_members_from_the_deepest_equals_a_walk(seed):
    """Once a decision asked for the match among every target (``deepest``), the match among its candidates is
    derived from it when it can be; either way it equals the trie's own walk among them."""
    import random
    rng = random.Random(seed)
    loc = _locality(threshold=0.0)
    stems = [A, B, A + B, "x" * 200]
    for i in range(60):
        loc.routed(_req(f"h{i}", rng.choice(stems) + "y" * rng.randrange(0, 300, 64)), replica=f"r{rng.randrange(6)}")
    for i in range(40):
        q = _req(f"q{i}", rng.choice(stems) + "y" * rng.randrange(0, 400, 32))
        members = {f"r{k}" for k in range(6) if rng.random() < 0.4}
        if i % 2:
            loc.deepest(q)
        assert loc.replica_match(q, members) == loc.replica_trie.match(loc.key(q), members)


def _indexed(blocks: dict[str, int], live: tuple[str, ...] | None = None) -> BlockIndex:
    """An index where each replica holds the first n blocks (16 tokens each) of the chain 1, 2, 3, ..."""
    index = BlockIndex(1000)
    for rid, n in blocks.items():
        if live is None or rid in live:
            index.mark_live(rid)
        index.store(rid, range(1, n + 1), block_size=16)
    return index


@pytest.mark.parametrize("blocks, live, expected", [
    ({"r1": 4, "r2": 2}, None, {"r1": 0.5, "r2": 0.25}),  # 128-token prompt: 64 and 32 tokens held
    ({"r1": 8, "r2": 0}, None, {"r1": 1.0, "r2": 0.0}),
    ({"r1": 4, "r2": 8}, ("r1",), {"r1": 0.5}),  # r2's stream is not live: absent, the trie answers for it
    ({}, None, None),  # no live replica: no exact answer
])
def test_kv_locality_fractions_are_matched_tokens_over_prompt_tokens(blocks, live, expected):
    """Replica r holds matched_tokens[r] / prompt tokens of the prompt, for live replicas only."""
    kv = KVLocality(_indexed(blocks, live))
    request = _req("q", "x", block_hashes=tuple(range(1, 9)), prompt_tokens=128)
    assert kv.fractions(request) == expected
    assert kv.fractions(_req("n", "x", prompt_tokens=128)) is None  # no block hashes: the trie alone


def test_kv_locality_answer_is_kept_until_the_index_changes():
    """The same request is matched once per index state: a store in between gives a fresh answer."""
    index = _indexed({"r1": 2})
    kv = KVLocality(index)
    request = _req("q", "x", block_hashes=(1, 2, 3, 4), prompt_tokens=64)
    first = kv.fractions(request)
    assert kv.fractions(request) is first and first == {"r1": 0.5}
    index.store("r1", [3, 4], block_size=16)
    assert kv.fractions(request) == {"r1": 1.0}


def test_kv_locality_combines_exact_and_trie_answers():
    """Live replicas by the index, the others by the trie's deepest match; the best holders are the targets."""
    loc = _locality()
    loc.set_members({"r1", "r2", "r3"}, set())
    loc.routed(_req("h", A), replica="r3")  # the trie believes r3 (no events) holds A
    loc.routed(_req("h2", A), replica="r1")  # ... and r1, whose events say it holds only a quarter
    loc.attach_kv_index(_indexed({"r1": 2, "r2": 6}, live=("r1", "r2")))
    q = _req("q", A, block_hashes=tuple(range(1, 9)), prompt_tokens=128)
    m = loc.replica_match(q, {"r1", "r2", "r3"})
    assert isinstance(m, CachedMatch) and m.targets == {"r3"} and m.ratio == 1.0
    assert loc.matched_fraction(q, "r2", {"r1", "r2", "r3"}) == 0.75
    assert loc.matched_fraction(q, "r1", {"r1", "r2", "r3"}) == 0.0  # 0.25: below the 0.5 threshold
    assert loc.match_among(q, {"r1", "r2"}).targets == {"r2"}
    # Without block hashes the same locality answers from the tries, as without an index.
    plain = _req("p", A)
    assert loc.replica_match(plain, {"r1", "r2", "r3"}).targets == {"r1", "r3"}


def test_push_to_holder_pushes_to_the_replica_the_index_says_holds_the_prefix():
    """A full replica holding the prompt by its events gets it, though the trie never saw the prompt there."""
    loc = _locality()
    loc.set_members({"r1", "r2"}, set())
    loc.attach_kv_index(_indexed({"r2": 8}))
    rule = PushToPrefixHolder(loc, Turns(), abs_threshold=64, rel_threshold=1.5)
    r1, r2 = _replica("r1", 1), _replica("r2", 2, running=2, pending=0)
    q = _req("q", A, block_hashes=tuple(range(1, 9)), prompt_tokens=128)
    assert rule.decide(_candidates(q, [r1], busy=[r2]), None) is r2
    assert rule.decide(_candidates(_req("p", A), [r1], busy=[r2]), None) is None  # no hashes: the trie knows none


def test_estimated_ttft_weighs_a_cached_prefix_against_a_backlog():
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    loc.set_members({"r1", "r2"}, set())
    loc.routed(_req("h", A), replica="r1")
    picker = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                           rel_threshold=1.5)
    r1, r2 = _replica("r1", 1), _replica("r2", 1)
    assert picker.pick(_req("q", A + "x"), [r1, r2]).id == "r1"  # the holder prefills less
    r1.add_unprefilled("other", 4000)  # 2 s of backlog ahead on the holder
    loc.routed(_req("h2", B), replica="r2")  # (resets the kept match)
    assert picker.pick(_req("q2", A + "y"), [r1, r2]).id == "r2"
    estimate = PrefillEstimate(wait, loc)
    assert estimate.estimated_wait_s(r1) == pytest.approx(2.0)
    assert estimate.uncached_tokens(_req("q3", A), "r1") < estimate.uncached_tokens(_req("q4", A), "r2")


def test_estimated_ttft_guards_a_cache_hit_by_the_hit_thresholds():
    """With hit thresholds (``cache_hit_guard`` "holder" gives the push's, 64 and 1.5), a cache hit stays on its holder
    while the loads are imbalanced only by the load guard's (8 and 1.5); a request without a hit goes to the least
    loaded, and so does a hit once the loads pass the hit thresholds. Without them the guard takes the hit away."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    loc.set_members({"r1", "r2"}, set())
    loc.routed(_req("h", A), replica="r1")

    def picker(**hit) -> EstimatedTTFT:
        return EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5, **hit)
    holder, idle = _replica("r1", 12), _replica("r2", 2)  # 10 apart: past the load guard, not past 64
    guarded = picker(hit_abs_threshold=64, hit_rel_threshold=1.5)
    assert guarded.pick(_req("q1", A + "x"), [holder, idle]).id == "r1"
    assert guarded.pick(_req("q2", "unrelated " * 80), [holder, idle]).id == "r2"
    assert picker().pick(_req("q3", A + "x"), [holder, idle]).id == "r2"
    holder.outstanding = 80  # 78 apart and more than 1.5x: imbalanced for a hit too
    assert guarded.pick(_req("q4", A + "x"), [holder, idle]).id == "r2"
    balanced = [_replica("r1", 3), _replica("r2", 2)]  # no guard at all: the estimate, the holder prefills least
    assert guarded.pick(_req("q5", A + "x"), balanced).id == picker().pick(_req("q6", A + "x"), balanced).id == "r1"


def test_estimated_ttft_serial_guard_spreads_a_burst_and_keeps_a_stream_on_its_holder():
    """With ``burst_aware`` (``cache_hit_guard`` "serial"), past the load guard a cache hit stays on its holder unless
    the holder is still prefilling another request that shares the matched prefix and did not find it cached (a
    burst: a tree's branches behind a prefix computed now), which goes to the least loaded; once that one's first
    token is back (``prefilled``), the next hit stays again. One that found the prefix cached and prefills only its
    own part (a tenant's previous question) is a stream: the hit stays."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    loc.set_members({"r1", "r2"}, set())
    loc.routed(_req("h", A), replica="r1")
    picker = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                           rel_threshold=1.5, hit_abs_threshold=64, hit_rel_threshold=1.5, burst_aware=True)
    holder, idle = _replica("r1", 12), _replica("r2", 2)  # past the load guard, not past 64
    first = _req("b1", A + "branch one")
    assert picker.pick(first, [holder, idle]).id == "r1"
    picker.routed(first, replica="r1")
    holder.add_unprefilled("b1", prompt_tokens(first))  # the router's record: b1 computes all of its prompt on r1
    assert picker.pick(_req("b2", A + "branch two"), [holder, idle]).id == "r2"  # a burst: spread
    assert picker.pick(_req("u", "unrelated " * 80), [holder, idle]).id == "r2"  # no hit: the guard, as always
    holder.prefilled("b1")
    assert picker.pick(_req("b3", A + "next turn"), [holder, idle]).id == "r1"  # no burst any more: a stream
    second = _req("s1", A + "a question")
    picker.routed(second, replica="r1")
    holder.add_unprefilled("s1", 3)  # found A cached: it prefills its own question only
    assert picker.pick(_req("s2", A + "another question"), [holder, idle]).id == "r1"  # a stream: the hit stays
    holder.add_unprefilled("s1", prompt_tokens(second) - text_tokens(A) // 2)  # half of A computed now
    assert picker.pick(_req("s3", A + "a third question"), [holder, idle]).id == "r2"  # part of A is new: a burst


def test_estimated_ttft_own_holdings_credit_a_shorter_prefix_and_not_one_still_computed():
    """With ``holdings`` "own" each replica is priced with the prefix it holds itself, not only the deepest match's
    holder: r2 holds the parent prompt P, r1 holds P + X but is still computing X for another request that found
    only P cached, so a request for P + X + Y is priced as P held on both, behind r1's backlog, and goes to r2
    (the deepest match priced r1 as holding P + X and r2 as holding nothing). With a request waiting in an engine or
    a KV cache half full, the deepest match's pricing holds. The placement's backlog record is what was priced."""
    p, x, y, z = "p" * 1024, "x" * 448, "y" * 64, "z" * 64
    wait = WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)

    def setup(holdings: str):
        loc = _locality()
        loc.set_members({"r1", "r2"}, set())
        loc.routed(_req("parent", p), replica="r2")
        picker = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                               rel_threshold=1.5, hit_abs_threshold=64, hit_rel_threshold=1.5, burst_aware=True,
                               holdings=holdings)
        r1, r2 = _replica("r1", 1), _replica("r2", 1)
        other = _req("sibling", p + x + z)
        loc.routed(other, replica="r1")
        picker.routed(other, replica="r1")
        r1.add_unprefilled("sibling", text_tokens(x + z))  # it found P cached and computes X (and Z) on r1 now
        return loc, picker, r1, r2

    _, deepest, r1, r2 = setup("deepest")
    assert deepest.pick(_req("c0", p + x + y), [r1, r2]).id == "r1"
    loc, own, r1, r2 = setup("own")
    child = _req("c1", p + x + y)
    assert own.pick(child, [r1, r2]).id == "r2"
    costs = own.local_costs(child, [r1, r2])
    assert costs["r2"] < costs["r1"]
    assert PrefillEstimate(wait, loc, None, own).uncached_tokens(child, "r2") == text_tokens(x + y)
    r2.pending = 1  # an engine queues: the deepest match's pricing
    assert own.pick(_req("c2", p + x + y), [r1, r2]).id == "r1"
    r2.pending, r1.kv_usage = 0, 0.6
    assert own.pick(_req("c3", p + x + y), [r1, r2]).id == "r1"
    r1.kv_usage = 0.2
    r1.prefilled("sibling")  # X is cached on r1 now: it holds the most and has no backlog
    assert own.pick(_req("c4", p + x + y), [r1, r2]).id == "r1"


def test_estimated_ttft_stall_weight_sends_a_prompt_where_it_stalls_fewer_decodes():
    """With ``stall_weight`` the pick adds the generation stall of the request's prefill: r1 reads as the faster
    prefiller (its measured rate) but runs 6 requests, r2 runs 1; by first-token estimate alone the prompt goes to
    r1, with the stall priced to r2. A cache hit on the busy replica still wins where it saves more than it stalls."""
    wait = WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=True)

    def picker(stall_weight: float) -> EstimatedTTFT:
        return EstimatedTTFT(wait=wait, locality=_locality(), rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5, stall_weight=stall_weight)

    r1, r2 = _replica("r1", 6, running=6), _replica("r2", 1, running=1)
    r1.rates.overall.prefill_s_per_token, r2.rates.overall.prefill_s_per_token = 0.0004, 0.0005
    prompt = _req("a", "w" * 2000)
    assert picker(0.0).pick(prompt, [r1, r2]).id == "r1"
    assert picker(1.0).pick(prompt, [r1, r2]).id == "r2"
    weighted = picker(1.0)
    weighted.locality.set_members({"r1", "r2"}, set())
    weighted.locality.routed(_req("earlier", "w" * 1900), replica="r1")
    assert weighted.pick(_req("b", "w" * 1900 + "v" * 100), [r1, r2]).id == "r1"


def test_estimated_ttft_speed_classes_keep_the_load_guard_off_a_slower_replica():
    """The load guard sends a request to the replica with the fewest in flight; with ``speed_ratio`` it balances only
    over the replicas no other is measured that many times faster (in time per token and in decode), so a replica 4x
    slower that runs fewer requests does not take one the estimate gives to a fast one; the guard still balances the
    fast ones among themselves, and unmeasured or equally fast replicas are balanced as before."""
    wait = WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=True)

    def picker(speed_ratio: float | None) -> EstimatedTTFT:
        return EstimatedTTFT(wait=wait, locality=_locality(), rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5, speed_ratio=speed_ratio)

    fast1, fast2, slow = _replica("fast1", 12), _replica("fast2", 12), _replica("slow", 2)
    for r, s_per_token in ((fast1, 0.01), (fast2, 0.01), (slow, 0.04)):
        r.rates.models[""] = ModelRates(time_per_token_s=s_per_token, decode_s_per_token=s_per_token, samples=3)
        r.rates.overall.prefill_s_per_token = s_per_token / 20
    prompt = _req("q", "w" * 2000)
    assert picker(None).pick(prompt, [fast1, fast2, slow]).id == "slow"  # the guard: 12 against 2 in flight
    assert picker(1.5).pick(prompt, [fast1, fast2, slow]).id in {"fast1", "fast2"}
    fast2.outstanding = 30  # imbalanced among the fast ones: the guard balances them
    assert picker(1.5).pick(prompt, [fast1, fast2, slow]).id == "fast1"
    slow.rates.models[""] = ModelRates(time_per_token_s=0.012, decode_s_per_token=0.012, samples=3)  # as fast
    assert picker(1.5).pick(prompt, [fast1, fast2, slow]).id == "slow"
    del slow.rates.models[""]  # unmeasured: balanced as before
    assert picker(1.5).pick(prompt, [fast1, fast2, slow]).id == "slow"


def test_estimated_ttft_stall_term_does_not_take_a_request_to_a_slower_class_of_replica():
    """The stall term prefers the replica running fewer requests; on mixed hardware that is the slow one (it gets
    fewer), and a replica that is never alone has no measured prefill rate, so its estimate reads as fast as the
    fast one's. With speed classes on, a replica PACE_CLASS_RATIO times slower in time per token and in inter-token
    latency is priced out of the stall term while the estimate alone prefers a faster one; without them, or when
    the slow replica is not that much slower, the stall term decides as before."""
    wait = WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=True)

    def picker(speed_ratio: float | None) -> EstimatedTTFT:
        return EstimatedTTFT(wait=wait, locality=_locality(), rates=RateBook(), turns=Turns(), abs_threshold=64,
                             rel_threshold=1.5, stall_weight=0.3, speed_ratio=speed_ratio)

    fast, slow = _replica("fast", 20, running=20), _replica("slow", 6, running=6)
    fast.rates.overall.prefill_s_per_token = 0.0005  # the slow one has no lone response: priced at this rate too
    fast.rates.models[""] = ModelRates(time_per_token_s=0.05, itl_s=0.07, samples=50)
    slow.rates.models[""] = ModelRates(time_per_token_s=0.17, itl_s=0.30, samples=12)
    prompt = _req("q", "w" * 2000)
    assert picker(None).pick(prompt, [fast, slow]).id == "slow"  # fewer decodes stalled there
    assert picker(1.5).pick(prompt, [fast, slow]).id == "fast"
    slow.rates.models[""] = ModelRates(time_per_token_s=0.09, itl_s=0.12, samples=12)  # under 2.5x: one class
    assert picker(1.5).pick(prompt, [fast, slow]).id == "slow"


def test_estimated_ttft_prices_a_prompt_that_does_not_fit_in_the_free_kv_cache_as_a_wait():
    """A replica whose free KV cache (capacity x (1 - usage), less the backlog ahead) cannot take the prompt's
    uncached tokens is priced its measured service time more: the request goes where it fits, even past a cache hit;
    unmeasured, or without a capacity, nothing is added."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    loc.set_members({"r1", "r2"}, set())
    loc.routed(_req("h", A), replica="r1")
    picker = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                           rel_threshold=1.5)
    full = _replica("r1", 1, kv_usage=0.9, kv_capacity_tokens=1000)  # 100 tokens free
    roomy = _replica("r2", 1, kv_usage=0.1, kv_capacity_tokens=1000)
    q = _req("q", A + "x" * 1600)  # about 670 tokens, half of them held on r1
    assert picker.pick(q, [full, roomy]).id == "r1"  # unmeasured: no wait known, the hit wins
    full.rates.overall.service_s = 20.0
    costs = picker.local_costs(q, [full, roomy])
    assert costs["r1"] > 20.0 > costs["r2"]
    assert picker.pick(_req("q2", A + "x" * 1600), [full, roomy]).id == "r2"
    full.kv_capacity_tokens = None
    assert picker.local_costs(_req("q3", A + "x" * 1600), [full])["r1"] < 1.0


def test_most_room_counts_queues_and_what_was_sent_since():
    peers = [_peer("eu", free=3, queue_len=2), _peer("asia", free=2), _peer("us", free=4, sent_since_probe=3)]
    assert MostRoom().pick(_req("q", "x"), peers).region == "asia"


def test_engine_pressure_objects_to_a_prefill_backlog_and_a_full_kv_cache():
    f = EnginePressure(backlog_budget_tokens=2048, kv_high_watermark=0.95)
    r = _replica("r", kv_usage=0.5)
    assert f.unavailable_reason(r) is None
    r.add_unprefilled("a", 3000)
    assert f.unavailable_reason(r) == "prefill backlog"
    assert f.unavailable_reason(_replica("k", kv_usage=0.97)) == "KV cache full"
    assert EnginePressure(backlog_budget_tokens=0, kv_high_watermark=1).unavailable_reason(r) is None


def test_kv_admission_keeps_the_replicas_whose_kv_cache_takes_the_prompt_and_its_reserved_output():
    """A prompt of 1,000 tokens (4,000 characters). vLLM-like (no output reserve): it fits in 1,200 free tokens.
    SGLang-like (a reserve clip of 4,096): it needs its max_tokens more, or the clip when it gives none; the cached
    part of the prompt does not count; an idle replica, or one that reports no KV cache, always takes it."""
    uncached = {"r": 1000}
    f = KVAdmission(lambda request, rid: uncached[rid])
    prompt = "abcd" * 1000
    vllm = _replica("r", running=3, kv_capacity_tokens=10_000, kv_usage=0.88)  # 1,200 free
    assert f.admits(_req("q", prompt), vllm)
    vllm.add_unprefilled("earlier", 500)  # a prompt sent there that has not started takes its share first
    assert not f.admits(_req("q", prompt), vllm)
    sglang = _replica("r", running=3, kv_capacity_tokens=10_000, kv_usage=0.7, output_reserve_tokens=4096)
    assert f.admits(_req("q", prompt, max_tokens=2000), sglang)  # 3,000 free
    assert not f.admits(_req("q", prompt, max_tokens=2500), sglang)
    assert not f.admits(_req("q", prompt), sglang)  # no max_tokens: the engine reserves the clip
    uncached["r"] = 0  # the whole prompt cached there
    assert f.admits(_req("q", prompt, max_tokens=2500), sglang)
    uncached["r"] = 1000
    assert f.admits(_req("q", prompt), _replica("r", running=0, kv_capacity_tokens=10_000, kv_usage=0.99))
    assert f.admits(_req("q", prompt), _replica("r", running=3))


def test_kv_admission_counts_what_sglang_keeps_reserved_for_the_running_batch():
    """SGLang admits a request only beside ``new_token_ratio`` x the running requests' remaining outputs
    (``PrefillAdder``), which its KV usage does not show: 3,000 tokens look free, but this balancer's two requests
    there ask for 4,000 and 6,000 output tokens (clipped at 4,096), and at a ratio of 0.25 the engine keeps 2,024
    of them; the engine's other requests (running beyond this balancer's own) count at the same mean. Released
    when a request finishes; nothing on an engine that reserves nothing or reports no ratio."""
    f = KVAdmission(lambda request, rid: 1000)
    q = _req("q", "abcd" * 1000, max_tokens=500)  # needs 1,000 + 500
    sglang = _replica("r", running=2, kv_capacity_tokens=10_000, kv_usage=0.7, output_reserve_tokens=4096)
    sglang.output_reserve_ratio = 0.25
    assert f.admits(q, sglang)
    sglang.add_reserved("a", 4000)
    sglang.add_reserved("b", 6000)
    sglang.outstanding = 2
    assert sglang.decode_reserve_tokens() == 0.25 * (4000 + 4096)
    assert not f.admits(q, sglang)  # 3,000 - 2,024 free
    sglang.running = 4  # two more the engine runs for someone else: 4,048 reserved
    assert sglang.decode_reserve_tokens() == 2 * 0.25 * (4000 + 4096)
    sglang.release_reserved("b")
    sglang.release_reserved("b")  # once only
    sglang.running = 1
    sglang.outstanding = 1
    assert sglang.reserved_tokens == 4000 and f.admits(q, sglang)  # 3,000 - 1,000 free
    sglang.add_reserved("z", 0)  # no positive limit (not one a client can send): the clip, as with none
    assert sglang.reserved["z"] == 4096
    vllm = _replica("v", running=2, kv_capacity_tokens=10_000, kv_usage=0.7)
    vllm.add_reserved("a", 4000)  # vLLM admits on the prompt alone: nothing is reserved
    assert vllm.reserved_tokens == 0 and vllm.decode_reserve_tokens() == 0.0


def test_sglang_reserve_shrinks_by_the_tokens_generated_at_the_replicas_measured_pace():
    """Requests of 1,000 reserved output tokens on a replica whose measured inter-token latency is 10 ms: one that
    started generating 2 s ago has about 200 generated, one that started 4 s ago 400, so 1,400 of 2,000 are left,
    and one that has not started keeps its whole reserve; all times the ratio. The tokens generated are counted in
    all, never past what the started requests reserve. A request asking for more than the clip (or for no limit)
    keeps the whole clip. Without ``now`` nothing is counted off (the bound), and the filter admits a request that
    fits only once the progress is counted."""
    r = _replica("r", running=3, kv_capacity_tokens=10_000, kv_usage=0.7, output_reserve_tokens=4096)
    r.output_reserve_ratio = 0.5
    r.rates.overall.itl_s = 0.01
    for rid in ("a", "b", "c"):
        r.add_reserved(rid, 1000)
    r.reserve_started("a", 10.0, 1000)
    r.reserve_started("c", 8.0, 1000)
    r.reserve_started("unknown", 10.0, 1000)  # not reserved here: ignored
    assert r.decode_reserve_bound() == r.decode_reserve_tokens() == 0.5 * 3000
    assert r.decode_reserve_tokens(12.0) == pytest.approx(0.5 * (800 + 1000 + 600))
    assert r.decode_reserve_tokens(100.0) == pytest.approx(0.5 * 1000)  # both started ones past their reserve
    r.add_reserved("d", None)  # no limit: SGLang reserves the clip until the last 4,096 tokens
    r.reserve_started("d", 0.0, None)
    r.add_reserved("e", 5000)
    r.reserve_started("e", 0.0, 5000)
    r.running = 5
    assert r.decode_reserve_tokens(12.0) == pytest.approx(0.5 * (800 + 1000 + 600 + 4096 + 4096))
    r.release_reserved("d")
    r.release_reserved("e")
    r.running = 3
    f = KVAdmission(lambda request, rid: 1000)
    q = _req("q", "abcd" * 1000, max_tokens=800)  # 1,800 tokens: 3,000 free less 1,200 left reserved, not 1,500
    assert f.admits(q, r, 12.0) and not f.admits(q, r)
    r.release_reserved("a")
    assert r.decoding_since == {"c": 8.0} and r.decoding_tokens == 1000


def test_kv_admission_narrows_to_the_admitting_replicas_only_when_some_admit():
    f = KVAdmission(lambda request, rid: 1000)
    full = _replica("full", running=3, kv_capacity_tokens=10_000, kv_usage=0.95)
    room = _replica("room", running=3, kv_capacity_tokens=10_000, kv_usage=0.5)
    other = _replica("other", running=3, kv_capacity_tokens=10_000, kv_usage=0.96)
    q = _req("q", "abcd" * 1000)
    assert f.narrow(q, [full, room], [full]) == ([room], [])
    assert f.narrow(q, [full, room], [full, room]) == ([room], [room])
    # None can take it now: all stay (the engine's queue holds it up on one replica, not the balancer's on all).
    assert f.narrow(q, [full, other], [full]) == ([full, other], [full])


def test_push_to_holder_pushes_a_hit_into_its_full_holder_unless_it_is_bounded_or_someone_free_holds_it():
    loc = _locality()
    loc.routed(_req("h", A), replica="busy")
    rule = PushToPrefixHolder(loc, Turns(), abs_threshold=64, rel_threshold=1.5)
    holder = _replica("busy", 8, running=8)
    holder.capacity.limit = 8
    free = _replica("free")
    assert rule.decide(_candidates(_req("q", A), [free], busy=[holder]), None) is holder
    assert rule.decide(_candidates(_req("q", B), [free], busy=[holder]), None) is None  # not a hit
    stated = _replica("busy", 2, running=2, slots=2)  # llama.cpp's slots: never exceeded
    assert rule.decide(_candidates(_req("q", A), [free], busy=[stated]), None) is None
    loc.routed(_req("h2", A), replica="free")
    assert rule.decide(_candidates(_req("q", A), [free], busy=[holder]), None) is None  # a free replica holds it


def test_push_to_holder_finds_a_full_holder_below_a_deeper_match_on_a_replica_in_neither_list():
    """The rule settles most requests from the match among every replica the trie holds (``deepest``); a request
    whose deepest holder is neither free nor full (unhealthy, say) still goes to the full replica holding a shorter
    match, and a free replica holding only a shorter match than a full one does not stop the push."""
    loc = _locality()
    deeper = A + "and the tools it may call " * 20
    loc.routed(_req("h1", A), replica="busy")
    loc.routed(_req("h2", deeper), replica="gone")
    rule = PushToPrefixHolder(loc, Turns(), abs_threshold=64, rel_threshold=1.5)
    holder = _replica("busy", 8, running=8)
    holder.capacity.limit = 8
    free = _replica("free")
    assert loc.deepest(_req("q", deeper)).targets == {"gone"}
    assert rule.decide(_candidates(_req("q", deeper), [free], busy=[holder]), None) is holder
    loc.routed(_req("h3", A), replica="free")  # now a free replica holds as much as the full one
    assert rule.decide(_candidates(_req("q", deeper), [free], busy=[holder]), None) is None
    loc.routed(_req("h4", deeper), replica="busy")  # the full one holds more: pushed
    assert rule.decide(_candidates(_req("q", deeper), [free], busy=[holder]), None) is holder
    loc.attach_kv_index(BlockIndex(10))
    assert loc.deepest(_req("q", deeper)) is None  # exact matches: no bound from the trie


def test_push_to_holder_priced_goes_to_a_peer_holding_the_prefix_when_the_full_batch_is_slower():
    """With the escape, a push into a full batch whose wait (requests past the limit x service time / limit)
    exceeds a peer's round trip and prefill goes to that peer, if its region holds the prefix; a peer without it,
    a short wait, or an unmeasured holder keeps the push."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    estimate = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5)
    prefer = PreferFasterPeer(estimate=estimate, locality=loc, wait=wait, forward_margin_s=0.05,
                              default_prompt_tokens=512)
    rule = PushToPrefixHolder(loc, Turns(), abs_threshold=64, rel_threshold=1.5, escape=prefer, estimate=estimate)
    loc.routed(_req("h", A), replica="busy")
    loc.routed(_req("h2", A), peer="eu")
    holder = _replica("busy", 12, running=8, pending=4)  # 4 past a batch of 8
    holder.capacity.limit = 8
    free = _replica("free")
    eu, asia = _peer("eu", wait_s=0.0, rtt_s=0.1), _peer("asia", wait_s=0.0, rtt_s=0.01)
    q = _req("q", A)
    assert rule.decide(_candidates(q, [free], busy=[holder], peers=[eu, asia]), None) is holder  # unmeasured
    holder.rates.overall.service_s = 4.0  # (4 + 1) x 4 s / 8 = 2.5 s for a place in the batch
    assert rule.decide(_candidates(q, [free], busy=[holder], peers=[eu, asia]), None) is eu
    assert rule.decide(_candidates(q, [free], busy=[holder], peers=[asia]), None) is holder  # asia lacks it
    assert rule.decide(_candidates(q, [free], busy=[holder], peers=[_peer("eu", wait_s=5.0, rtt_s=0.1)]),
                       None) is holder  # slower there
    holder.pending = 0
    holder.outstanding = 8
    holder.rates.overall.service_s = 0.2  # 0.025 s: the push wins
    assert rule.decide(_candidates(q, [free], busy=[holder], peers=[eu]), None) is holder


def test_hold_for_faster_holds_only_for_a_replica_faster_in_decode_too():
    fast = ModelRates(time_per_token_s=0.01, decode_s_per_token=0.01, samples=3)
    slow = ModelRates(time_per_token_s=0.04, decode_s_per_token=0.04, samples=3)
    assert faster(fast, slow, 1.5) and not faster(slow, fast, 1.5)
    assert not faster(ModelRates(time_per_token_s=0.01, decode_s_per_token=0.04), slow, 1.5)
    assert not faster(ModelRates(time_per_token_s=0.01), ModelRates(time_per_token_s=0.04), 1.5)  # decode unmeasured
    rates = RateBook()
    rule = HoldForFaster(rates, 1.5)
    r_fast, r_slow = _replica("fast", 1), _replica("slow")
    r_fast.rates.models[""] = fast
    r_slow.rates.models[""] = slow
    rates.dispatched(r_fast.rates, "running", "", "x" * 400)
    c = _candidates(_req("q", "y" * 400), [r_slow], busy=[r_fast], queued=1)
    assert rule.decide(c, r_slow) is HOLD
    assert rule.decide(_candidates(_req("q", "y" * 400), [r_slow], busy=[r_fast], queued=9), r_slow) is None


def test_prefer_peer_forwards_only_to_a_peer_faster_by_the_margin():
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    estimate = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5)
    rule = PreferFasterPeer(estimate=estimate, locality=loc, wait=wait, forward_margin_s=0.05,
                            default_prompt_tokens=512)
    local = _replica("r1", 1)
    local.add_unprefilled("other", 4000)  # 2 s ahead here
    request = _req("q", "z" * 400)
    quick = _peer("eu", wait_s=0.0, rtt_s=0.1)
    assert rule.decide(_candidates(request, [local], peers=[quick]), local) is quick
    assert rule.decide(_candidates(request, [local], peers=[_peer("eu", wait_s=2.0, rtt_s=0.1)]), local) is None
    assert rule.decide(_candidates(request, [local], peers=[_peer("eu", wait_s=0.0)]), local) is None  # no rtt


def test_prefer_peer_compares_a_peer_with_the_cheapest_local_replica_not_only_the_pick():
    """The load guard may pick a replica that is not the cheapest (the least loaded, with a burst's backlog): a
    peer faster than that pick but not than another local replica with room gets nothing (``against_cheapest``;
    the rule before compared the pick alone)."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    estimate = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5)

    def rule(against_cheapest: bool) -> PreferFasterPeer:
        return PreferFasterPeer(estimate=estimate, locality=loc, wait=wait, forward_margin_s=0.05,
                                default_prompt_tokens=512, against_cheapest=against_cheapest)

    picked, idle = _replica("r1", 1), _replica("r2", 9)
    picked.add_unprefilled("sibling", 1000)  # 0.5 s ahead on the pick; none on r2
    request, quick = _req("q", "z" * 400), _peer("eu", wait_s=0.0, rtt_s=0.1)  # 100 tokens: 0.05 s to prefill
    assert rule(True).decide(_candidates(request, [picked, idle], peers=[quick]), picked) is None
    assert rule(True).decide(_candidates(request, [picked], peers=[quick]), picked) is quick  # no cheaper one
    assert rule(False).decide(_candidates(request, [picked, idle], peers=[quick]), picked) is quick


def test_sibling_holder_forwards_a_prefix_only_a_sibling_holds_when_it_is_cheaper():
    """A sibling that shared the prompt's prefix gets it over an idle local replica (the prefill saved beats the
    round trip); not a peer of another region, nor when a local replica holds it as deep, nor at a long wait."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    estimate = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5)
    prefer = PreferFasterPeer(estimate=estimate, locality=loc, wait=wait, forward_margin_s=0.05,
                              default_prompt_tokens=512)
    rule = ForwardToSiblingHolder(locality=loc, estimate=estimate, prefer=prefer)
    sharer = PrefixLocality(max_chars=10 ** 6, max_bytes=2 ** 26, chunk_chars=64, double_every=0, threshold=0.5)
    sharer.share_prefixes()
    sharer.routed(_req("t1", A), replica="a1")
    hashes, seq = sharer.share_prefixes()
    sibling, abroad = _peer("us@a", wait_s=0.0, rtt_s=0.001, sibling=True), _peer("eu", wait_s=0.0, rtt_s=0.001)
    sibling.prefixes.merge(hashes, seq)
    abroad.prefixes.merge(hashes, seq)  # as if kept: the rule still asks only siblings
    turn2, local = _req("t2", A + " and more"), _replica("r1")
    assert rule.decide(_candidates(turn2, [local], peers=[sibling, abroad]), None) is sibling
    assert rule.decide(_candidates(turn2, [local], peers=[abroad]), None) is None
    assert rule.decide(_candidates(_req("b", B), [local], peers=[sibling]), None) is None  # not shared
    assert rule.decide(_candidates(turn2, [], peers=[sibling]), None) is sibling  # no local room
    slow = _peer("us@a", wait_s=5.0, rtt_s=0.001, sibling=True)
    slow.prefixes.merge(hashes, seq)
    assert rule.decide(_candidates(turn2, [local], peers=[slow]), None) is None
    loc.routed(_req("t1", A), replica="r1")
    assert rule.decide(_candidates(_req("t2b", A + " and more"), [local], peers=[sibling]), None) is None


def test_sibling_holder_pushes_a_hit_to_a_full_sibling_with_nothing_queued():
    """With ``push_when_busy``, a sibling without room that shared the prefix gets the request (it pushes it into
    the holder's batch) while its queue was empty and fewer requests went there since its status than it has
    replicas; not with a queue, past that count, when a local replica holds the prefix, or without the option."""
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    estimate = EstimatedTTFT(wait=wait, locality=loc, rates=RateBook(), turns=Turns(), abs_threshold=8,
                             rel_threshold=1.5)
    prefer = PreferFasterPeer(estimate=estimate, locality=loc, wait=wait, forward_margin_s=0.05,
                              default_prompt_tokens=512)
    sharer = _locality()
    sharer.share_prefixes()
    sharer.routed(_req("t1", A), replica="a1")
    hashes, seq = sharer.share_prefixes()

    def full_sibling(**fields) -> PeerState:
        peer = _peer("us@a", free=0, rtt_s=0.001, sibling=True, **fields)
        peer.prefixes.merge(hashes, seq)
        return peer

    rule = ForwardToSiblingHolder(locality=loc, estimate=estimate, prefer=prefer, push_when_busy=True)
    turn2, local, busy = _req("t2", A + " and more"), _replica("r1"), full_sibling()
    assert rule.decide(_candidates(turn2, [local], reachable=[busy]), None) is busy  # over an idle local replica
    assert rule.decide(_candidates(turn2, [], reachable=[busy]), None) is busy
    assert rule.decide(_candidates(turn2, [local], reachable=[full_sibling(queue_len=1)]), None) is None
    assert rule.decide(_candidates(turn2, [local], reachable=[full_sibling(sent_since_probe=4)]), None) is None
    assert rule.decide(_candidates(_req("b", B), [local], reachable=[busy]), None) is None  # not shared
    off = ForwardToSiblingHolder(locality=loc, estimate=estimate, prefer=prefer)
    assert off.decide(_candidates(turn2, [local], reachable=[busy]), None) is None
    loc.routed(_req("t1", A), replica="r1")  # a local replica (full) holds it as deep: the holder rule's case
    assert rule.decide(_candidates(_req("t2b", A + " and more"), [], busy=[local], reachable=[busy]), None) is None


def test_forward_queued_sends_an_old_request_to_a_peer_serving_younger_ones():
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    rule = ForwardQueued(loc, wait, margin_s=2.0)
    request = _req("q", "w" * 400)  # queued since 0.0
    young = _peer("eu", free=0, queue_age_s=0.5, dispatch_rate=10.0, rtt_s=0.1)
    young.probed_at = 9.9
    c = _candidates(request, [], reachable=[young], now=10.0)
    assert rule.decide(c, None) is young  # waited 10 s here; eu's oldest had waited 0.5 s 0.1 s ago
    young.probed_at = 1.9
    assert rule.decide(_candidates(request, [], reachable=[young], now=2.0), None) is None  # within the margin


def test_prefix_lookahead_lets_a_free_replica_take_a_request_it_holds():
    loc = _locality()
    loc.routed(_req("h", A), replica="r2")
    order = PrefixLookahead(lambda: loc.replica_trie, 0.5)
    window = [_req("q0", B), _req("q1", A + "more")]
    assert order.next_in_queue(window, [_replica("r2")], [], [_replica("r1"), _replica("r2")]) == 1
    assert order.next_in_queue(window, [_replica("r1")], [], [_replica("r1"), _replica("r2")]) == 0
    # Only peers free: the first request whose cache is not here goes first.
    assert order.next_in_queue(window[::-1], [], [_peer("eu")], [_replica("r1"), _replica("r2")]) == 1


def test_predicted_ttft_prices_every_kind_of_candidate_on_one_scale():
    loc, wait = _locality(), WaitModel(prefill_tokens_per_s=2000.0, default_prompt_tokens=512, measured=False)
    loc.set_members({"r1", "r2"}, set())
    ttft = PredictedTTFT(wait=wait, prior=PrefillLine(0.05, 1 / 2000.0), forward_margin_s=0.05)
    rule = PredictedTTFTPlacement(ttft=ttft, locality=loc, turns=Turns(), hold=None, abs_threshold=16,
                                  rel_threshold=1.5, default_prompt_tokens=512)
    rule.set_members({"r1", "r2"}, set())
    loc.routed(_req("h", A), replica="r2")
    r1, r2 = _replica("r1", 1), _replica("r2", 1)
    assert rule.decide(_candidates(_req("q", A + "x"), [r1, r2]), None) is r2  # less to prefill
    full = _replica("r3", 4, running=4, pending=4)
    full.capacity.limit = 4
    assert rule.decide(_candidates(_req("q2", B), [], busy=[full], queued=1), None) is HOLD  # nothing has room


def _home(loc=None, **kw) -> HomeNewPrefix:
    return HomeNewPrefix(loc or _locality(), **{"ratio": 1.5, "slack": 4.0, "busy_fraction": 0.5, **kw})


def test_home_new_prefix_sends_a_new_group_from_a_region_under_pressure_to_the_least_loaded_peer():
    """Half the local replicas full and 20 requests per replica here against 6 and 8 abroad: a request that matches
    nothing goes to the least loaded peer (eu, 6 + its 2 forwards since its status over 4 replicas = 6.5)."""
    rule = _home()
    free = _replica("r1", running=16)
    full = [_replica("r2", running=24), _replica("r3", running=20)]
    free2 = _replica("r4", running=20)
    peers = [_peer("eu", load_per_replica=6.0, sent_since_probe=2), _peer("asia", load_per_replica=8.0)]
    c = _candidates(_req("q", A), [free, free2], busy=full, peers=peers, reachable=peers)
    assert rule.decide(c, None).region == "eu"


@pytest.mark.parametrize("case", ["few busy", "small gap", "peer load unknown", "held here", "held abroad",
                                  "forwarded", "no room here"])
def test_home_new_prefix_has_no_opinion_otherwise(case):
    loc = _locality()
    local = [_replica("r1", running=20), _replica("r2", running=20)]
    busy = [_replica("r3", running=20), _replica("r4", running=20)]
    peers = [_peer("eu", load_per_replica=6.0)]
    request = _req("q", A)
    if case == "few busy":
        local, busy = [*local, busy[0]], busy[1:]  # 1 of 4 full: below busy_fraction
    elif case == "small gap":
        peers = [_peer("eu", load_per_replica=11.0)]  # 20 <= 1.5 x 11 + 4
    elif case == "peer load unknown":
        peers = [_peer("eu")]  # an older peer says nothing of its load
    elif case == "held here":
        loc.routed(_req("h", A), replica="r3")
    elif case == "held abroad":
        loc.routed(_req("h", A), peer="eu")
    elif case == "forwarded":
        request = _req("q", A, forwarded_from="asia")
    elif case == "no room here":
        local = []
    c = _candidates(request, local, busy=busy, peers=peers, reachable=peers)
    assert _home(loc).decide(c, None) is None


def test_home_new_prefix_reads_the_block_index_for_what_is_held_here():
    """With KV-cache events the prompt's exact match among every local replica decides whether the group is new."""
    loc = _locality()
    loc.set_members({"r1", "r2"}, {"eu"})
    local, busy = [_replica("r1", running=20)], [_replica("r2", running=20)]
    peers = [_peer("eu", load_per_replica=2.0)]
    loc.attach_kv_index(_indexed({"r2": 8}, live=("r1", "r2")))
    held = _req("q", "x", block_hashes=tuple(range(1, 9)), prompt_tokens=128)  # r2's engine holds all 8 blocks
    assert _home(loc).decide(_candidates(held, local, busy=busy, peers=peers, reachable=peers), None) is None
    new = _req("n", "y", block_hashes=tuple(range(101, 109)), prompt_tokens=128)
    assert _home(loc).decide(_candidates(new, local, busy=busy, peers=peers, reachable=peers), None).region == "eu"


def test_home_new_prefix_refuses_nonsense_thresholds():
    for kw in ({"ratio": 1.0}, {"slack": -1.0}, {"busy_fraction": 1.5}):
        with pytest.raises(ValueError):
            _home(**kw)


def _burst(sent: tuple[str, ...] = ("r1",), running: int = 1, limit: int = 8):
    """Two replicas with room that both hold prefix A (a tree's parent prompt sent to both), a third that holds
    nothing, and one full replica; those named in ``sent`` were sent a request since their probe."""
    loc = _locality()
    loc.routed(_req("p1", A), replica="r1")
    loc.routed(_req("p2", A), replica="r2")
    local = [_replica(rid, running=running) for rid in ("r1", "r2", "r3")]
    full = _replica("r4", running=limit)
    for r in (*local, full):
        r.capacity.limit = limit
    for r in local:
        if r.id in sent:
            r.dispatch_times.append(0.0)
    return loc, local, full


def test_spread_cap_sends_a_branch_to_a_holder_not_sent_anything_since_its_probe_and_holds_when_none_is_left():
    """r1 took the burst's previous branch: the next goes among the replicas sent nothing since their probe (the
    other holder r2, and r3), and with every replica with room just sent one it waits for a probe."""
    loc, local, full = _burst()
    rule = SpreadCap(loc, below_occupancy=0.5, delta=0.7)
    c = _candidates(_req("b2", A + "branch two"), local, busy=[full])
    assert rule.decide(c, None) is None
    assert [r.id for r in c.local] == ["r2", "r3"]
    assert [r.probe_wanted for r in local] == [True, False, False]  # r1's next probe lifts the cap: asked for
    local[0].observe_probe(now=0.1, healthy=True, running=2, probe_sent_at=0.05)  # it saw the request sent at 0
    assert not local[0].probe_wanted and local[0].sent_since_probe == 0
    loc, local, full = _burst(sent=("r1", "r2", "r3"))
    c = _candidates(_req("b3", A + "branch three"), local, busy=[full])
    assert SpreadCap(loc, below_occupancy=0.5, delta=0.7).decide(c, None) is HOLD


@pytest.mark.parametrize("case", ["one holder", "not held", "region busy", "off"])
def test_spread_cap_has_no_opinion_and_keeps_the_candidates_otherwise(case):
    loc, local, full = _burst(running=6 if case == "region busy" else 1)
    gate, text = 0.5, A + "branch two"
    if case == "one holder":
        loc = _locality()
        loc.routed(_req("p1", A), replica="r1")
    elif case == "not held":
        text = B
    elif case == "off":
        gate = 0.0
    c = _candidates(_req("q", text), local, busy=[full])
    assert SpreadCap(loc, below_occupancy=gate, delta=0.7).decide(c, None) is None
    assert c.local == local


def test_spread_cap_occupancy_counts_running_pending_and_sent_over_the_learned_limit():
    a, b = _replica("a", running=2, pending=1), _replica("b", running=0)
    a.capacity.limit = b.capacity.limit = 4
    a.dispatch_times.append(0.0)
    assert mean_occupancy([a, b]) == pytest.approx((4 / 4 + 0 / 4) / 2)
    assert mean_occupancy([]) == 0.0


def test_spread_cap_is_the_default_profiles_first_rule_and_refuses_nonsense():
    from skylb.core.policies.base import make_policy
    assert isinstance(make_policy("skylb").first[0], SpreadCap)
    assert not any(isinstance(r, SpreadCap) for r in make_policy("skylb", spread_cap_below_occupancy=0).first)
    for kw in ({"below_occupancy": -1.0, "delta": 0.7}, {"below_occupancy": 0.5, "delta": 1.5}):
        with pytest.raises(ValueError):
            SpreadCap(_locality(), **kw)
