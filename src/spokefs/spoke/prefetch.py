"""Carrying out the planner's actions in the spoke (the I/O side of spokefs.planner).

The planner decides (sans-I/O); this driver feeds it events from the service (reads, fetch
completions, announced orders) with the event loop's clock and executes what comes back:
fetches through the service's single-flight, priority-limited fetch path, cancels of queued
prefetches, pins on the eviction policy, the announced future for ``belady``, and persisting
learned working sets so the next run of a job starts filling before its first read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from spokefs import planner as pl
from spokefs.manifest import Manifest
from spokefs.policy import BlockKey

if TYPE_CHECKING:
    from spokefs.spoke.service import SpokeBackend

log = logging.getLogger(__name__)

_WS_PREFIX = "workingset:"


class PrefetchDriver:
    def __init__(self, backend: SpokeBackend, planner: pl.Planner) -> None:
        self.backend = backend
        self.planner = planner
        self._snapshot: dict[str, str] = {}                  # dataset -> snapshot in planner
        self._by_version: dict[str, dict[str, int]] = {}     # dataset -> version -> index
        self._key_dataset: dict[BlockKey, str] = {}          # planner fetches in flight

    @property
    def loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    # -- manifests ---------------------------------------------------------------------------
    def use_manifest(self, m: Manifest) -> None:
        """Tell the planner which snapshot a dataset's reads come from (newest seen wins)."""
        if self._snapshot.get(m.dataset) == m.snapshot:
            return
        self._snapshot[m.dataset] = m.snapshot
        self._by_version.pop(m.dataset, None)
        self.planner.add_manifest(m.dataset, pl.Manifest(m.paths, m.versions, m.sizes,
                                                         m.block_size))

    def path_of(self, dataset: str, version: str) -> tuple[str, int] | None:
        """(path, size) of a version in the dataset's current manifest (for reads by id)."""
        pm = self.planner.manifest(dataset)
        if pm is None:
            return None
        index = self._by_version.get(dataset)
        if index is None:  # built once per snapshot, on the first read by version id
            index = self._by_version[dataset] = {v: i for i, v in enumerate(pm.versions)}
        i = index.get(version)
        return None if i is None else (pm.paths[i], pm.sizes[i])

    # -- events in ---------------------------------------------------------------------------
    def on_read(self, dataset: str, path: str, version: str, size: int, start: int, end: int,
                reader: str, job: str) -> None:
        ev = pl.Read(dataset, path, version, size, start, end - start, reader_id=reader,
                     job=job, now=self.loop_time)
        self.act(self.planner.handle(ev), dataset)

    def fetch_finished(self, key: BlockKey, resident: bool) -> None:
        if key not in self._key_dataset:
            return  # a fetch the planner did not ask for
        ds = self._key_dataset.pop(key)
        now = self.loop_time
        ev = pl.FetchDone(key, now) if resident else pl.FetchFailed(key, now)
        self.act(self.planner.handle(ev), ds)

    def announce(self, dataset: str, job: str, epoch: int, files: Sequence[int] | Sequence[str],
                 ranges: Sequence[tuple[int, int]] | None) -> None:
        ev = pl.OrderAnnounced(dataset, job, epoch, files, ranges, now=self.loop_time)
        self.act(self.planner.handle(ev), dataset)

    def epoch(self, dataset: str, job: str, epoch: int) -> None:
        self.act(self.planner.handle(pl.EpochBoundary(dataset, job, epoch, self.loop_time)),
                 dataset)

    def job_ended(self, dataset: str, job: str) -> None:
        self.act(self.planner.handle(pl.JobEnded(dataset, job, self.loop_time)), dataset)

    async def restore(self) -> None:
        """Start filling every working set learned by an earlier run of this spoke."""
        for key, raw in self.backend.store.kv_items(_WS_PREFIX):
            ws = json.loads(raw)
            try:
                info = await self.backend.dataset(ws["dataset"])
                if info.latest is None:
                    continue
                self.use_manifest(await self.backend.manifest(ws["dataset"], info.latest))
                actions = self.planner.restore_working_set(ws)
            except Exception as exc:  # a stale set must not stop the spoke from starting
                log.warning("cannot restore learned working set %s: %s", key, exc)
                continue
            log.info("restoring learned working set of %s (job %r): %d files, %d bytes",
                     ws["dataset"], ws.get("job", ""), ws.get("files", 0), ws.get("bytes", 0))
            self.act(actions, ws["dataset"])

    # -- actions out -------------------------------------------------------------------------
    def act(self, actions: Iterable[pl.Action], dataset: str | None) -> None:
        policy: Any = self.backend.store.policy
        for a in actions:
            if isinstance(a, pl.Fetch):
                ds = dataset or self._key_dataset.get(a.key)
                if ds is None:
                    self._later(pl.FetchFailed(a.key), None)
                    continue
                if a.key in self.backend.store:
                    self._later(pl.FetchDone(a.key), ds)
                    continue
                self._key_dataset[a.key] = ds
                self.backend.start_prefetch(ds, a.key, a.priority)
            elif isinstance(a, pl.Cancel):
                self.backend.cancel_prefetch(a.key)
            elif isinstance(a, pl.Pin):
                self.backend.store.pin(a.key)
            elif isinstance(a, pl.Unpin):
                self.backend.store.unpin(a.key)
            elif isinstance(a, pl.SetFuture):
                fn = getattr(policy, "extend_future" if a.append else "set_future", None)
                if fn is not None:
                    with self.backend.store.lock:
                        fn(a.keys, a.stream)  # one stream per job: jobs don't overwrite
            elif isinstance(a, pl.WorkingSetLearned):
                self.backend.store.kv_set(f"{_WS_PREFIX}{a.dataset}:{a.job}",
                                          json.dumps(a.working_set.to_json()))

    def _later(self, event: pl.Event, dataset: str | None) -> None:
        # Answer on the next loop turn, never re-entering the planner from inside handle().
        def deliver() -> None:
            self.act(self.planner.handle(event), dataset)

        asyncio.get_running_loop().call_soon(deliver)

    def stats(self) -> dict[str, Any]:
        return {"inflight_bytes": self.planner.prefetch_inflight_bytes,
                "pinned_bytes": self.planner.pinned_bytes,
                **getattr(self.planner, "stats", {})}
