"""Reserved shares of the spoke's cache (``min_share`` in ``--dataset-config``), in force.

The rules say each dataset's reserved share and ceiling; this puts ``spokefs.policy.shares``'s
``Shares`` around the store's eviction policy while any dataset has a reservation (inside
``CopiesFirst`` on a tier member: copies still leave first) and takes it off when the last one
goes, so a spoke without reservations keeps its plain policy and pays nothing on a hit. It is
told of every change of the rules (start, file change, SIGHUP) and shows the shares in
``/v1/status`` (``datasets.shares``: rows with a ``dataset``, so a token sees only its own)
and in ``/metrics`` (``spokefs_dataset_*{dataset}``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from spokefs.cache.store import BlockStore
from spokefs.policy import BlockKey, CopiesFirst, EvictionPolicy, Share, Shares
from spokefs.spoke.datasets import DatasetConfig
from spokefs.units import format_size

log = logging.getLogger(__name__)


class FairShares:
    """The reserved shares of ``store``'s capacity that ``rules`` set; ``clock``: for "in use"
    (seconds, monotonic)."""

    def __init__(self, store: BlockStore, rules: DatasetConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rules = rules
        self.clock = clock
        self.shares: Shares | None = None  # in the store's policy while any is reserved
        rules.on_change.append(self.apply)
        self.apply()

    def _dataset_of(self, key: BlockKey) -> str:
        loc = self.store.get(key)  # indexed before the policy hears of it
        return loc.dataset if loc is not None else ""

    def wanted(self) -> dict[str, Share]:
        """Each reserved dataset's share in bytes, from the rules in force."""
        cap = self.store.capacity
        return {ds: Share(min_bytes=int(r.min_share * cap),
                          max_bytes=int(r.max_share * cap) if r.max_share else None,
                          idle_s=r.idle_after)
                for ds, r in self.rules.rules.items() if r.min_share}

    def apply(self) -> None:
        """Bring the store's policy in line with the rules (O(1) unless a reservation was
        removed: its blocks go back to the shared order)."""
        wanted = self.wanted()
        store = self.store
        host = store.policy if isinstance(store.policy, CopiesFirst) else None
        if wanted and self.shares is None:
            inner = host.owned if host is not None else store.policy
            self.shares = Shares(inner, dataset_of=self._dataset_of, clock=self.clock,
                                 resident=lambda ds: store.dataset_bytes.get(ds, 0))
            self._set(host, self.shares)
        if self.shares is None:
            return
        self.shares.configure(wanted)
        if not wanted:
            self._set(host, self.shares.unwrap())
            self.shares = None
            log.info("fair shares: no dataset reserves a share; one eviction order again")
            return
        log.info("fair shares: reserved %s", ", ".join(
            f"{ds} {format_size(s.min_bytes)}" for ds, s in sorted(wanted.items())))

    def _set(self, host: CopiesFirst | None, policy: EvictionPolicy) -> None:
        if host is not None:
            host.owned = policy
        else:
            self.store.policy = policy

    # -- shown ---------------------------------------------------------------------------------
    def rows(self) -> list[ShareRow]:
        """Each dataset resident or with a share (see ``ShareRow``)."""
        cap = self.store.capacity
        held = self.store.dataset_bytes
        now = self.clock()
        names = set(held) | {ds for ds, r in self.rules.rules.items()
                             if r.min_share or r.max_share}
        out = []
        for ds in sorted(names):
            r = self.rules.get(ds)
            resident = held.get(ds, 0)
            lo = int(r.min_share * cap) if r.min_share else 0
            hi = int(r.max_share * cap) if r.max_share else None
            last = self.shares.last_use(ds) if self.shares is not None else None
            out.append(ShareRow(
                ds, resident, r.min_share, r.max_share, lo, hi,
                self.shares.in_use(ds, now) if self.shares is not None else None,
                round(now - last, 1) if last is not None else None,
                r.idle_after if r.min_share else None,
                "over_max" if hi is not None and resident > hi
                else "over" if resident > lo else "under"))
        return out

    def status(self) -> list[dict[str, object]]:
        return [asdict(row) for row in self.rows()]

    def collect(self) -> Iterator[Metric]:
        """At scrape time: a dataset that left the cache and the rules leaves the metrics."""
        labels = ["dataset"]
        resident = GaugeMetricFamily("spokefs_dataset_resident_bytes", "Bytes of a dataset's "
                                     "blocks resident in the cache", labels=labels)
        reserved = GaugeMetricFamily("spokefs_dataset_reserved_bytes", "A dataset's reserved "
                                     "share of the cache (min_share), never evicted for other "
                                     "datasets' blocks while it is in use", labels=labels)
        ceiling = GaugeMetricFamily("spokefs_dataset_ceiling_bytes", "A dataset's ceiling "
                                    "(max_share): past it, its blocks pass through",
                                    labels=labels)
        in_use = GaugeMetricFamily("spokefs_dataset_in_use", "1 while a dataset with a "
                                   "reserved share was read within its idle_after, else 0 "
                                   "(its reservation is not held)", labels=labels)
        for row in self.rows():
            key = [row.dataset]
            resident.add_metric(key, row.resident_bytes)
            if row.min_bytes:
                reserved.add_metric(key, row.min_bytes)
            if row.max_bytes is not None:
                ceiling.add_metric(key, row.max_bytes)
            if row.in_use is not None:
                in_use.add_metric(key, 1.0 if row.in_use else 0.0)
        yield from (resident, reserved, ceiling, in_use)


@dataclass(frozen=True)
class ShareRow:
    """One dataset's share: what it holds, its reservation and ceiling (shares of the
    capacity and bytes), whether it is in use (reserved datasets only), and whether it holds
    more than its reservation (``over``: what eviction takes from first), not more
    (``under``), or more than its ceiling (``over_max``)."""

    dataset: str
    resident_bytes: int
    min_share: float | None
    max_share: float | None
    min_bytes: int
    max_bytes: int | None
    in_use: bool | None
    idle_s: float | None        # since its last read (reserved datasets)
    idle_after_s: float | None  # its reservation lapses after this long without a read
    share: str
