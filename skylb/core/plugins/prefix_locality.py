"""Where prompts' prefixes are expected cached: this balancer's replica trie (what it sent to which local replica)
and regional snapshot trie (what it forwarded to which peer region), SkyLB paper §3.2-§3.3.

Both are the core's chunked prefix tries (skylb/core/prefix_trie.py), bounded in characters and bytes. The pickers
and rules of the prefix-aware profiles read them; this Learner keeps them up to date. One decision asks for the
prompt's replica-trie match several times (the pick, a peer comparison, the backlog accounting); the trie changes
only in ``routed``, so the first answer is kept (``replica_match``) until then.

Each local replica's record in the replica trie is bounded by what its KV cache can hold (``kv_bound``: the
engine's KV capacity in tokens from its probe, x ``CHARS_PER_TOKEN``; prefix_trie.py ``set_target_bound``): past
it the replica's oldest records go, as its engine's LRU prefix cache drops them, so a prefix it has had to give up
no longer draws requests to it. A replica whose engine does not report a capacity is bounded by the trie's
``max_chars`` alone.

With a block index attached (``attach_kv_index``: engines publishing KV-cache events), a request with block hashes
is matched exactly on the replicas whose events are live, and by the trie on the others (kv_locality.py); the
answer is kept while the index is unchanged. Without one, nothing differs from the tries alone.

Across regions, exactly (``peer_fractions``): a balancer following its engines' KV-cache events tells its peers a
bounded summary of the blocks its region holds (``held_blocks``: kv_index.py ``BlockIndex.summary``, one block in
``SUMMARY_STRIDE``, the most recent ``MAX_SUMMARY_BLOCKS``). A request with block hashes is then matched on each
peer that sent one by the deepest of its sampled block hashes that peer holds: the chain makes that block's whole
prefix held there, ``(i + 1) x block_size`` tokens, which may be up to about ``SUMMARY_STRIDE`` blocks short of the
truth, never longer (until the peer's next status). Peers without a summary, and requests without block hashes,
keep the regional snapshot trie's guess. Every plugin that prices a peer's cached prefix reads ``peer_fractions``.

Across siblings (balancers of one region; skylb/core/held_prefixes.py): once asked for its shared prefixes
(``share_prefixes``, by a router that has a sibling) it also records the prefix hashes of each prompt placed on a
local replica, for its status; ``sibling_match`` finds a request's deepest prefix among what siblings shared. A
balancer with no sibling records and computes none of it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from skylb.core.held_prefixes import HeldPrefixes, prefix_hashes
from skylb.core.estimate import CHARS_PER_TOKEN, prompt_tokens
from skylb.core.kv_index import BlockIndex, summary_sampled
from skylb.core.plugins.kv_locality import CachedMatch, KVLocality
from skylb.core.plugins.scoring import trie_key
from skylb.core.prefix_trie import Match, PrefixTrie
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["PrefixLocality"]


class PrefixLocality:
    """The replica and snapshot tries of one balancer (Learner).

    Args:
        max_chars, max_bytes, chunk_chars, double_every: each trie's bounds and chunking (prefix_trie.py).
        threshold: the smallest matched fraction of a prompt (0-1) that counts as a cache hit.
        kv_bound: bound each replica's records by its KV capacity (``kv_capacity``).
    """

    def __init__(self, *, max_chars: int, max_bytes: int, chunk_chars: int, double_every: int, threshold: float,
                 kv_bound: bool = False):
        self.replica_trie = PrefixTrie(max_chars=max_chars, max_bytes=max_bytes, chunk_chars=chunk_chars,
                                       double_every=double_every)
        self.snapshot_trie = PrefixTrie(max_chars=max_chars, max_bytes=max_bytes, chunk_chars=chunk_chars,
                                        double_every=double_every)
        self.threshold = threshold
        self.kv_bound = kv_bound
        self.replicas: set[str] = set()
        self.peers: set[str] = set()
        self._memo: tuple[object, Match] | None = None
        #: The block index's answers, or None (the tries alone) until ``attach_kv_index``.
        self.kv: KVLocality | None = None
        self._exact_memo: tuple[object, int, frozenset[str], CachedMatch] | None = None
        #: The prefixes placed on local replicas lately, for siblings; None until ``share_prefixes`` is first called.
        self.held: HeldPrefixes | None = None
        self._hash_memo: tuple[object, list[int]] | None = None
        self._peer_memo: tuple[object, tuple, dict[str, float]] | None = None
        self._sampled_memo: tuple[object, list[tuple[int, int]]] | None = None
        self._deepest_memo: tuple[object, Match] | None = None

    def attach_kv_index(self, index: BlockIndex) -> None:
        """Match requests with block hashes exactly on the replicas whose KV-cache events ``index`` follows."""
        self.kv = KVLocality(index)

    def prepare(self, request: Request) -> None:
        """Cut ``request``'s prompt into the tries' chunks now (it is being queued), once."""
        self.key(request)

    def key(self, request: Request) -> tuple[str, ...]:
        """``request``'s prompt in the tries' chunks (computed once per request)."""
        return trie_key(request, self.replica_trie)

    def matched(self, request: Request, trie: PrefixTrie, members: Collection[str]) -> tuple[frozenset[str], float]:
        """(targets with the deepest match of ``request`` in ``trie`` among ``members``, matched fraction), or
        (empty, 0.0) below ``threshold``."""
        m = trie.match(self.key(request), members)
        if not m.targets or m.ratio < self.threshold:
            return frozenset(), 0.0
        return m.targets, m.ratio

    def match_among(self, request: Request, members: Collection[str]) -> Match | CachedMatch:
        """``request``'s match among ``members`` now, not kept: exact where the index knows, else the replica
        trie's (``Match`` or ``CachedMatch``: both have ``targets`` and ``ratio``)."""
        exact = self.kv.fractions(request) if self.kv is not None else None
        if exact is None:
            return self.replica_trie.match(self.key(request), members)
        return self.kv.combine(exact, frozenset(members), lambda ids: self.replica_trie.match(self.key(request), ids))

    def replica_match(self, request: Request, members: Collection[str]) -> Match | CachedMatch:
        """``request``'s replica-trie match among ``members`` (replica ids), computed once per decision: the first
        call (the pick, over the available candidates) is reused until ``routed``. A request the queue's look-ahead
        walked while it waited is answered from that walk while it holds (no second walk). With the block index
        and block hashes, a CachedMatch, kept for the same request, members and index state."""
        exact = self.kv.fractions(request) if self.kv is not None else None
        if exact is not None:
            members = frozenset(members)
            memo = self._exact_memo
            if memo is None or memo[0] is not request or memo[1] != self.kv.index.changes or memo[2] != members:
                found = self.kv.combine(exact, members, lambda ids: self._trie_match(request, ids))
                memo = self._exact_memo = (request, self.kv.index.changes, members, found)
            return memo[3]
        if self._memo is None or self._memo[0] is not request:
            deep = self._deepest_memo
            if deep is not None and deep[0] is request and (not deep[1].targets
                                                            or not deep[1].targets.isdisjoint(members)):
                # The decision's match among every target (``deepest``) answers without a walk: nothing held, or
                # some member holds its node, which the walk among members reaches and stops at.
                d = deep[1]
                found = Match(d.targets.intersection(members), d.matched_chars, d.prompt_chars)
            else:
                kept = request.kept_match
                found = (kept.match(members) if kept is not None and kept.holds(self.replica_trie)
                         else self.replica_trie.match(self.key(request), members))
            self._memo = (request, found)
        return self._memo[1]

    def deepest(self, request: Request) -> Match | None:
        """``request``'s replica-trie match among every target the trie holds, kept until ``routed``;
        None with a block index attached (then matches are exact where it knows, and this bound does not hold).

        A node's targets include its children's (prefix_trie.py), so a match among any subset of the replicas is
        at most this deep, and reaches this node whenever the subset holds one of its targets: a rule can settle
        most requests from it without building the subset."""
        if self.kv is not None:
            return None
        memo = self._deepest_memo
        if memo is None or memo[0] is not request:
            memo = self._deepest_memo = (request, self.replica_trie.match_any(self.key(request)))
        return memo[1]

    def _trie_match(self, request: Request, members: Collection[str]) -> Match:
        """The replica trie's match among ``members``, from the look-ahead's kept walk when it still holds."""
        kept = request.kept_match
        if kept is not None and kept.holds(self.replica_trie):
            return kept.match(frozenset(members))
        return self.replica_trie.match(self.key(request), members)

    def held_fractions(self, request: Request, candidates: Sequence[ReplicaState]) -> list[float]:
        """The fraction of ``request``'s prompt each of ``candidates`` holds by itself, in order, with no threshold:
        with the block index, a live replica's exact fraction (the trie's deepest match for the others, as in
        :meth:`fractions`); else each replica's own deepest node along the request's key in the replica trie (a
        replica that holds a shorter prefix than the deepest match, such as a tree's parent prompt on the replica
        of the parent's sibling, is credited with that prefix rather than with nothing). The trie walk is the
        look-ahead's kept walk (``PrefixTrie.kept_match``), kept on the request while it holds."""
        if self.kv is not None:
            m = self.replica_match(request, {c.id for c in candidates})
            if isinstance(m, CachedMatch):
                return [m.fraction(c.id) for c in candidates]
            return [m.ratio if c.id in m.targets else 0.0 for c in candidates]
        trie = self.replica_trie
        kept = request.kept_match = trie.kept_match(self.key(request), request.kept_match)
        if not kept.prompt_chars:
            return [0.0] * len(candidates)
        reach, total = kept.reach, kept.prompt_chars
        return [reach.get(c.id, 0) / total for c in candidates]

    def matched_fraction(self, request: Request, replica_id: str, members: Collection[str]) -> float:
        """The fraction of ``request``'s prompt expected cached at ``replica_id``: the (kept) match ratio when the
        replica holds the deepest match among ``members`` and the ratio reaches ``threshold``, else 0. With the
        block index, a live replica's own exact fraction (at least ``threshold``, else 0), whatever the others hold."""
        m = self.replica_match(request, members)
        if isinstance(m, CachedMatch):
            fraction = m.fraction(replica_id)
            return fraction if fraction >= self.threshold else 0.0
        if replica_id not in m.targets or m.ratio < self.threshold:
            return 0.0
        return m.ratio

    def fractions(self, request: Request, candidates: Sequence[ReplicaState], members: Collection[str]) -> list[float]:
        """:meth:`matched_fraction` of each of ``candidates``, in order, with one lookup of the match."""
        m = self.replica_match(request, members)
        threshold = self.threshold
        if isinstance(m, CachedMatch):
            return [f if (f := m.fraction(c.id)) >= threshold else 0.0 for c in candidates]
        if not m.targets or m.ratio < threshold:
            return [0.0] * len(candidates)
        targets, ratio = m.targets, m.ratio
        return [ratio if c.id in targets else 0.0 for c in candidates]

    def held_blocks(self) -> tuple[tuple[int, ...], int] | None:
        """(the region summary of KV-cache blocks, tokens per block) for this balancer's status, or None without a
        block index or a live replica that reported its block size (several sizes: the smallest, so a peer
        under-counts rather than over-counts)."""
        if self.kv is None:
            return None
        sizes = self.kv.index.block_sizes()
        if not sizes:
            return None
        return self.kv.index.summary(), min(sizes)

    def peer_fractions(self, request: Request, peers: Sequence[PeerState]) -> dict[str, float]:
        """{peer region: fraction of ``request``'s prompt expected cached there, at least ``threshold``} for the
        ``peers`` that hold any; others are absent (0).

        A peer with a region summary of KV-cache blocks, for a request with block hashes: the deepest sampled
        block hash of the request it holds, (i + 1) x its block size tokens (module docstring). The others: the
        regional snapshot trie's deepest match among them, for its targets. Kept while the request, the peers and their
        summaries are the same and nothing was routed (the snapshot trie changes only then)."""
        exact = [p for p in peers if p.blocks is not None] if request.block_hashes is not None else []
        key = (frozenset(p.region for p in peers), tuple((p.region, id(p.blocks)) for p in exact))
        memo = self._peer_memo
        if memo is not None and memo[0] is request and memo[1] == key:
            return memo[2]
        out: dict[str, float] = {}
        others = {p.region for p in peers if p.blocks is None or request.block_hashes is None}
        if others:
            targets, ratio = self.matched(request, self.snapshot_trie, others)
            out.update((t, ratio) for t in targets)
        if exact:
            if self._sampled_memo is None or self._sampled_memo[0] is not request:
                self._sampled_memo = (request, [(i, h) for i, h in enumerate(request.block_hashes)
                                                if summary_sampled(h)][::-1])
            sampled, tokens = self._sampled_memo[1], prompt_tokens(request)
            for p in exact:
                held = p.blocks
                depth = next((i + 1 for i, h in sampled if h in held), 0)
                fraction = min(1.0, depth * p.block_size / tokens)
                if fraction >= self.threshold:
                    out[p.region] = fraction
        self._peer_memo = (request, key, out)
        return out

    def share_prefixes(self) -> tuple[tuple[int, ...], int]:
        """(prefix hashes, count added ever) of the prompts lately placed on local replicas, for a status to
        siblings (``HeldPrefixes.summary``); the first call starts recording them."""
        if self.held is None:
            self.held = HeldPrefixes()
        return self.held.summary()

    def sibling_match(self, request: Request, siblings: Sequence[PeerState]) -> tuple[list[PeerState], float]:
        """(the ``siblings`` that shared ``request``'s deepest prefix, its fraction of the prompt), or ([], 0.0)
        when none did or the fraction is below ``threshold``. The prompt's prefix hashes are computed once per
        request."""
        key = self.key(request)
        if self._hash_memo is None or self._hash_memo[0] is not request:
            self._hash_memo = (request, prefix_hashes(key))
        hashes = self._hash_memo[1]
        total = sum(map(len, key))
        chars = total
        for depth in range(len(key) - 1, -1, -1):
            if not total or chars / total < self.threshold:
                break
            holders = [s for s in siblings if hashes[depth] in s.prefixes]
            if holders:
                return holders, chars / total
            chars -= len(key[depth])
        return [], 0.0

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Record ``request``'s prompt for ``replica`` (replica trie; and for siblings once they are told) or
        ``peer`` (snapshot trie)."""
        self._memo = self._exact_memo = self._peer_memo = self._deepest_memo = None
        if replica is not None:
            self.replica_trie.insert(self.key(request), replica)
            if self.held is not None:
                self.held.add(self.key(request))
        elif peer is not None:
            self.snapshot_trie.insert(self.key(request), peer)

    def kv_capacity(self, replica: str, tokens: int | None) -> None:
        """``replica``'s engine holds ``tokens`` tokens of KV cache (None: unknown): with ``kv_bound``, its records
        in the replica trie are bounded by that many characters' worth (``tokens`` x ``CHARS_PER_TOKEN``)."""
        if self.kv_bound:
            self._memo = self._deepest_memo = None  # evictions may follow
            self.replica_trie.set_target_bound(replica, tokens * CHARS_PER_TOKEN if tokens else None)

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """Forget the prefixes of replicas and peers that left."""
        self._deepest_memo = None
        for gone in self.replicas - replicas:
            self.replica_trie.remove_target(gone)
            self.replica_trie.set_target_bound(gone, None)
        for gone in self.peers - peers:
            self.snapshot_trie.remove_target(gone)
        self.replicas, self.peers = set(replicas), set(peers)
