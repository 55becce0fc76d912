"""Consistent hashing of a session key onto targets, skipping unavailable ones (SkyLB-CH).

Source: SkyLB paper §3.2 ("SkyLB-CH") and Algorithm 1 lines 23-26: a ring hash with virtual nodes; when the
target owning the key's position is unavailable, the walk continues over the following virtual nodes. The ring holds
every member (available or not) so a key keeps its target across availability changes. Built on uhashring.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from uhashring import HashRing as _UHashRing

__all__ = ["HashRing"]


class HashRing:
    """A consistent-hash ring of target ids.

    Args:
        targets: initial target ids.
        vnodes: virtual nodes per target (uhashring's default is 160).
    """

    def __init__(self, targets: Iterable[str] = (), *, vnodes: int = 160):
        self._vnodes = vnodes
        self._ring = _UHashRing(nodes=[], vnodes=vnodes)
        self._members: set[str] = set()
        self.set_targets(targets)

    @property
    def targets(self) -> frozenset[str]:
        """The ring's members."""
        return frozenset(self._members)

    def set_targets(self, targets: Iterable[str]) -> None:
        """Make the ring's members exactly ``targets`` (keys of unchanged members keep their place)."""
        wanted = set(targets)
        for t in self._members - wanted:
            self._ring.remove_node(t)
        for t in wanted - self._members:
            self._ring.add_node(t, {"vnodes": self._vnodes})
        self._members = wanted

    def pick(self, key: str, available: Collection[str]) -> str | None:
        """The first target in ``available`` met walking the ring clockwise from ``key``'s position, or None."""
        if not self._members or not available:
            return None
        for node in self._ring.iterate_nodes(key, distinct=True):
            if node in available:
                return node
        return None
