"""The spoke's Prometheus metrics (one registry per service, so tests can run several)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from spokefs.spoke.jobsignal import JobSignal

if TYPE_CHECKING:  # for the types only: this module stays as light as prometheus_client
    from spokefs.cache.store import BlockStore
    from spokefs.spoke.fetchqueue import FetchQueue


class SpokeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("spokefs_cache_hits", "Blocks read from the cache", registry=r)
        self.misses = Counter("spokefs_cache_misses", "Blocks a reader needed that were not "
                              "resident", registry=r)
        self.upstream_bytes = Counter("spokefs_upstream_bytes", "Bytes fetched from upstream",
                                      ["reason"], registry=r)
        self.upstream_requests = Counter("spokefs_upstream_requests", "Requests to the "
                                         "upstream (a batch read carries many blocks)",
                                         ["kind"], registry=r)
        self.upstream_blocks = Counter("spokefs_upstream_blocks", "Blocks asked of the "
                                       "upstream", ["kind"], registry=r)
        self.upstream_errors = Counter("spokefs_upstream_errors", "Failed upstream requests",
                                       ["kind"], registry=r)
        self.fetch_seconds = Histogram(
            "spokefs_fetch_seconds", "Latency of one block fetch from upstream", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.evictions = Counter("spokefs_cache_evictions", "Blocks evicted", registry=r)
        self.integrity_failures = Counter("spokefs_integrity_failures", "Blocks whose bytes did "
                                          "not match their digest", ["where"], registry=r)
        self.write_errors = Counter("spokefs_cache_write_errors", "Blocks that could not be "
                                    "written to the cache", ["reason"], registry=r)
        self.stale_blocks = Counter("spokefs_cache_stale_blocks", "Blocks dropped because no "
                                    "snapshot in use holds their file version (changed or "
                                    "removed at the source; --stale-after)", registry=r)
        self.passthrough_bytes = Counter("spokefs_passthrough_bytes", "Bytes served without "
                                         "being cached (cache full of pins or unwritable)",
                                         registry=r)
        self.cache_bytes = Gauge("spokefs_cache_bytes", "Bytes of resident blocks", registry=r)
        self.cache_capacity = Gauge("spokefs_cache_capacity_bytes", "Cache capacity",
                                    registry=r)
        self.cache_writable = Gauge("spokefs_cache_writable", "1 when the cache accepts "
                                    "writes, 0 while it passes data through", registry=r)
        self.inflight = Gauge("spokefs_upstream_inflight", "Upstream requests in flight",
                              registry=r)
        self.short_circuit_bytes = Counter("spokefs_short_circuit_bytes", "Bytes mounts on "
                                           "this host read from the cache files directly",
                                           registry=r)
        self.task_failures = Counter("spokefs_task_failures", "Background tasks that failed "
                                     "(restarted where they must not stop)", ["task"],
                                     registry=r)
        self.prefetch_window = Gauge("spokefs_prefetch_window_bytes", "Prefetch bytes let out "
                                     "at once: about twice the link's measured bandwidth x "
                                     "round trip", registry=r)
        # Prefetch accuracy = this over spokefs_upstream_bytes_total{reason="prefetch"}.
        self.prefetch_used_bytes = Counter("spokefs_prefetch_used_bytes", "Prefetched bytes "
                                           "(planner or warm-up) a reader later read",
                                           registry=r)
        # Warm-up progress = done over asked, per dataset (done counts failed blocks too).
        self.warm_blocks = Counter("spokefs_warm_blocks", "Blocks warm-ups set out to fetch",
                                   ["dataset"], registry=r)
        self.warm_done_blocks = Counter("spokefs_warm_done_blocks", "Blocks of warm-ups "
                                        "whose fetch ended (resident, or failed)", ["dataset"],
                                        registry=r)

    def watch(self, store: BlockStore, queue: FetchQueue, prefetch_window: int) -> None:
        """Count the store's events and read its state, and the fetch queue's, at scrape
        time (``prefetch_window``: the window shown while pacing has not measured one)."""
        ev = store.events
        ev.on_evict = self.evictions.inc
        ev.on_corrupt = lambda: self.integrity_failures.labels("cache").inc()
        ev.on_write_error = lambda reason: self.write_errors.labels(reason).inc()
        ev.on_prefetch_used = self.prefetch_used_bytes.inc
        self.cache_capacity.set(store.capacity)
        self.cache_bytes.set_function(lambda: store.data_bytes)
        self.cache_writable.set_function(lambda: 1 if store.writable else 0)
        self.inflight.set_function(lambda: queue.active)
        self.prefetch_window.set_function(lambda: queue.prefetch_window or prefetch_window)


class JobMetrics:
    """Training jobs' step reports (``spoke.jobsignal``) as metrics, read at scrape time: a
    job the tracker dropped leaves ``/metrics`` with it (no label set grows without bound)."""

    def __init__(self, signal: JobSignal, clock: Callable[[], float] = time.monotonic) -> None:
        self.signal = signal
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        labels = ["dataset", "job"]
        steps = CounterMetricFamily("spokefs_job_steps", "Training steps jobs reported",
                                    labels=labels)
        wait = CounterMetricFamily("spokefs_job_data_wait_seconds", "Time jobs' steps waited "
                                   "for their data", labels=labels)
        busy = CounterMetricFamily("spokefs_job_step_seconds", "Time jobs spent on their steps "
                                   "once the data was there (compute)", labels=labels)
        util = GaugeMetricFamily("spokefs_job_utilisation_ratio", "1 - the share of the recent "
                                 "window's step time spent waiting for data", labels=labels)
        for js in self.signal.jobs(self.clock()):
            key = [js.dataset, js.job]
            steps.add_metric(key, js.steps)
            wait.add_metric(key, js.data_wait_s)
            busy.add_metric(key, js.step_s)
            share = js.recent_share()
            if share is not None:
                util.add_metric(key, 1.0 - share)
        yield from (steps, wait, busy, util)
