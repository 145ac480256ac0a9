"""The materializer's Prometheus metrics (``/metrics``; names in docs/materializer.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """Prometheus metrics of one materializer (own registry: several apps may share a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.batches = Counter("kvflow_materializer_batches_total", "EventBatches applied", registry=r)
        self.events = Counter("kvflow_materializer_events_total", "Events applied", registry=r)
        self.block_events = Counter("kvflow_materializer_block_events_total", "block_events rows written",
                                    registry=r)
        self.duplicates = Counter("kvflow_materializer_duplicate_batches_total",
                                  "Redelivered batches recognized and skipped", registry=r)
        self.stale = Counter("kvflow_materializer_stale_replays_total", "Batches of older instances ignored",
                             registry=r)
        self.gaps = Counter("kvflow_materializer_gaps_total", "Gaps in event_id", registry=r)
        self.anomalies = Counter("kvflow_materializer_anomalies_total", "Events contradicting the stored state",
                                 registry=r)
        self.resyncs = Counter("kvflow_materializer_resync_requests_total", "Snapshots requested", registry=r)
        self.resync_repeats = Counter("kvflow_materializer_resync_repeats_total",
                                      "Snapshot requests repeated (the node stayed resyncing)", registry=r)
        self.goodbyes = Counter("kvflow_materializer_goodbyes_total", "Nodes gone by their stopping heartbeat",
                                registry=r)
        self.pruned = Counter("kvflow_materializer_nodes_pruned_total", "Rows of long-gone nodes deleted",
                              registry=r)
        self.dlq = Counter("kvflow_materializer_dlq_total", "Messages sent to the DLQ", ["reason"], registry=r)
        self.db_retries = Counter("kvflow_materializer_db_retries_total", "Transactions retried", registry=r)
        self.stats = Counter("kvflow_materializer_node_stats_total", "NodeStats applied", registry=r)
        self.freshness = Histogram(
            "kvflow_materializer_freshness_seconds", "From a node publishing a batch to its commit",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.txn_seconds = Histogram("kvflow_materializer_transaction_seconds", "Time of one apply transaction",
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.takes = Counter("kvflow_materializer_takes_total", "Takes written, by who planned them "
                             "(compiled: the hot path alone; parts: it and the reference planner; python)",
                             ["planner"], registry=r)
        self.stale_caches = Counter(
            "kvflow_materializer_stale_caches_total", "Takes planned from a cache the database had moved past "
            "(another worker wrote the nodes: a rebalance), replanned from the database", registry=r)
        self.revocations = Counter("kvflow_materializer_partitions_revoked_total",
                                   "Rebalances that took partitions from this worker (its cache dropped)", registry=r)
        self.last_commit = Gauge("kvflow_materializer_last_commit_timestamp_seconds", "Unix time of the last commit",
                                 registry=r)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
