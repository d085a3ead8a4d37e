"""Warm-ups, their pins, and what the spoke holds (residency, inventory).

A warm-up fetches every block of the files it names in the background, behind readers'
demand and the planner's prefetches, a bounded window of fetches at a time; pinned, its
blocks are not evicted for ``pin_ttl`` (renewed by warming again), and warm-ups may pin at
most ``pin_share`` of the cache (a cache that can evict nothing serves every other read by
pass-through). Residency counts what is held: the cache and, in a tier, the blocks other
members were seen to hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from spokefs.cache.store import BlockStore
from spokefs.errors import BadRequest, SpokeError
from spokefs.integrity import block_count
from spokefs.manifest import Manifest
from spokefs.policy import BlockKey
from spokefs.spoke.fetcher import Block, Fetcher
from spokefs.spoke.metadata import Metadata
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.reads import WARM
from spokefs.tasks import Tasks

log = logging.getLogger(__name__)


class Held:
    """Blocks the spoke holds: its cache, and in a tier the blocks other members delivered
    (held in memory a while, and by their owner): what the planner need not fetch again
    and what residency counts."""

    def __init__(self, store: BlockStore, fetcher: Fetcher) -> None:
        self.store = store
        self.fetcher = fetcher

    def __contains__(self, key: object) -> bool:
        if key in self.store:
            return True
        tier = self.fetcher.tier
        return tier is not None and (key in self.fetcher.borrowed or key in tier.delivered)


class Warmups:
    """Warm-ups and their pins (key -> (bytes, when the pin lapses)); ``key in warmups``:
    the block is pinned by one."""

    RESIDENCY_SLICE = 20_000  # files looked at between turns of the event loop

    def __init__(self, store: BlockStore, fetcher: Fetcher, held: Held, metadata: Metadata,
                 tasks: Tasks, metrics: SpokeMetrics, *, pin_ttl: float, pin_share: float,
                 max_inflight: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.fetcher = fetcher
        self.held = held
        self.metadata = metadata
        self.tasks = tasks
        self.metrics = metrics
        self.pin_ttl = pin_ttl
        self.pin_share = pin_share
        self.max_inflight = max_inflight
        self.clock = clock
        self._pins: dict[BlockKey, tuple[int, float]] = {}
        self.pinned_bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._pins

    def warm(self, m: Manifest, files: list[int], pin: bool = False) -> dict[str, int]:
        """Fetch every block of ``files`` in the background (behind demand reads), optionally
        pinned; returns what it will fetch. Progress: ``residency``."""
        bs = m.block_size
        keys = [(m.versions[i], b) for i in files for b in range(block_count(m.sizes[i], bs))]
        if pin:
            self.pin(m, files)
        todo = [k for k in keys if k not in self.store]
        self.tasks.spawn(self._warm(m.dataset, todo), "warm")
        return {"files": len(files), "blocks": len(keys), "bytes": sum(m.sizes[i] for i in files),
                "blocks_to_fetch": len(todo)}

    @staticmethod
    def _file_blocks(m: Manifest, files: list[int]) -> list[tuple[BlockKey, int]]:
        bs = m.block_size
        return [((m.versions[i], b), min(bs, m.sizes[i] - b * bs)) for i in files
                for b in range(block_count(m.sizes[i], bs))]

    def pin(self, m: Manifest, files: list[int]) -> None:
        """Pin the blocks of ``files`` for ``pin_ttl`` (again: the pin is renewed). Refused,
        with nothing pinned, if warm-ups would then hold more than ``pin_share`` of the
        cache: a cache that can evict nothing serves every other read by pass-through."""
        blocks = self._file_blocks(m, files)
        new = sum(size for key, size in dict(blocks).items() if key not in self._pins)
        limit = int(self.pin_share * self.store.capacity)
        if self.pinned_bytes + new > limit:
            raise BadRequest(
                f"pinning these files would hold {self.pinned_bytes + new} bytes of a "
                f"{self.store.capacity}-byte cache; warm-ups may pin at most {limit} "
                "(unpin others, or warm without pinning)")
        until = self.clock() + self.pin_ttl
        for key, size in blocks:
            if key not in self._pins:
                self.store.pin(key)
                self.pinned_bytes += size
            self._pins[key] = (size, until)

    def unpin(self, m: Manifest, files: list[int]) -> dict[str, int]:
        """Release warm-up pins of ``files`` (the blocks stay cached, now evictable)."""
        released = 0
        for key, _ in self._file_blocks(m, files):
            held = self._pins.pop(key, None)
            if held is not None:
                self.store.unpin(key)
                self.pinned_bytes -= held[0]
                released += 1
        return {"blocks_unpinned": released, "warm_pinned_bytes": self.pinned_bytes}

    def expire(self) -> None:
        """Release the pins whose ``pin_ttl`` lapsed (the housekeeping's, every few seconds)."""
        now = self.clock()
        lapsed = [k for k, (_, until) in self._pins.items() if until <= now]
        for key in lapsed:
            size, _ = self._pins.pop(key)
            self.store.unpin(key)
            self.pinned_bytes -= size
        if lapsed:
            log.info("warm-up pins lapsed on %d blocks (--pin-ttl)", len(lapsed))

    async def _warm(self, name: str, keys: list[BlockKey]) -> None:
        # A bounded window of fetches queued at a time: a million blocks is not a million
        # futures; enough that batches stay full.
        window = asyncio.Semaphore(max(1024, 4 * self.max_inflight))
        failed = pending = 0
        began, ended = time.monotonic(), asyncio.Event()
        asked = self.metrics.warm_blocks.labels(name)  # progress: done over asked
        progress = self.metrics.warm_done_blocks.labels(name)
        asked.inc(len(keys))

        def done(fut: asyncio.Future[Block]) -> None:
            nonlocal failed, pending
            window.release()
            progress.inc()
            pending -= 1
            if pending == 0:
                ended.set()
            if not fut.cancelled() and fut.exception() is not None:
                failed += 1
                if failed <= 3:
                    log.warning("warm: a block of %s was not fetched: %s", name,
                                fut.exception())

        for key in keys:
            await window.acquire()
            if key in self.store:
                window.release()
                progress.inc()
                continue
            pending += 1
            ended.clear()
            self.fetcher.want(name, key, WARM).add_done_callback(done)
        if pending:
            await ended.wait()
        took = time.monotonic() - began
        fields = {"event": "warmup_done", "dataset": name, "blocks": len(keys),
                  "failed_blocks": failed, "seconds": round(took, 3)}
        if failed:
            log.warning("warm-up of %s ended: %d of %d blocks were not fetched (%.1f s)",
                        name, failed, len(keys), took, extra=fields)
        else:
            log.info("warm-up of %s done: %d blocks in %.1f s", name, len(keys), took,
                     extra=fields)

    # -- what is held ------------------------------------------------------------------------
    async def residency(self, m: Manifest, files: list[int]) -> dict[str, object]:
        """How much of ``files`` is cached. A million files take ~0.5 s to look at: done in
        slices, letting other requests run between them (the index is the loop's to read)."""
        bs = m.block_size
        total = resident = full = 0
        held = self.held  # in a tier, blocks other members were seen to hold count too
        for n, i in enumerate(files):
            if n and n % self.RESIDENCY_SLICE == 0:
                await asyncio.sleep(0)
            size = m.sizes[i]
            total += size
            v = m.versions[i]
            have = sum(min(bs, size - b * bs) for b in range(block_count(size, bs))
                       if (v, b) in held)
            resident += have
            full += have == size
        return {"files": len(files), "bytes": total, "resident_bytes": resident,
                "resident_files": full, "fraction": resident / total if total else 1.0}

    async def inventory(self) -> list[dict[str, object]]:
        """What this spoke holds, per dataset and per snapshot it keeps a manifest of:
        resident files and bytes, and the least and most recent use of its blocks."""
        counts = self.store.by_dataset()
        times = await asyncio.to_thread(self.store.use_times)
        md = self.metadata
        out: list[dict[str, object]] = []
        for ds in sorted(set(counts) | md.kept_datasets()):
            blocks, nbytes = counts.get(ds, [0, 0])
            used = times.get(ds)
            snaps = []
            for snap in md.kept_snapshots(ds):
                try:
                    m = await md.manifest(ds, snap)
                except SpokeError as exc:  # a manifest it can no longer use: say so
                    snaps.append({"snapshot": snap, "error": str(exc)})
                    continue
                r = await self.residency(m, list(range(len(m))))
                snaps.append({"snapshot": snap, "files": r["files"], "bytes": r["bytes"],
                              "resident_files": r["resident_files"],
                              "resident_bytes": r["resident_bytes"]})
            out.append({"dataset": ds, "blocks": blocks, "bytes": nbytes,
                        "least_recent_use": used[0] if used else None,
                        "most_recent_use": used[1] if used else None, "snapshots": snaps})
        return out
