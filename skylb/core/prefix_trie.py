"""Prefix trie: an approximate map of which target has seen which prompt prefix, with bounded memory.

Source: SkyLB paper §3.2 ("SkyLB with regional snapshot") and Algorithm 1 line 21 (MAXPREFIXMATCH). Each node of the
trie stands for a prompt prefix and records the targets (replicas, or peer regions for the regional snapshot) that
were sent a request with that prefix. A target recorded at a node is recorded at all its ancestors, so the targets of
a child are a subset of its parent's: a match walks down the prompt and stops at the first node with no *available*
target, because no deeper node can have one.

Prompts are keyed in chunks (one trie node per chunk, not per character). The first ``double_every`` chunks have
``chunk_chars`` characters (256 by default: about 64 tokens at 4 characters per token, four 16-token KV blocks),
the next ``double_every`` twice that, and so on: a match is fine-grained near the start of a prompt, where prompts diverge, and about 1/16 of
the matched length deeper in (``double_every`` 16). A chunk's boundaries depend only on its position, so prompts
that share a prefix share its chunks. Nodes grow as O(log n) in the prompt's length: a 32,000-token prompt
(~160,000 characters) is 85 nodes instead of 625 at a fixed 256 characters, and the routing decision's walks are
that much shorter (bench/results/overhead.md part (d)). ``double_every`` 0 keeps every chunk at ``chunk_chars``.

Memory bound: ``max_bytes`` bounds the memory the trie holds, nodes and the eviction log of records together, and
``max_chars`` the characters of prompt the nodes stand for (each node one chunk). When an insert makes the trie exceed
either, the oldest inserted records are evicted first (paper: "starting with the earliest inserted records") until it
fits; eviction runs on every insert, never on a timer, so a burst cannot grow it past the bound. Bytes are accounted
per node (``NODE_BYTES``: its ``{target: count}`` dict, its children dict and its entry in its parent's) and per
record (``RECORD_BYTES`` plus a pointer per node of its path), constants measured with tracemalloc on CPython 3.11
(tests/test_core.py checks the accounting against tracemalloc).

Per-target bound (``set_target_bound``): a target may also be bounded in the characters of prompt it is recorded
for (the nodes holding it, a prompt's shorter last chunk not counted: the next, longer prompt of a conversation
holds the same characters in a full chunk beside it, and an engine caches only whole KV blocks), as a replica's KV
cache holds only so many tokens. Past its bound the target's own
oldest records are evicted (what an engine's LRU prefix cache drops first: vLLM's free-block queue, SGLang's radix
cache; SGLang's router bounds each worker's share of its approximate tree the same way, ``max_tree_size``), so the
trie does not send a prompt to a replica for a prefix the replica's cache had to give up. Targets without a bound
are bounded by ``max_chars`` alone.

Nodes are plain dicts (``_Node``: ``{target: count}`` with a ``children`` dict) rather than pygtrie's, and a child is
keyed by its chunk's ``hash()``, not by the chunk: the trie stores no prompt text at all. A walk is then a dict lookup
per chunk on an int (a chunk's hash is computed once per string and cached in it) with no comparison of the prompt
against text stored long ago, out of the CPU's caches: at the full trie that comparison was most of the walk of a
32,000-token prompt (bench/results/overhead.md part (d)). Two different chunks under one node with the same 64-bit
hash would share a node: a wrong cache-affinity guess for one request, never a wrong answer (the trie only steers
placement), at odds of about 2**-64 per pair. Each record keeps the path of nodes it went through, so an eviction
walks no dict at all.

Tails: where an insert leaves the trie, the rest of its key is one node, a tail, that keeps the hashes of its
further chunks (``_Node.rest``; its one record is kept beside it, ``PrefixTrie._owners``), rather than a node per
chunk: most of a long prompt is its own (the question after a shared system prompt, a conversation's latest turn),
and a node per chunk cost about 2 us each on every routing decision, the most of a decision on 12 replicas for a
15,000-token prompt, plus their eviction (bench/results/coordination.md). A match follows a tail's hashes as it
would its nodes; an insert that goes through a tail first turns the part its key shares into a node per chunk
(``_split``), so that every node still counts the records through it. A tail is one node in ``nodes`` and in the
bounds; matches, evictions and the per-target accounting are those of the trie without tails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["PrefixTrie", "Match", "KeptMatch", "chunk_text", "NODE_BYTES", "RECORD_BYTES"]

#: Bytes a trie node holds: the ``_Node`` (a ``{target: count}`` dict with its slots, its children dict and its
#: step, an int, and a tail's ``rest``) and its entry in its parent's children (~405-479 measured with tracemalloc;
#: rounded up).
NODE_BYTES = 480
#: Bytes a record of the eviction log holds besides a pointer per node of its path: the path tuple's header, the
#: [path, target] list and the deque slot (~125 measured; rounded up).
RECORD_BYTES = 144
#: Bytes per node of a record's path (one pointer in its tuple; the node is the trie's).
_POINTER_BYTES = 8
#: Bytes per further chunk of a tail: its hash (an int of up to 64 bits) and its pointer in ``rest`` (~45 measured
#: with tracemalloc; rounded up).
_REST_BYTES = 48


def chunk_text(text: str, chunk_chars: int, double_every: int = 0) -> tuple[str, ...]:
    """Split ``text`` into consecutive chunks (the last may be shorter).

    Chunk ``i`` has ``chunk_chars * 2 ** (i // double_every)`` characters; with ``double_every`` 0, ``chunk_chars``.
    """
    if not double_every:
        return tuple(text[i:i + chunk_chars] for i in range(0, len(text), chunk_chars))
    chunks = []
    pos, size, n = 0, chunk_chars, len(text)
    while pos < n:
        for _ in range(double_every):
            if pos >= n:
                break
            chunks.append(text[pos:pos + size])
            pos += size
        size *= 2
    return tuple(chunks)


def _follow(rest: tuple[int, ...], key: tuple[str, ...], start: int) -> tuple[int, int]:
    """How far ``key`` from its chunk ``start`` on follows a tail's further chunks (their hashes, ``rest``):
    (chunks, characters)."""
    chunks = chars = 0
    for step, chunk in zip(rest, key[start:]):
        if hash(chunk) != step:
            break
        chunks, chars = chunks + 1, chars + len(chunk)
    return chunks, chars


@dataclass(frozen=True)
class Match:
    """The result of a longest-prefix match.

    Attributes:
        targets: the available targets at the deepest matched node (empty when nothing matched).
        matched_chars: characters of the prompt covered by the match.
        prompt_chars: characters of the prompt; ``ratio`` = matched_chars / prompt_chars (0 for an empty prompt).
    """

    targets: frozenset[str]
    matched_chars: int
    prompt_chars: int

    @property
    def ratio(self) -> float:
        """Fraction of the prompt matched, 0-1."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0


class _Node(dict):
    """A trie node: its ``{target: count}``; its ``children`` (a chunk's ``hash()`` -> ``_Node``); ``step``, its key
    in its parent's children; ``end``, the characters of a prompt from its start through this node's chunk (so a
    branch's characters are the difference of two ends); and the trie's change count when its set of targets last
    changed (``changed``) and when a child was last added under it (``grew``): what a kept walk (``KeptMatch``)
    checks to know it still holds. A tail (``rest`` not empty) stands for several chunks of one record's key
    (``PrefixTrie._owners``): it has no children and one target, counted once."""

    __slots__ = ("changed", "grew", "children", "step", "end", "rest")

    def __init__(self, step: int = 0, end: int = 0) -> None:
        # No dict.__init__ call: the node starts empty either way, and inserts make one per new chunk.
        self.changed = self.grew = 0
        self.children: dict[int, _Node] = {}
        self.step, self.end = step, end
        #: A tail's further chunks (their hashes) after its own; ``end`` is then the last one's end (module
        #: docstring, "Tails"). Empty for a node of one chunk.
        self.rest: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class KeptMatch:
    """How far each target goes along one key, kept for a request that waits: the queue's look-ahead matches the
    same requests scan after scan, each time among the replicas free then.

    A target recorded at a node is recorded at all its ancestors, so along the key each target is present on a
    leading run of nodes: ``reach`` (target -> characters of that run) answers ``match`` for any set of available
    targets. It holds while the nodes it depends on are unchanged (``PrefixTrie.kept_match``): for each target, the
    targets of the last node of its run (it leaves the run there first) and of the key's next node (it may join
    there), or, when the trie has no next node on the key, the children of the last one (the next node may be
    added); the same for the key's first node (a target not on the key yet joins there). Changes elsewhere in the
    trie, the common case of an insert or an eviction, leave it valid.

    Attributes: reach: characters of the key covered per target (targets absent from the key's first node are not
    in it); prompt_chars: the key's characters; trie: the trie; at: the trie's change count when it was walked;
    targets_of: the node values (``_Node``) whose targets it depends on; children_of: those whose children.
    """

    reach: dict[str, int]
    prompt_chars: int
    trie: "PrefixTrie"
    at: int
    targets_of: tuple[_Node, ...]
    children_of: tuple[_Node, ...]

    def holds(self, trie: "PrefixTrie") -> bool:
        """True when ``reach`` is still right for ``trie``."""
        at = self.at
        return (self.trie is trie and all(node.changed <= at for node in self.targets_of)
                and all(node.grew <= at for node in self.children_of))

    def match(self, available: Collection[str]) -> Match:
        """The trie's ``match`` of the key among ``available``, from ``reach`` (no walk)."""
        best, here = 0, []
        pairs = (((t, self.reach.get(t, 0)) for t in available) if len(available) < len(self.reach)
                 else ((t, c) for t, c in self.reach.items() if t in available))
        for target, chars in pairs:
            if chars > best:
                best, here = chars, [target]
            elif chars == best and chars:
                here.append(target)
        return Match(frozenset(here), best, self.prompt_chars)


class PrefixTrie:
    """A chunked prefix trie mapping prompt prefixes to targets, bounded in characters and in bytes.

    Args:
        max_chars: the most characters of prompt the trie's nodes may stand for (> 0).
        max_bytes: the most bytes of memory the trie may hold, nodes and eviction log (> 0; default 64 MiB).
        chunk_chars: characters of the first chunks of a prompt (> 0).
        double_every: chunks double in length after every ``double_every`` chunks (>= 0; 0: never).

    Raises ValueError for sizes out of range. Node values are ``{target: count}``: how many live records through
    that node went to that target.
    """

    def __init__(self, *, max_chars: int = 8_000_000, chunk_chars: int = 256, double_every: int = 0,
                 max_bytes: int = 64 * 2 ** 20):
        if max_chars <= 0 or chunk_chars <= 0 or max_bytes <= 0:
            raise ValueError("max_chars, max_bytes and chunk_chars must be positive")
        if double_every < 0:
            raise ValueError("double_every must not be negative")
        self.max_chars = max_chars
        self.max_bytes = max_bytes
        self.chunk_chars = chunk_chars
        self.double_every = double_every
        #: [the nodes a record's key went through (root excluded), target], oldest first. A list: a record evicted by
        #: its target's bound drops its path at once (``_fit_target``), so the nodes of the branch it cut are freed
        #: then, one eviction at a time, not all together when the log lets go of many dead records.
        self._records: deque[list] = deque()
        self._chars = 0
        self._nodes = 0
        self._bytes = 0
        #: Inserts and evictions so far: the stamp of the changes each makes (``_Node.changed``).
        self._changes = 0
        #: The root stands for the empty prefix and holds no targets; its ``grew`` stamps a first chunk no prompt
        #: had before.
        self._root = _Node()
        #: Per-target bounds in characters (``set_target_bound``); while none was ever set, the three below stay
        #: None and nothing is tracked per target.
        self._bounds: dict[str, int] = {}
        #: Target -> characters of the nodes holding it.
        self._target_chars: dict[str, int] | None = None
        #: Target -> its live records, oldest first (the same lists as ``_records``).
        self._by_target: dict[str, deque] | None = None
        #: ids of records evicted by their target's bound, still in ``_records`` until the global eviction reaches
        #: them (a record stays referenced there, so its id is not reused meanwhile).
        self._dead: set[int] = set()
        #: id of a tail -> its one record (``_split`` extends that record's path). Kept here rather than in the node,
        #: so that a tail and its record do not refer to each other (no cycle for the collector); an entry leaves
        #: when its tail is split or cut, so an id here is always a live tail's.
        self._owners: dict[int, list] = {}

    @property
    def stored_chars(self) -> int:
        """Characters of prompt the trie's nodes stand for now (<= max_chars)."""
        return self._chars

    @property
    def stored_bytes(self) -> int:
        """Bytes of memory the trie holds now, as accounted (nodes and eviction log; <= max_bytes)."""
        return self._bytes

    @property
    def nodes(self) -> int:
        """Trie nodes now, not counting the root (a tail is one node)."""
        return self._nodes

    def __len__(self) -> int:
        """Live records (inserts not yet evicted)."""
        return len(self._records) - len(self._dead)

    def set_target_bound(self, target: str, max_chars: int | None) -> None:
        """Bound ``target`` to ``max_chars`` characters of prompt (the nodes holding it; > 0), or unbound it (None).
        From the first bound on, the trie tracks each target's characters and records; a target over its bound
        loses its oldest records now and after each insert for it. Raises ValueError for ``max_chars`` <= 0."""
        if max_chars is None:
            self._bounds.pop(target, None)
            return
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        if self._by_target is None:
            self._track_targets()
        self._bounds[target] = int(max_chars)
        self._fit_target(target)

    def target_chars(self, target: str) -> int | None:
        """Characters of prompt recorded for ``target`` (None while no target bound was ever set)."""
        return None if self._target_chars is None else self._target_chars.get(target, 0)

    def _track_targets(self) -> None:
        """Start tracking each target's characters and records (once, at the first bound): O(nodes + records)."""
        chars: dict[str, int] = {}
        stack = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                whole = self._whole_chars(node.end, child, depth)  # a prompt's shorter last chunk is not counted
                if whole:
                    for target in child:
                        chars[target] = chars.get(target, 0) + whole
                stack.append((child, depth + 1))
        by_target: dict[str, deque] = {}
        for record in self._records:
            if id(record) not in self._dead:
                by_target.setdefault(record[1], deque()).append(record)
        self._target_chars, self._by_target = chars, by_target
        self._bytes += _POINTER_BYTES * len(self)

    def _chunk_size(self, index: int) -> int:
        """The characters of a whole chunk at position ``index`` of a key (``chunk_text``)."""
        return self.chunk_chars << (index // self.double_every) if self.double_every else self.chunk_chars

    def _span(self, depth: int, count: int) -> int:
        """The characters of ``count`` whole chunks from position ``depth`` of a key on (O(doublings), not
        O(count))."""
        if not self.double_every:
            return self.chunk_chars * count
        total, end, every = 0, depth + count, self.double_every
        while depth < end:
            doubled = depth // every
            upto = min(end, (doubled + 1) * every)
            total += (upto - depth) * (self.chunk_chars << doubled)
            depth = upto
        return total

    def _whole_chars(self, start: int, node: _Node, depth: int) -> int:
        """Characters of ``node``'s whole chunks (its first at position ``depth`` of a key, from character
        ``start``): all of its chunks but a key's last when that one is shorter."""
        full = self._span(depth, 1 + len(node.rest))
        size = node.end - start
        return size if size >= full else full - self._chunk_size(depth + len(node.rest))

    def _fit_target(self, target: str) -> None:
        """Evict ``target``'s oldest records while it is over its bound."""
        bound, records = self._bounds.get(target), self._by_target.get(target)
        while bound is not None and records and self._target_chars.get(target, 0) > bound:
            record = records.popleft()
            self._dead.add(id(record))
            self._drop(*record)
            record[0] = ()  # its cut branch's nodes are freed now (the log keeps the record, dead, for a while)
        log, dead = self._records, self._dead
        while log and dead and id(log[0]) in dead:  # a target's oldest is often the log's oldest: drop it now
            dead.discard(id(log.popleft()))
        if len(self._dead) > 64 and 2 * len(self._dead) > len(self._records):
            # The log would otherwise keep dead records (their paths already dropped) until the global eviction
            # reached them, which below ``max_chars`` may be never: drop them, O(log) amortized.
            dead = self._dead
            self._records = deque(r for r in self._records if id(r) not in dead)
            dead.clear()

    @property
    def chunking(self) -> tuple[int, int]:
        """``(chunk_chars, double_every)``: how this trie cuts prompts into keys."""
        return self.chunk_chars, self.double_every

    def chunks(self, text: str) -> tuple[str, ...]:
        """The trie key of ``text``: its chunks."""
        return chunk_text(text, self.chunk_chars, self.double_every)

    def match(self, key: tuple[str, ...], available: Collection[str]) -> Match:
        """Longest prefix of ``key`` (from ``chunks()``) recorded for a target in ``available``.

        Walks down from the root and stops at the first node with no available target (paper §3.2). Cost is
        O(matched chunks). Returns the available targets at the deepest node reached.
        """
        prompt_chars = sum(map(len, key))
        best: list[str] = []
        matched = 0
        if not available or not key:
            return Match(frozenset(), 0, prompt_chars)
        node = self._root
        for i, chunk in enumerate(key):
            node = node.children.get(hash(chunk))
            if node is None:  # the prompt leaves the trie here
                break
            here = [t for t in node if t in available]
            if not here:
                break
            matched += len(chunk)
            best = here
            if node.rest:  # a tail: its record's further chunks, as far as the prompt follows them
                matched += _follow(node.rest, key, i + 1)[1]
                break
        return Match(frozenset(best), matched, prompt_chars)

    def match_any(self, key: tuple[str, ...]) -> Match:
        """``match(key, available)`` with every target available: the walk tests no target, only that a node holds
        some (O(matched chunks))."""
        prompt_chars = sum(map(len, key))
        node, last, matched = self._root, None, 0
        for i, chunk in enumerate(key):
            node = node.children.get(hash(chunk))
            if not node:  # the prompt leaves the trie here (or, never kept, a node without targets)
                break
            matched += len(chunk)
            last = node
            if node.rest:
                matched += _follow(node.rest, key, i + 1)[1]
                break
        return Match(frozenset(last) if last is not None else frozenset(), matched, prompt_chars)

    def kept_match(self, key: tuple[str, ...], kept: KeptMatch | None) -> KeptMatch:
        """A KeptMatch of ``key``: ``kept`` itself (an earlier one for the same ``key``) while it holds, else the key
        walked anew, as deep as the trie goes along it. O(1) while it holds, so a request waiting in the queue is
        walked once, not on every scan of the look-ahead, whichever replicas are free."""
        if kept is not None and kept.holds(self):
            return kept
        reach: dict[str, int] = {}
        last: dict[str, int] = {}  # target -> depth of its last node
        nodes: list[_Node] = []  # the key's nodes, root first
        depth_chars = 0
        node = self._root
        nodes.append(node)
        for i, chunk in enumerate(key):
            node = node.children.get(hash(chunk))
            if node is None:  # the prompt leaves the trie here
                break
            nodes.append(node)
            depth_chars += len(chunk)
            if node.rest:  # a tail (the key's last node here: it has no children)
                depth_chars += _follow(node.rest, key, i + 1)[1]
            for target in node:
                reach[target], last[target] = depth_chars, i + 1
        targets_of: dict[int, _Node] = {}
        children_of: dict[int, _Node] = {}
        for d in {0, *last.values()}:  # each run's last node (0: the root, before the key's first node)
            if d:
                targets_of[id(nodes[d])] = nodes[d]
            if d + 1 < len(nodes):
                targets_of[id(nodes[d + 1])] = nodes[d + 1]
            else:
                children_of[id(nodes[d])] = nodes[d]
        return KeptMatch(reach, sum(map(len, key)), self, self._changes, tuple(targets_of.values()),
                         tuple(children_of.values()))

    def insert(self, key: tuple[str, ...], target: str) -> None:
        """Record that a request with prompt ``key`` went to ``target``; evict oldest records beyond the bound.

        A key longer than the bound is truncated to fit: its leading part is what later prompts can share.
        """
        if not key:
            return
        if sum(map(len, key)) > self.max_chars:
            total = 0
            for i, chunk in enumerate(key):
                total += len(chunk)
                if total > self.max_chars:
                    key = key[:i]
                    break
        if not key:
            return
        self._changes += 1
        stamp, parent, path, end, gained, n, tail = self._changes, self._root, [], 0, 0, 0, None
        for chunk in key:
            step = hash(chunk)
            counts = parent.children.get(step)
            if counts is None:
                # The rest of the key is new: one node for all of it, a tail when it is more than one chunk.
                i = len(path)  # the chunk's position: one node of the path per chunk so far
                tail = parent.children[step] = _Node(step, end + sum(map(len, key[i:])))
                if i + 1 < len(key):
                    tail.rest = tuple(map(hash, key[i + 1:]))
                parent.grew = tail.changed = stamp  # a child added under it; a target added here
                tail[target], n = 1, 0
                gained += tail.end - end
                self._chars += tail.end - end
                self._nodes += 1
                self._bytes += NODE_BYTES + _REST_BYTES * len(tail.rest)
                path.append(tail)
                break
            if counts.rest:  # a tail this key goes through: its chunks become nodes as far as the key follows
                self._split(counts, key, len(path), end)
            end += len(chunk)
            n = counts.get(target, 0)
            if not n:
                counts.changed = stamp  # a target added here
                gained += len(chunk)
            counts[target] = n + 1
            path.append(counts)
            parent = counts
        record = [tuple(path), target]
        if tail is not None and tail.rest:
            self._owners[id(tail)] = record
        self._records.append(record)
        self._bytes += RECORD_BYTES + _POINTER_BYTES * len(path)
        if self._by_target is not None:
            if not n and len(key[-1]) < self._chunk_size(len(key) - 1):
                gained -= len(key[-1])  # a shorter last chunk, newly held: not counted (module docstring)
            records = self._by_target.get(target)
            if records is None:
                records = self._by_target[target] = deque()
            records.append(record)
            self._bytes += _POINTER_BYTES
            self._target_chars[target] = self._target_chars.get(target, 0) + gained
            if target in self._bounds:
                self._fit_target(target)
        while (self._chars > self.max_chars or self._bytes > self.max_bytes) and self._records:
            self._evict_oldest()

    def _split(self, tail: _Node, key: tuple[str, ...], depth: int, start: int) -> None:
        """Make ``tail`` (its first chunk at position ``depth`` of ``key``, from character ``start``) a node of one
        chunk, followed by a node per further chunk as far as ``key`` follows it and a tail of what is left: an
        insert of ``key`` is about to go through it, and a tail has one record (module docstring, "Tails")."""
        rest, record, stamp = tail.rest, self._owners.pop(id(tail)), self._changes
        follows = _follow(rest, key, depth + 1)[0]
        (target,) = tail
        final, pos = tail.end, start + self._chunk_size(depth)  # a tail's chunks but its last are whole
        tail.end, tail.rest, tail.grew = pos, (), stamp
        parent, made = tail, []
        for j, step in enumerate(rest):
            node = _Node(step, final if j in (follows, len(rest) - 1) else pos + self._chunk_size(depth + 1 + j))
            if j == follows and j + 1 < len(rest):  # the part the key leaves: one tail again
                node.rest, self._owners[id(node)] = rest[j + 1:], record
            node[target], node.changed = 1, stamp
            parent.children[step], parent.grew = node, stamp
            made.append(node)
            if j == follows:
                break
            parent, pos = node, node.end
        record[0] += tuple(made)  # the tail was its record's last node
        self._nodes += len(made)
        self._bytes += ((NODE_BYTES + _POINTER_BYTES) * len(made)
                        - _REST_BYTES * (len(rest) - len(made[-1].rest)))

    def remove_target(self, target: str) -> None:
        """Forget every record of ``target`` (a replica or peer that left membership)."""
        keep = deque()
        while self._records:
            record = self._records[0]
            if record[1] == target or id(record) in self._dead:
                self._evict_oldest()
            else:
                keep.append(self._records.popleft())
        self._records = keep
        if self._by_target is not None:
            self._by_target.pop(target, None)
            self._target_chars.pop(target, None)

    def _evict_oldest(self) -> None:
        record = self._records.popleft()
        if self._dead and id(record) in self._dead:  # evicted already by its target's bound
            self._dead.discard(id(record))
            return
        if self._by_target is not None:
            self._by_target[record[1]].popleft()  # a target's records are in ``_records`` order: its oldest
        self._drop(*record)

    def _drop(self, path: tuple[_Node, ...], target: str) -> None:
        """Undo one record: decrement ``target`` along ``path``, cut the branch no record passes through any more."""
        self._bytes -= RECORD_BYTES + _POINTER_BYTES * len(path) + (_POINTER_BYTES if self._by_target is not None
                                                                   else 0)
        self._changes += 1
        cut, stamp = None, self._changes  # cut: depth of the first node no live record passes through any more
        gone = None  # depth of the first node the target leaves: it leaves every node below it on the path too
        for i, counts in enumerate(path):
            n = counts[target] - 1
            if n:
                counts[target] = n
                continue
            del counts[target]
            counts.changed = stamp  # a target gone from here
            if gone is None:
                gone = i
                if self._target_chars is not None:
                    start = path[-2].end if len(path) > 1 else 0
                    partial = path[-1].end - start - self._whole_chars(start, path[-1], len(path) - 1)
                    self._target_chars[target] -= path[-1].end - (path[i - 1].end if i else 0) - partial
            if not counts:
                cut = i
                # Below an emptied node every node held this record alone (a node's targets include its children's):
                # they leave the trie with it, so only their stamps matter (a kept walk may still hold them).
                for node in path[i + 1:]:
                    node.changed = stamp
                break
        if cut is not None:
            # Nodes below a node with no records carry none either (children's targets are a subset), and every
            # node has a record through it: the branch cut is this path's nodes from ``cut`` down.
            parent = path[cut - 1] if cut else self._root
            del parent.children[path[cut].step]
            removed = path[cut:]
            self._nodes -= len(removed)
            self._chars -= removed[-1].end - parent.end  # the root ends at 0
            self._bytes -= NODE_BYTES * len(removed) + _REST_BYTES * len(removed[-1].rest)
            if removed[-1].rest:
                del self._owners[id(removed[-1])]
