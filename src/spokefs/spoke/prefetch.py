"""Carrying out the planner's actions in the spoke (the I/O side of spokefs.planner).

The planner decides (sans-I/O); this driver feeds it events (reads, fetch completions,
announced orders, manifests, saved working sets) with the event loop's clock, and carries
out what comes back through ``spokefs.planner.interpreter`` (which ``bench policy`` runs
too). It knows the spoke only through what it is given:

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
from spokefs.planner.interpreter import Cache, Interpreter
from spokefs.policy import BlockKey
from spokefs.wire.backend import ReadContext

log = logging.getLogger(__name__)

_WS_PREFIX = "workingset:"
# Learned working sets kept on disk (job names are chosen by clients): past this many, the
# one saved longest ago is forgotten.
MAX_SAVED_WORKING_SETS = 256


class CacheFacts(Cache, Protocol):
    """What the driver needs of the cache: the interpreter's ``Cache`` (residency, pins,
    the policy's future) and small facts to persist."""

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
        self.latest_manifest = latest_manifest
        # The actions are carried out by the interpreter bench policy runs too; the spoke's
        # I/O goes in here: the fetch path, the event loop, the persisted working sets.
        self.interp = Interpreter(
            planner, cache, lambda ds, a: fetch(ds, a.key, a.priority), cancel,
            lambda callback: asyncio.get_running_loop().call_soon(callback),
            lambda: self.loop_time, self._persist,
        )  # fmt: skip
        self._snapshot: dict[str, str] = {}                  # dataset -> snapshot in planner
        self._by_version: dict[str, dict[str, int]] = {}     # dataset -> version -> index
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
        self.interp.handle(pl.ManifestAdded(m.dataset, pl.Manifest.of(m), self.loop_time),
                           m.dataset)

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
        self.interp.handle(pl.Read(dataset, path, version, size, start, end - start,
                                   reader_id=reader, job=job, now=self.loop_time), dataset)

    def heard(self, dataset: str, version: str, start: int, end: int, ctx: ReadContext) -> None:
        """A read served here or by another process on this host (``spoke.reads``,
        ``spoke.local``): the file is the context's, else looked up by version."""
        known = (ctx.path, ctx.size) if ctx.path is not None else self.path_of(dataset, version)
        if known is not None and known[1] is not None:
            self.on_read(dataset, known[0], version, known[1], start, end, ctx.reader, ctx.job)

    def fetch_finished(self, key: BlockKey, resident: bool) -> None:
        self.interp.finished(key, resident)

    def announce(self, dataset: str, job: str, epoch: int, files: Sequence[int] | Sequence[str],
                 ranges: Sequence[tuple[int, int]] | None) -> None:
        self.interp.handle(pl.OrderAnnounced(dataset, job, epoch, files, ranges,
                                             now=self.loop_time), dataset)

    def epoch(self, dataset: str, job: str, epoch: int) -> None:
        self.interp.handle(pl.EpochBoundary(dataset, job, epoch, self.loop_time), dataset)

    def job_ended(self, dataset: str, job: str) -> None:
        self.interp.handle(pl.JobEnded(dataset, job, self.loop_time), dataset)

    async def restore(self) -> None:
        """Start filling every working set learned by an earlier run of this spoke."""
        for key, raw in self.cache.kv_items(_WS_PREFIX):
            try:
                ws = pl.WorkingSet.from_json(json.loads(raw))
                m = await self.latest_manifest(ws.dataset)
                if m is None:
                    continue
                self.use_manifest(m)
                actions = self.planner.handle(pl.WorkingSetRestored(ws, self.loop_time))
            except Exception as exc:  # a stale set must not stop the spoke from starting
                log.warning("cannot restore learned working set %s: %s", key, exc)
                continue
            log.info("restoring learned working set of %s (job %r): %d files, %d bytes",
                     ws.dataset, ws.job, ws.files, ws.bytes)
            self.act(actions, ws.dataset)

    # -- actions out -------------------------------------------------------------------------
    def act(self, actions: Iterable[pl.Action], dataset: str | None) -> None:
        self.interp.act(actions, dataset)

    def _persist(self, a: pl.WorkingSetLearned) -> None:
        key = f"{_WS_PREFIX}{a.dataset}:{a.job}"
        self.cache.kv_set(key, json.dumps(a.working_set.to_json()))
        self._saved.pop(key, None)
        self._saved[key] = None
        while len(self._saved) > MAX_SAVED_WORKING_SETS:
            oldest = next(iter(self._saved))
            del self._saved[oldest]
            self.cache.kv_delete(oldest)

    def stats(self) -> dict[str, Any]:
        return {"inflight_bytes": self.planner.prefetch_inflight_bytes,
                "pinned_bytes": self.planner.pinned_bytes,
                **getattr(self.planner, "stats", {}),
                "working_sets": self.planner.jobs()}  # per (dataset, job), for `spokefs top`
