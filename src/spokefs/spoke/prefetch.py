"""Carrying out the planner's actions in the spoke (the I/O side of spokefs.planner).

The planner decides (sans-I/O); this driver feeds it events (reads, fetch completions,
announced orders) with the event loop's clock and executes what comes back. It knows the
spoke only through what it is given:

- ``fetch(dataset, key, priority)`` / ``cancel(key)``: the spoke's single-flight fetch path
  (a cancelled or failed fetch comes back as ``fetch_finished(key, False)``);
- ``cache``: residency, pins, the eviction policy's announced future, small facts to persist
  (``CacheFacts``, which ``BlockStore`` is);
- ``latest_manifest(dataset)``: to restore learned working sets at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from spokefs import planner as pl
from spokefs.manifest import Manifest
from spokefs.policy import BlockKey

log = logging.getLogger(__name__)

_WS_PREFIX = "workingset:"
# Learned working sets kept on disk (job names are chosen by clients): past this many, the
# one saved longest ago is forgotten.
MAX_SAVED_WORKING_SETS = 256


class CacheFacts(Protocol):
    def __contains__(self, key: object) -> bool: ...
    def pin(self, key: BlockKey) -> None: ...
    def unpin(self, key: BlockKey) -> None: ...
    def set_future(self, keys: Sequence[BlockKey], stream: str, append: bool = False
                   ) -> None: ...
    def kv_set(self, key: str, value: str) -> None: ...
    def kv_delete(self, key: str) -> None: ...
    def kv_items(self, prefix: str) -> list[tuple[str, str]]: ...


class PrefetchDriver:
    def __init__(self, planner: pl.Planner, cache: CacheFacts,
                 fetch: Callable[[str, BlockKey, int], None],
                 cancel: Callable[[BlockKey], bool],
                 latest_manifest: Callable[[str], Awaitable[Manifest | None]]) -> None:
        self.planner = planner
        self.cache = cache
        self.fetch = fetch
        self.cancel = cancel
        self.latest_manifest = latest_manifest
        self._snapshot: dict[str, str] = {}                  # dataset -> snapshot in planner
        self._by_version: dict[str, dict[str, int]] = {}     # dataset -> version -> index
        self._key_dataset: dict[BlockKey, str] = {}          # planner fetches in flight
        self._later: list[tuple[pl.Event, str | None]] = []
        # Saved working sets, oldest first (those of an earlier run first, in key order).
        self._saved: dict[str, None] = dict.fromkeys(k for k, _ in cache.kv_items(_WS_PREFIX))

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
        ds = self._key_dataset.pop(key, None)
        if ds is None:
            return  # a fetch the planner did not ask for
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
        for key, raw in self.cache.kv_items(_WS_PREFIX):
            try:
                ws = json.loads(raw)
                m = await self.latest_manifest(ws["dataset"])
                if m is None:
                    continue
                self.use_manifest(m)
                actions = self.planner.restore_working_set(ws)
            except Exception as exc:  # a stale set must not stop the spoke from starting
                log.warning("cannot restore learned working set %s: %s", key, exc)
                continue
            log.info("restoring learned working set of %s (job %r): %d files, %d bytes",
                     ws["dataset"], ws.get("job", ""), ws.get("files", 0), ws.get("bytes", 0))
            self.act(actions, ws["dataset"])

    # -- actions out -------------------------------------------------------------------------
    def act(self, actions: Iterable[pl.Action], dataset: str | None) -> None:
        cache = self.cache
        for a in actions:
            if isinstance(a, pl.Fetch):
                ds = dataset or self._key_dataset.get(a.key)
                if ds is None:
                    self._answer(pl.FetchFailed(a.key), None)
                    continue
                if a.key in cache:
                    self._answer(pl.FetchDone(a.key), ds)
                    continue
                self._key_dataset[a.key] = ds
                self.fetch(ds, a.key, a.priority)
            elif isinstance(a, pl.Cancel):
                self.cancel(a.key)
            elif isinstance(a, pl.Pin):
                cache.pin(a.key)
            elif isinstance(a, pl.Unpin):
                cache.unpin(a.key)
            elif isinstance(a, pl.SetFuture):
                cache.set_future(a.keys, a.stream, a.append)  # a stream per job
            elif isinstance(a, pl.WorkingSetLearned):
                key = f"{_WS_PREFIX}{a.dataset}:{a.job}"
                cache.kv_set(key, json.dumps(a.working_set.to_json()))
                self._saved.pop(key, None)
                self._saved[key] = None
                while len(self._saved) > MAX_SAVED_WORKING_SETS:
                    oldest = next(iter(self._saved))
                    del self._saved[oldest]
                    cache.kv_delete(oldest)

    def _answer(self, event: pl.Event, dataset: str | None) -> None:
        # Answered on the next loop turn, never re-entering the planner from inside handle():
        # queued, and delivered by one callback however many there are.
        if not self._later:
            asyncio.get_running_loop().call_soon(self._deliver)
        self._later.append((event, dataset))

    def _deliver(self) -> None:
        later, self._later = self._later, []
        for event, dataset in later:
            self.act(self.planner.handle(event), dataset)

    def stats(self) -> dict[str, Any]:
        return {"inflight_bytes": self.planner.prefetch_inflight_bytes,
                "pinned_bytes": self.planner.pinned_bytes,
                **getattr(self.planner, "stats", {}),
                "working_sets": self.planner.jobs()}  # per (dataset, job), for `spokefs top`
