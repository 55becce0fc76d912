"""The discrete-event loop of the simulator: a clock in simulated seconds and a heap of timed callbacks.

Nothing here knows about LLMs or balancers. Events at the same time run in the order they were scheduled (a
sequence number breaks ties), so a run is a deterministic function of its inputs: no wall clock, no threads, no
iteration over unordered containers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop"]


class EventLoop:
    """A simulated clock and its pending events.

    Attributes:
        now: the current simulated time, s (starts at 0 and never goes back).
        events: events run so far (for profiling and tests).
    """

    __slots__ = ("now", "events", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``t`` (s); a time in the past runs at ``now``."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` ``delay_s`` seconds from now."""
        self.at(self.now + delay_s, fn, *args)

    def __len__(self) -> int:
        """Events still pending."""
        return len(self._heap)

    def run(self, *, until: float | None = None) -> None:
        """Run events in time order until none is left (or the next is later than ``until``, s)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
