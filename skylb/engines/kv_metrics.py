"""Prometheus metrics of the KV-cache event streams and the block index, read from the index at scrape time.

Counters are totals since the balancer started (``rate()`` gives events/s); gauges are the index now. Names follow
the balancer's conventions (``skylb_`` prefix, base units, counters end in ``_total``, a ``region`` label).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from skylb.core.kv_index import BlockIndex

__all__ = ["KVIndexCollector"]

#: ReplicaEvents counter -> (metric name without _total, help, extra label value or None).
_COUNTERS = (
    ("batches", "skylb_kv_event_batches", "KV-cache event batches applied per replica (replayed ones included).",
     None),
    ("stored", "skylb_kv_events", "KV-cache events applied per replica, by kind.", "stored"),
    ("removed", "skylb_kv_events", None, "removed"),
    ("cleared", "skylb_kv_events", None, "cleared"),
    ("gaps", "skylb_kv_event_gaps", "Gaps in a replica's event sequence numbers (each one asked of its replay "
     "socket).", None),
    ("replayed", "skylb_kv_event_batches_replayed", "Event batches recovered from a replica's replay socket.", None),
    ("unfilled_gaps", "skylb_kv_event_gaps_unfilled", "Gaps the replay socket could not fill (the replica's blocks "
     "were dropped).", None),
    ("skipped_corrupt", "skylb_kv_events_skipped", "KV-cache events or messages skipped, by reason.", "corrupt"),
    ("skipped_unknown", "skylb_kv_events_skipped", None, "unknown"),
    ("drops", "skylb_kv_index_replica_drops", "Times a replica's blocks were dropped (stream lost, reconnect, "
     "restart, AllBlocksCleared, unfilled gap).", None),
)


class KVIndexCollector(Collector):
    """Collects the index's metrics; ``register(registry)`` adds it to a balancer's registry.

    Args:
        index: the block index; region: this balancer's region (the ``region`` label).
    """

    def __init__(self, index: BlockIndex, *, region: str):
        self.index = index
        self.region = region

    def register(self, registry: CollectorRegistry) -> None:
        """Add this collector to ``registry``."""
        registry.register(self)

    def collect(self):
        """The metric families, read from the index now."""
        region, index = self.region, self.index
        families: dict[str, CounterMetricFamily] = {}
        for attr, name, help_text, kind in _COUNTERS:
            family = families.get(name)
            if family is None:
                labels = ["region", "replica"] + (["kind" if name == "skylb_kv_events" else "reason"] if kind else [])
                family = families[name] = CounterMetricFamily(name, help_text, labels=labels)
            for replica, state in index.replicas.items():
                family.add_metric([region, replica] + ([kind] if kind else []), getattr(state, attr))
        yield from families.values()
        live = GaugeMetricFamily("skylb_kv_events_live", "1 while a replica's event stream is followed (exact "
                                 "matches), 0 when it is stale (the prefix trie is used).", labels=["region", "replica"])
        held = GaugeMetricFamily("skylb_kv_index_replica_blocks", "Blocks the index holds per replica.",
                                 labels=["region", "replica"])
        for replica, state in index.replicas.items():
            live.add_metric([region, replica], 1 if state.live else 0)
            held.add_metric([region, replica], index.replica_blocks(replica))
        yield live
        yield held
        size = GaugeMetricFamily("skylb_kv_index_blocks", "Blocks in the index (distinct block hashes).",
                                 labels=["region"])
        size.add_metric([region], len(index))
        yield size
        bound = GaugeMetricFamily("skylb_kv_index_max_blocks", "The index's bound, in blocks.", labels=["region"])
        bound.add_metric([region], index.max_blocks)
        yield bound
        evicted = CounterMetricFamily("skylb_kv_index_evicted_blocks", "Blocks the index forgot to stay within "
                                      "its bound.", labels=["region"])
        evicted.add_metric([region], index.evicted)
        yield evicted
