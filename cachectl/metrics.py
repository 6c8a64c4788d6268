"""Prometheus metrics of the node daemon, on a registry of its own (one per daemon).

Entry count and bytes are read from the store at scrape time, so they are never stale.
Called by the daemon's build coordinator and scrubber; served on /metrics and --metrics-port.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ditserve.cachectl.store import CacheStore


class _StoreCollector(Collector):
    def __init__(self, store: CacheStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        infos = self.store.list()
        yield GaugeMetricFamily("cachectl_entries", "Published cache entries",
                                value=len(infos))
        yield GaugeMetricFamily("cachectl_bytes", "Bytes on disk of published entries",
                                value=sum(i.bytes for i in infos))
        yield GaugeMetricFamily("cachectl_entries_in_use", "Entries a live process has leased",
                                value=sum(1 for i in infos if i.in_use))


class DaemonMetrics:
    def __init__(self, store: CacheStore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.builds = Counter("cachectl_builds", "Entry builds run by this daemon, by result",
                              ["result"], registry=r)
        self.ensure_requests = Counter("cachectl_ensure_requests",
                                       "Ensure requests, by how they were answered",
                                       ["outcome"], registry=r)
        self.build_seconds = Histogram("cachectl_build_seconds", "Wall time of entry builds",
                                       buckets=(1, 5, 15, 60, 180, 600, 1800, 3600), registry=r)
        self.verify_failures = Counter("cachectl_verify_failures",
                                       "Entries found corrupt by scrubs", registry=r)
        self.scrub_bytes = Counter("cachectl_scrub_bytes", "Bytes re-hashed by scrubs",
                                   registry=r)
        self.last_scrub = Gauge("cachectl_last_scrub_timestamp_seconds",
                                "Unix time the last scrub finished", registry=r)
        r.register(_StoreCollector(store))
