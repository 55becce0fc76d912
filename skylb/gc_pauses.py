"""The garbage collector's pauses in a SkyLB process: the startup heap frozen, every collection's pause measured.

CPython's cyclic garbage collector stops the whole process while it scans a generation's containers (Python
documentation, ``gc`` module). A full (oldest-generation) collection scans every tracked object, most of them the
modules, functions and classes imported at startup, which never become garbage; in a balancer the event loop
stalls for the whole pause, so every stream it relays and every routing decision waits. ``gc.freeze()`` ("move
all objects tracked by gc to a permanent generation and ignore them in all future collections", ``gc`` module,
Python 3.7+) after startup leaves the collections only what was made since: vLLM's engine core and SGLang's
scheduler freeze their startup heap the same way. An object frozen is still freed by reference counting as soon
as nothing refers to it; only a reference cycle among frozen objects would outlive its last outside reference,
which is why only the startup heap is frozen, once.

Measured on one balancer serving 6,000 requests of distinct prompts (bench/results/gc_pauses.md): when its trie
kept a node per prompt chunk, a trie of 8 M characters (33k nodes) brought one full collection, which stopped the
balancer for 120 ms unfrozen, 64 ms frozen (the rest was the trie's nodes); with the unshared rest of each prompt
one node (skylb/core/prefix_trie.py, "Tails": 3k nodes) none came, nor with the default KV-bounded trie.

:data:`PAUSES` is the ``skylb_gc_pause_seconds`` histogram (by ``generation``, 0-2), one per process, which
:func:`watch` feeds; ``SKYLB_GC_FREEZE=0`` (skylb/environment.py) leaves the heap unfrozen, for comparison.
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Histogram

from skylb import environment

__all__ = ["PAUSES", "watch", "freeze_startup_heap", "freeze_enabled"]

#: Pauses from a tenth of a millisecond (a young collection) to a second.
_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

#: This process's collections, by generation collected; registered in each balancer's metrics registry.
PAUSES = Histogram("skylb_gc_pause_seconds", "Pauses of this process's cyclic garbage collector, by generation "
                   "collected (2: a full collection), s: the event loop serves nothing meanwhile.", ["generation"],
                   buckets=_BUCKETS_S, registry=None)

_started: list[float] = []
# Made now, not in the callback: a collection can start inside ``labels()``, which holds the metric's lock. The
# callback then takes only these children's value locks, and no code allocates a container while holding one (the
# only way a collection, and so the callback, could start there).
_children = {generation: PAUSES.labels(str(generation)) for generation in (0, 1, 2)}


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        _children[info["generation"]].observe(time.perf_counter() - _started.pop())


def watch() -> None:
    """Measure every collection of this process from now on into :data:`PAUSES` (once per process: a second call
    adds nothing)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def freeze_enabled() -> bool:
    """False when ``SKYLB_GC_FREEZE`` is ``0``, ``false``, ``no`` or ``off``; True otherwise (the default)."""
    value = environment.env(environment.GC_FREEZE)
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze every object still tracked (``gc.freeze``), unless
    :func:`freeze_enabled` says not to. Call it once, when the process has built what it keeps for its lifetime and
    before it serves. Returns the objects frozen (``gc.get_freeze_count()``; 0 when not frozen)."""
    if not freeze_enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
