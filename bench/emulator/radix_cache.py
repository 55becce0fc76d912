"""A token-granular radix tree of cached KV (page size 1), as SGLang's ``RadixCache`` keeps it.

Source: sgl-project/sglang v0.4.3, ``python/sglang/srt/mem_cache/radix_cache.py`` (``RadixCache.match_prefix``,
``insert``, ``evict``, ``inc_lock_ref``, ``dec_lock_ref``, ``_split_node``). A node holds a run of tokens (its
``key``); a path from the root spells a cached prefix. A node locked by a running request (``lock_ref`` > 0, the
lock covers the whole path to the root) is *protected*; the rest is *evictable*: ``evict`` removes unlocked
leaves, least recently used first, until enough tokens are freed. Matching splits a node where a key diverges
inside it, so the returned last node covers exactly the matched prefix (SGLang does the same; a later lock on it
protects no more than the match).

Tokens are any hashable, equality-comparable values (the engine model passes words, and ints for generated
tokens). Time is a logical counter (no clock reads): every match or insert is one tick, and the nodes it touches
take that tick as their last access; ties between leaves are broken by creation order. Deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["RadixCache", "TreeNode"]


class TreeNode:
    """One run of cached tokens. ``children`` maps a child's first token to the child."""

    __slots__ = ("key", "children", "parent", "lock_ref", "last_access", "nid")

    def __init__(self, key: list, parent: "TreeNode | None", nid: int, tick: int):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = tick
        self.nid = nid

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for eviction: least recently used first
        return (self.last_access, self.nid) < (other.last_access, other.nid)


def _common_prefix(a: list, b: Sequence, start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]`` (binary search on slice equality: C-speed compares)."""
    hi = min(len(a), len(b) - start)
    if a[:hi] == b[start:start + hi]:
        return hi
    lo = 0  # invariant: a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[start:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """Cached tokens as a radix tree; sizes in tokens.

    Attributes:
        evictable_size: tokens in nodes no running request locks (SGLang ``evictable_size_``).
        protected_size: tokens in locked nodes (SGLang ``protected_size_``).
        evicted_tokens: tokens evicted so far.
    """

    def __init__(self) -> None:
        self._tick = 0
        self._nid = 0
        self.root = TreeNode([], None, 0, 0)
        self.root.lock_ref = 1  # never evicted, as in SGLang's reset()
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_tokens = 0

    @property
    def total_size(self) -> int:
        """Tokens held by the tree (evictable plus protected)."""
        return self.evictable_size + self.protected_size

    def match_prefix(self, key: Sequence) -> tuple[int, TreeNode]:
        """Longest cached prefix of ``key``: (its length in tokens, the node ending exactly there).

        Touches the matched nodes (LRU) and splits the last one when the match ends inside it.
        """
        self._tick += 1
        tick = self._tick
        node = self.root
        node.last_access = tick
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            child.last_access = tick
            ck = child.key
            m = len(ck)
            if key[i:i + m] != ck:
                m = _common_prefix(ck, key, i)
                node = self._split(child, m)
                i += m
                break
            node = child
            i += m
        return i, node

    def peek_prefix(self, key: Sequence) -> int:
        """Length of the longest cached prefix of ``key``; no side effects (no touch, no split)."""
        node = self.root
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            ck = child.key
            m = len(ck)
            if key[i:i + m] != ck:
                return i + _common_prefix(ck, key, i)
            node = child
            i += m
        return i

    def insert(self, key: Sequence) -> int:
        """Cache ``key``; returns how many of its leading tokens were cached already (SGLang ``insert``).

        The new tokens form one new unlocked leaf (they count as evictable until someone locks them).
        """
        self._tick += 1
        tick = self._tick
        node = self.root
        node.last_access = tick
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            child.last_access = tick
            ck = child.key
            m = len(ck)
            if key[i:i + m] != ck:
                m = _common_prefix(ck, key, i)
                node = self._split(child, m)
                i += m
                break
            node = child
            i += m
        if i < n:
            self._nid += 1
            leaf = TreeNode(list(key[i:]), node, self._nid, tick)
            node.children[key[i]] = leaf
            self.evictable_size += n - i
        return i

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path from ``node`` to the root (a running request uses it): its tokens become protected."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                size = len(node.key)
                self.evictable_size -= size
                self.protected_size += size
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        root = self.root
        while node is not root:
            if node.lock_ref == 1:
                size = len(node.key)
                self.evictable_size += size
                self.protected_size -= size
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves, least recently used first, until ``num_tokens`` are freed or none is left.

        Whole leaves go, so more than asked may be freed; a parent left childless becomes a candidate in turn
        (SGLang ``evict``). Returns the tokens freed.
        """
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        # Heap entries (last access, creation order, node): the nodes' own order (``TreeNode.__lt__``) compared in C.
        # A locked leaf is never evicted and keeps its parent, so it is left out of the heap from the start.
        leaves = [(x.last_access, x.nid, x) for x in self._leaves() if x.lock_ref <= 0]
        heapq.heapify(leaves)
        freed = 0
        root = self.root
        while freed < num_tokens and leaves:
            x = heapq.heappop(leaves)[2]
            if x is root:
                break
            size = len(x.key)
            freed += size
            parent = x.parent
            del parent.children[x.key[0]]
            self.evictable_size -= size
            if not parent.children and parent.lock_ref <= 0:
                heapq.heappush(leaves, (parent.last_access, parent.nid, parent))
        self.evicted_tokens += freed
        return freed

    # ---- internals --------------------------------------------------------------------------------------------

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` after ``at`` tokens (0 < at < len); returns the new upper node (SGLang ``_split_node``)."""
        self._nid += 1
        upper = TreeNode(child.key[:at], child.parent, self._nid, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _leaves(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out
