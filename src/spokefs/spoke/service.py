"""The spoke: a read-through block cache in front of an upstream (a hub or another spoke).

A read of [start, end) of a file version becomes block reads. A resident block is checked
against its digest and sent from disk with sendfile. A missing block is fetched from upstream
(one request per block, many in flight, demand before prefetch), checked against the digest
the upstream sent, persisted, and handed to every reader waiting for it: concurrent readers of
one missing block share one fetch. Blocks are keyed by (version, index), so a new version of a
file never mixes with an old one.

When the upstream is unreachable, cached data is still served; an uncached read retries with
backoff and, after ``deadline`` seconds, fails with UpstreamUnavailable (HTTP 503).
Metadata (dataset info, manifests) is kept on disk, so a restarted spoke serves what it has
even while the upstream is down.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from spokefs.cache.store import BlockStore
from spokefs.errors import (
    BadRequest,
    IntegrityError,
    NotFound,
    UpstreamUnavailable,
)
from spokefs.integrity import DEFAULT_BLOCK_SIZE, block_count, block_digest, blocks_in_range
from spokefs.linkmodel import LinkModel
from spokefs.manifest import Manifest
from spokefs.planner import Planner
from spokefs.policy import POLICIES, BlockKey, EvictionPolicy, make_policy
from spokefs.retry import backoff_delays
from spokefs.spoke.limiter import Grant, PriorityLimiter, Ticket
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.prefetch import PrefetchDriver
from spokefs.wire.backend import DatasetInfo, FileSegment, ManifestMemo, ReadContext, Segment
from spokefs.wire.client import Block, Transient, UpstreamClient
from spokefs.wire.looplag import LoopLag

log = logging.getLogger(__name__)

DEMAND = 0  # priority of a block a reader is waiting for
WARM = 1 << 20  # operator warm-up: behind demand and the planner's prefetches


@dataclass
class SpokeConfig:
    upstream: str
    cache_dir: Path
    cache_size: int
    policy: str = "belady"         # announced futures when given, LRU otherwise
    deadline: float = 30.0          # give up on an uncached read after this long
    max_inflight: int = 64          # upstream requests in flight (fill a long link)
    fsync: bool = True
    latest_ttl: float = 10.0        # how long "latest" is trusted before asking upstream
    prefetch: bool = True           # run the planner (readahead, learned working sets, orders)
    prefetch_inflight: int = 256 << 20   # most prefetch bytes outstanding
    pacing: bool = True             # measure the link; keep ~2x bandwidth x RTT of prefetch out
    readahead_max: int = 64 << 20   # largest sequential readahead window per stream


class SpokeBackend:
    role = "spoke"

    def __init__(self, config: SpokeConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = SpokeMetrics(self.registry)
        self.store = BlockStore(config.cache_dir, config.cache_size,
                                _policy(config.policy, config.cache_size), fsync=config.fsync)
        # A connection silent for the deadline is dead (a stalled link would otherwise hold
        # an upstream slot for the client's 60 s read timeout).
        self.upstream = UpstreamClient(config.upstream, max_connections=config.max_inflight,
                                       request_timeout=config.deadline)
        # What the link needs in flight, measured; prefetch beyond it would only slow readers.
        self.link = LinkModel(max_window=config.prefetch_inflight) if config.pacing else None
        self.limiter = PriorityLimiter(config.max_inflight, prefetch_window=(
            self.link.window() if self.link is not None else None))
        self._inflight: dict[BlockKey, asyncio.Future[Block]] = {}
        self._tickets: dict[BlockKey, Ticket] = {}
        self.prefetch: PrefetchDriver | None = None  # set by start() unless disabled
        self._digests: OrderedDict[BlockKey, bytes] = OrderedDict()  # of passed-through blocks
        self._datasets: dict[str, tuple[float, DatasetInfo]] = {}
        self._manifests = ManifestMemo()
        # One upstream fetch of a manifest however many ask at once, and one decode for the
        # planner per client that fetched it (see manifest_blob).
        self._blob_loads: dict[tuple[str, str], asyncio.Task[bytes]] = {}
        self._telling: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sizes: dict[str, int] = {}  # version -> size, in front of the index
        self._just_fetched: set[BlockKey] = set()  # fetched by object_size for a waiting read
        self._last_upstream_error: str | None = None
        self.started = time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.store.open)
        ev = self.store.events
        ev.on_evict = self.metrics.evictions.inc
        ev.on_corrupt = lambda: self.metrics.integrity_failures.labels("cache").inc()
        ev.on_write_error = lambda reason: self.metrics.write_errors.labels(reason).inc()
        self.metrics.cache_capacity.set(self.store.capacity)
        self.metrics.cache_bytes.set_function(lambda: self.store.used)
        self.metrics.cache_writable.set_function(lambda: 1 if self.store.writable else 0)
        self.metrics.inflight.set_function(lambda: self.limiter.active)
        self.metrics.prefetch_window.set_function(
            lambda: self.limiter.prefetch_window or self.config.prefetch_inflight)
        self.spawn(self._housekeeping())
        self.spawn(LoopLag(self.registry).run())
        if self.config.prefetch:
            planner = Planner(capacity=self.store.capacity,
                              max_inflight_bytes=self.config.prefetch_inflight,
                              readahead_max_bytes=self.config.readahead_max,
                              resident=self.store)
            self.prefetch = PrefetchDriver(self, planner)
            self.spawn(self.prefetch.restore())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.upstream.close()
        await asyncio.to_thread(self.store.close)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Every background task is owned here and cancelled and awaited on close."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            await asyncio.to_thread(self.store.flush_access_times)
            self.store.retry_writable()

    # -- metadata ----------------------------------------------------------------------------
    async def _retrying(self, what: str, fn: Any, *args: Any) -> Any:
        """Call an upstream coroutine, retrying transient failures with backoff until the
        deadline; then UpstreamUnavailable naming the upstream and the cause."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.deadline
        for delay in backoff_delays():
            try:
                result = await fn(*args)
                self._last_upstream_error = None
                return result
            except Transient as exc:
                self.metrics.upstream_errors.labels("transient").inc()
                self._last_upstream_error = str(exc)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise UpstreamUnavailable(
                        f"upstream {self.config.upstream} unreachable for "
                        f"{self.config.deadline:g}s while fetching {what}: {exc}",
                        self.config.upstream, str(exc)) from exc
                await asyncio.sleep(min(delay, remaining))  # one last try at the deadline
        raise AssertionError("unreachable")

    async def dataset(self, name: str) -> DatasetInfo:
        now = time.monotonic()
        cached = self._datasets.get(name)
        if cached is not None and now - cached[0] < self.config.latest_ttl:
            return cached[1]
        try:
            doc = await self.upstream.get_json(f"/v1/datasets/{name}")
        except Transient as exc:
            # Upstream down: keep serving with what we knew (memory, then disk).
            stale = cached[1] if cached else self._persisted_dataset(name)
            if stale is not None:
                log.warning("upstream down (%s); using the last known state of %r", exc, name)
                return stale
            raise UpstreamUnavailable(
                f"upstream {self.config.upstream} is unreachable and dataset {name!r} was "
                f"never seen by this spoke: {exc}", self.config.upstream, str(exc)) from exc
        info = DatasetInfo(doc["name"], int(doc.get("block_size", DEFAULT_BLOCK_SIZE)),
                           doc.get("latest"), list(doc.get("snapshots", [])))
        self._datasets[name] = (now, info)
        self.store.kv_set(f"dataset:{name}", json.dumps(info.to_json()))
        return info

    def _persisted_dataset(self, name: str) -> DatasetInfo | None:
        raw = self.store.kv_get(f"dataset:{name}")
        if raw is None:
            return None
        d = json.loads(raw)
        return DatasetInfo(d["name"], d["block_size"], d["latest"], d["snapshots"])

    async def datasets(self) -> list[DatasetInfo]:
        doc = await self._retrying("the dataset list", self.upstream.get_json, "/v1/datasets")
        return [await self.dataset(d["name"]) for d in doc["datasets"]]

    async def resolve(self, name: str, snap: str) -> str:
        info = await self.dataset(name)
        if snap == "latest":
            if info.latest is None:
                raise NotFound(f"dataset {name!r} has no snapshot yet")
            return info.latest
        if any(s.get("id") == snap for s in info.snapshots) or self._manifest_file(
                name, snap).exists():
            return snap
        # Maybe newer than our cached dataset info: ask upstream (404 if unknown there too).
        self._datasets.pop(name, None)
        info = await self.dataset(name)
        if any(s.get("id") == snap for s in info.snapshots):
            return snap
        raise NotFound(f"dataset {name!r} has no snapshot {snap!r}")

    def _manifest_file(self, name: str, snap_id: str) -> Path:
        return self.store.root / "manifests" / name / f"{snap_id}.json.gz"

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        key = (name, snap_id)
        if self.prefetch is not None and key not in self._manifests and key not in self._telling:
            # A client that fetched the manifest will read from it: let the planner know it.
            # (manifest() loads through _manifest_blob, not here: before, each load spawned
            # another until the first was decoded -- a mount's start fetched a 113 KB
            # manifest 30-64 times over the link, 3.5-8 MB on 30-64 new connections.)
            self._telling.add(key)
            self.spawn(self.manifest(name, snap_id)).add_done_callback(
                lambda _t: self._telling.discard(key))
        return await self._manifest_blob(name, snap_id)

    async def _manifest_blob(self, name: str, snap_id: str) -> bytes:
        """The manifest's bytes from disk or upstream; concurrent callers share one load."""
        key = (name, snap_id)
        load = self._blob_loads.get(key)
        if load is None:
            load = self._blob_loads[key] = self.spawn(self._load_manifest_blob(name, snap_id))
            load.add_done_callback(lambda _t: self._blob_loads.pop(key, None))
        return await asyncio.shield(load)

    async def _load_manifest_blob(self, name: str, snap_id: str) -> bytes:
        path = self._manifest_file(name, snap_id)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            pass
        blob = await self._retrying(f"the manifest of {name}@{snap_id}",
                                    self.upstream.manifest_blob, name, snap_id)

        def persist() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # A name of its own: two readers may fetch the same manifest at once.
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(blob)
            tmp.replace(path)

        try:
            await asyncio.to_thread(persist)
        except OSError as exc:
            log.warning("cannot keep manifest %s@%s on disk: %s", name, snap_id, exc)
        return blob

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        m, new = await self._manifests.get(name, snap_id, self._manifest_blob)
        if new and self.prefetch is not None:
            self.prefetch.use_manifest(m)
        return m

    async def create_snapshot(self, name: str) -> dict[str, object]:
        # Snapshots are the hub's to make; forward, so `spokefs` commands work via a spoke.
        doc = await self.upstream.post_json(f"/v1/datasets/{name}/snapshots", {})
        self._datasets.pop(name, None)
        return doc

    # -- data --------------------------------------------------------------------------------
    async def object_size(self, name: str, version: str) -> int:
        size = self._sizes.get(version)
        if size is None:
            size = self.store.object_size(version)
        if size is None:
            # Learn the size from the first block, which the reader almost always needs.
            block = await self._block(name, version, 0, DEMAND)
            size = block.size
            self._just_fetched.add((version, 0))  # so the read that follows counts a miss
        self._sizes[version] = size
        if len(self._sizes) > 100_000:
            self._sizes.pop(next(iter(self._sizes)))
        return size

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        key = (version, index)
        rec = self.store.get(key)
        return rec.digest if rec is not None else self._digests.get(key)

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        bs = (await self.dataset(name)).block_size
        indexes = blocks_in_range(start, end, bs)
        if self.prefetch is not None:
            ctx = ctx or ReadContext()
            known = (ctx.path, ctx.size) if ctx.path is not None else self.prefetch.path_of(
                name, version)
            if known is not None and known[1] is not None:
                self.prefetch.on_read(name, known[0], version, known[1], start, end,
                                      ctx.reader, ctx.job)
        # Start every missing block now (the whole range is wanted), then send in order.
        pending = {i: self._start_fetch(name, version, i, DEMAND) for i in indexes
                   if (version, i) not in self.store}
        for i in indexes:
            lo = max(start, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            fut = pending.get(i)
            if fut is None:
                f = self.store.open_verified((version, i))
                if f is not None:
                    if (version, i) in self._just_fetched:
                        self._just_fetched.discard((version, i))
                        self.metrics.misses.inc()
                    else:
                        self.metrics.hits.inc()
                    yield FileSegment(f, lo, hi - lo)
                    continue
                fut = self._start_fetch(name, version, i, DEMAND)  # evicted or corrupt
            self.metrics.misses.inc()
            self._just_fetched.discard((version, i))
            # An error after the first block reaches the reader as a cut connection
            # (wire.server.send_segments), never as an error written into the body.
            block = await self._wait_fetch(fut, f"block {i} of {version} ({name})")
            yield memoryview(block.data)[lo:hi]

    async def _block(self, name: str, version: str, index: int, priority: int) -> Block:
        return await self._wait_fetch(self._start_fetch(name, version, index, priority),
                                      f"block {index} of {version} ({name})")

    async def _wait_fetch(self, fut: asyncio.Future[Block], what: str) -> Block:
        """Wait for a fetch, but not past the deadline of upstream silence: a reader queued
        behind fetches that stalled (all slots taken, nothing failing yet) still gets its 503
        once the upstream has sent no byte for ``deadline`` seconds while it waited. A slow
        link keeps sending, so it only makes readers slower."""
        began = time.monotonic()
        while True:
            silent_since = max(began, self.upstream.last_received)
            left = silent_since + self.config.deadline - time.monotonic()
            if left <= 0:
                cause = self._last_upstream_error or "no answer (connections stalled)"
                raise UpstreamUnavailable(
                    f"upstream {self.config.upstream} sent nothing for "
                    f"{self.config.deadline:g}s while waiting for {what}: {cause}",
                    self.config.upstream, cause)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError:
                if fut.done():
                    raise  # the fetch's own error, not our wait

    def _start_fetch(self, name: str, version: str, index: int,
                     priority: int) -> asyncio.Future[Block]:
        """The one fetch of a block (single-flight); a reader joining a queued prefetch
        raises its priority."""
        key = (version, index)
        fut = self._inflight.get(key)
        if fut is None:
            ticket = Ticket()
            ticket.priority = priority
            fut = self.spawn(self._fetch(name, version, index, priority, ticket))
            self._inflight[key] = fut
            self._tickets[key] = ticket
            fut.add_done_callback(lambda _f: self._fetch_finished(key, _f))
        else:
            self._tickets[key].raise_to(priority)
        return fut

    def _fetch_finished(self, key: BlockKey, fut: asyncio.Future[Block]) -> None:
        self._inflight.pop(key, None)
        self._tickets.pop(key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: a failed prefetch nobody awaited is not an error
        if self.prefetch is not None:
            self.prefetch.fetch_finished(key, key in self.store)

    def start_prefetch(self, name: str, key: BlockKey, priority: int) -> None:
        self._start_fetch(name, key[0], key[1], priority)

    def cancel_prefetch(self, key: BlockKey) -> None:
        """Drop a prefetch that has not started yet (a started one runs to completion)."""
        fut, ticket = self._inflight.get(key), self._tickets.get(key)
        if fut is not None and ticket is not None and ticket.priority != DEMAND and (
                ticket.future is not None and not ticket.future.done()):
            fut.cancel()

    async def _fetch(self, name: str, version: str, index: int, priority: int,
                     ticket: Ticket) -> Block:
        bs = (await self.dataset(name)).block_size
        key = (version, index)
        what = f"block {index} of {version} ({name})"
        for attempt in range(3):
            async with self.limiter.slot(priority, ticket, self._expected_size(
                    name, version, index, bs)) as grant:
                priority = ticket.priority
                t0 = time.monotonic()
                block = await self._retrying(what, self._read_range, name, version,
                                             index * bs, (index + 1) * bs, grant)
                self.metrics.fetch_seconds.observe(time.monotonic() - t0)
            self.metrics.upstream_bytes.labels("demand" if ticket.priority == DEMAND else
                                               "prefetch").inc(len(block.data))
            if block.digest is None:
                raise IntegrityError(f"upstream sent {what} without a digest; cannot verify")
            if block_digest(block.data) == block.digest:
                break
            self.metrics.integrity_failures.labels("upstream").inc()
            log.warning("%s from upstream failed its digest check (attempt %d)", what,
                        attempt + 1)
        else:
            raise IntegrityError(f"{what} failed its digest check 3 times; the upstream's copy "
                                 "may be changing or damaged")
        if self.store.object_size(version) is None:
            self.store.set_object_size(version, block.size)
        stored = await asyncio.to_thread(self.store.put, key, block.data, block.digest, name)
        if not stored:
            self.metrics.passthrough_bytes.inc(len(block.data))
            self._digests[key] = block.digest
            while len(self._digests) > 4096:
                self._digests.popitem(last=False)
        return block

    async def _read_range(self, name: str, version: str, start: int, end: int,
                          grant: Grant) -> Block:
        """One upstream request, timed for the link model, which sets the prefetch window;
        its bytes leave the window as they arrive."""
        link, limiter = self.link, self.limiter
        if link is None:
            return await self.upstream.read_range(name, version, start, end)

        def arrived(nbytes: int) -> None:
            link.received(nbytes)
            limiter.received(grant, nbytes)

        sent = link.sent(time.monotonic(), app_limited=not limiter.held_back)
        block = await self.upstream.read_range(name, version, start, end, arrived)
        link.delivered(sent, 0, time.monotonic(), block.first_byte)
        limiter.set_prefetch_window(link.window())
        return block

    def _expected_size(self, name: str, version: str, index: int, bs: int) -> int:
        """Bytes a fetch of this block will bring (the block size when the file is unknown)."""
        size = self._sizes.get(version) or self.store.object_size(version)
        if size is None and self.prefetch is not None:
            known = self.prefetch.path_of(name, version)
            size = known[1] if known is not None else None
        return bs if size is None else max(0, min(bs, size - index * bs))

    # -- warm-up, residency, purge -----------------------------------------------------------
    def warm(self, m: Manifest, files: list[int], pin: bool = False) -> dict[str, int]:
        """Fetch every block of ``files`` in the background (behind demand reads), optionally
        pinned; returns what it will fetch. Progress: ``residency``."""
        bs = m.block_size
        keys = [(m.versions[i], b) for i in files for b in range(block_count(m.sizes[i], bs))]
        if pin:
            for k in keys:
                self.store.pin(k)
        todo = [k for k in keys if k not in self.store]
        self.spawn(self._warm(m.dataset, todo))
        return {"files": len(files), "blocks": len(keys), "bytes": sum(m.sizes[i] for i in files),
                "blocks_to_fetch": len(todo)}

    async def _warm(self, name: str, keys: list[BlockKey]) -> None:
        # A bounded window of fetches at a time: a million blocks is not a million tasks.
        window = asyncio.Semaphore(2 * self.config.max_inflight)

        async def one(key: BlockKey) -> None:
            try:
                await asyncio.shield(self._start_fetch(name, key[0], key[1], WARM))
            except Exception as exc:
                log.warning("warm: block %s-%d not fetched: %s", key[0], key[1], exc)
            finally:
                window.release()

        async with asyncio.TaskGroup() as tg:
            for key in keys:
                await window.acquire()
                if key in self.store:
                    window.release()
                    continue
                tg.create_task(one(key))

    def residency(self, m: Manifest, files: list[int]) -> dict[str, object]:
        bs = m.block_size
        total = resident = full = 0
        for i in files:
            size = m.sizes[i]
            total += size
            have = sum(min(bs, size - b * bs) for b in range(block_count(size, bs))
                       if (m.versions[i], b) in self.store)
            resident += have
            full += have == size
        return {"files": len(files), "bytes": total, "resident_bytes": resident,
                "resident_files": full, "fraction": resident / total if total else 1.0}

    async def purge(self, name: str | None, keep: list[str] | None = None) -> int:
        """Drop cached blocks: all, a dataset's, or (``keep``: snapshot ids or "latest") a
        dataset's blocks of file versions in none of those snapshots -- what a source change
        left behind (rewritten or deleted files), without touching the current ones."""
        if keep is None:
            return await asyncio.to_thread(self.store.purge, name)
        if name is None:
            raise BadRequest("purging by kept snapshots needs a dataset")
        versions: set[str] = set()
        for snap in keep:
            versions.update((await self.manifest(name, await self.resolve(name, snap))).versions)
        return await asyncio.to_thread(self.store.purge, name, versions)

    # -- operator view -----------------------------------------------------------------------
    async def status(self) -> dict[str, object]:
        m = self.metrics
        hits, misses = m.hits._value.get(), m.misses._value.get()
        return {
            "role": self.role, "upstream": self.config.upstream,
            "upstream_error": self._last_upstream_error,
            "uptime_s": round(time.time() - self.started, 1),
            "cache": self.store.stats(),
            "hits": hits, "misses": misses,
            "hit_ratio": hits / (hits + misses) if hits + misses else None,
            "inflight": self.limiter.active, "queued": self.limiter.queued,
            "inflight_bytes": self.limiter.inflight_bytes,
            "link": self.link.stats() if self.link is not None else None,
            "deadline_s": self.config.deadline,
            "prefetch": self.prefetch.stats() if self.prefetch is not None else None,
        }



def _policy(name: str, capacity: int) -> EvictionPolicy:
    cls = POLICIES.get(name)
    wants_capacity = cls is not None and "capacity" in inspect.signature(cls).parameters
    return make_policy(name, **({"capacity": capacity} if wants_capacity else {}))
