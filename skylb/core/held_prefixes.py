"""Prefix locality across siblings: what a balancer tells its siblings about the prompts its own replicas hold.

Balancers of one region (siblings) each own some of the region's replicas, and clients reach any of them (DNS or a
Kubernetes Service spreads them). A balancer's replica trie knows only what it routed itself, so a session's turn
that reaches another sibling than its earlier turns did would be prefilled again on that sibling's own replica.

Each balancer therefore keeps a short list of the prefixes it placed on its own replicas lately (``HeldPrefixes``)
and puts it in its peer status (``PeerStatus.prefixes``) while it has a sibling; a sibling merges what it receives
into a bounded set per sender (``SiblingPrefixes``, on ``PeerState``) and, when a request's prefix is held by a
sibling deeper than by any of its own replicas, forwards it there (skylb/core/plugins/sibling_holder.py); the
sibling routes it to the holding replica by its own trie, as for any forwarded request (one hop).

What is shared: for each prompt placed on a local replica, a 64-bit hash (BLAKE2b) of the prompt's text up to the
end of its last trie chunk and up to the end of the one before (the end of its last whole chunk when the last is
partial). A later turn of the same session extends the prompt, so its chunk boundaries pass through the earlier
turn's whole chunks and one of its prefix hashes equals the one shared: the same match the replica trie would make
(the trie's chunks are fixed by position, so an earlier prompt's whole chunks are a later one's first chunks). A
prefix several sessions share only part of the way (a system prompt) is not shared: each sibling keeps it on its
own replicas, one prefill per replica rather than one per request. The hash is of the text, so it does not depend
on the process (Python's ``hash()`` of a string does) nor on the chunking beyond where boundaries fall.

Bounds: a status carries at most ``MAX_STATUS_PREFIXES`` hashes, the most recently placed (9 bytes each in msgpack:
at most about 9.2 KiB per status, one status per probe interval per peer); with ``prefix_seq`` a receiver merges
only the hashes added since the status before, so a sender placing fewer than ``MAX_STATUS_PREFIXES / 2`` prompts
per probe interval (5,120 per second at 100 ms) loses none. A receiver keeps at most ``MAX_SIBLING_PREFIXES``
hashes per sibling, least recently shared evicted first (120 bytes each, measured with tracemalloc: about 2 MiB per
sibling), and forgets them when the sibling leaves membership. A hash the holder's engine has since evicted only
costs the forwarded request the prefill it would have paid here, as a stale trie entry does. The status goes to
every peer while this balancer has a sibling; another region's balancer does not keep it (``PeerState.sibling``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["MAX_STATUS_PREFIXES", "MAX_SIBLING_PREFIXES", "prefix_hashes", "HeldPrefixes", "SiblingPrefixes"]

#: The most prefix hashes one status carries (the sender's most recent; 9 bytes each in msgpack).
MAX_STATUS_PREFIXES = 1024
#: The most prefix hashes a receiver keeps per sibling (120 bytes each in memory).
MAX_SIBLING_PREFIXES = 16384


def prefix_hashes(key: Sequence[str]) -> list[int]:
    """For each chunk boundary of ``key`` (a prompt cut into trie chunks), the 64-bit BLAKE2b hash of the prompt's
    text up to it, as an unsigned int: ``[h(chunk 1), h(chunks 1-2), ...]``. O(prompt characters)."""
    running = hashlib.blake2b(digest_size=8)
    out = []
    for chunk in key:
        running.update(chunk.encode("utf-8", "surrogatepass"))  # a lone surrogate (bad UTF-8 in a body) hashes too
        out.append(int.from_bytes(running.copy().digest(), "big"))
    return out


class HeldPrefixes:
    """The sender's side: the prefix hashes of the prompts lately placed on this balancer's replicas, most recent
    last, at most ``cap`` of them; ``seq`` counts hashes added ever (a receiver merges only those it has not seen)."""

    def __init__(self, cap: int = MAX_STATUS_PREFIXES):
        self.cap = cap
        self.seq = 0
        # An OrderedDict, not a dict: evicting from the front of a dict leaves holes that each later ``next(iter())``
        # scans again.
        self._recent: OrderedDict[int, None] = OrderedDict()  # the oldest first

    def add(self, key: Sequence[str]) -> None:
        """A prompt cut into ``key`` was placed on a local replica: share its two deepest prefix hashes."""
        if not key:
            return
        # Only the last two boundaries are kept, so hash the text up to the one before them in one piece.
        running = hashlib.blake2b(digest_size=8)
        for chunk in key[:-2]:
            running.update(chunk.encode("utf-8", "surrogatepass"))
        for chunk in key[-2:]:
            running.update(chunk.encode("utf-8", "surrogatepass"))
            h = int.from_bytes(running.copy().digest(), "big")
            self._recent[h] = None
            self._recent.move_to_end(h)
            self.seq += 1
        while len(self._recent) > self.cap:
            self._recent.popitem(last=False)

    def summary(self) -> tuple[tuple[int, ...], int]:
        """(the hashes, oldest first; ``seq``) for a status."""
        return tuple(self._recent), self.seq


class SiblingPrefixes:
    """The receiver's side: the prefix hashes one sibling shared, at most ``cap``, the least recently shared evicted
    first."""

    def __init__(self, cap: int = MAX_SIBLING_PREFIXES):
        self.cap = cap
        self._held: OrderedDict[int, None] = OrderedDict()
        self._seq: int | None = None

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, h: int) -> bool:
        return h in self._held

    @property
    def seq(self) -> int | None:
        """The sender's count of prefixes it ever added, at its latest status (None: not said yet)."""
        return self._seq

    def merge(self, hashes: Sequence[int], seq: int | None) -> None:
        """Add a status's ``hashes`` (oldest first) with the sender's ``seq``: only the last ``seq`` minus the
        previous status's ``seq`` of them are new (all when the sender did not say, or restarted)."""
        new = len(hashes)
        if seq is not None and self._seq is not None and 0 <= seq - self._seq:
            new = min(new, seq - self._seq)
        self._seq = seq
        self._add(hashes[len(hashes) - new:] if new else ())

    def _add(self, hashes: Iterable[int]) -> None:
        held = self._held
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.cap:
            held.popitem(last=False)
