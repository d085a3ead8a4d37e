"""The spoke: a read-through block cache in front of an upstream (a hub or another spoke).

``SpokeBackend`` is the spoke as a ``wire.backend.Backend``: it makes the parts, starts and
stops them, and answers the protocol through them. Each part has one job:

- ``spoke.metadata``: dataset info, manifests, snapshots in use, what versions commit to;
- ``spoke.reads``: the read path, one way to a block: resident, else just fetched, else
  fetched (``spoke.fetcher``: one fetch per block, many blocks per request);
- ``spoke.retention``: stale versions, purges, per-dataset rules (deny, time to live, share);
  ``spoke.fairshare``: reserved shares (``min_share``) in the store's eviction policy;
- ``spoke.warmup``: warm-ups, their pins, residency and inventory;
- ``spoke.local``: same-host readers of the cache files (replica workers, mounts);
- ``spoke.member``: this spoke as a tier member; ``spoke.prefetch``: the planner's driver.

When the upstream is unreachable, cached data is still served; an uncached read retries with
backoff and, after ``deadline`` seconds, fails with UpstreamUnavailable (HTTP 503).
Metadata (dataset info, manifests) is kept on disk, so a restarted spoke serves what it has
even while the upstream is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from spokefs.audit import Audit
from spokefs.cache.store import BlockStore
from spokefs.integrity import DEFAULT_BLOCK_SIZE
from spokefs.linkmodel import LinkModel
from spokefs.manifest import MAX_BLOCK_SIZE, Manifest
from spokefs.planner import Planner
from spokefs.policy import BlockKey, make_policy
from spokefs.spoke.config import SpokeConfig
from spokefs.spoke.datasets import DatasetConfig
from spokefs.spoke.fairshare import FairShares
from spokefs.spoke.fetcher import Fetcher
from spokefs.spoke.jobsignal import JobSignal
from spokefs.spoke.kept import Keeper
from spokefs.spoke.local import SameHost
from spokefs.spoke.member import Member, make_tier
from spokefs.spoke.metadata import Metadata
from spokefs.spoke.metrics import JobMetrics, SpokeMetrics
from spokefs.spoke.prefetch import PrefetchDriver
from spokefs.spoke.reads import Counts, Reads
from spokefs.spoke.retention import Retention
from spokefs.spoke.tier import Peer
from spokefs.spoke.upstreams import Routes
from spokefs.spoke.warmup import Held, Warmups
from spokefs.spoke.writeback import WRITE_TIMEOUT, WriteBack
from spokefs.tasks import Tasks
from spokefs.wire.backend import (
    BlockPart,
    DatasetInfo,
    ReadContext,
    Segment,
    bound_blocks,
    merge_parts,
)
from spokefs.wire.client import UpstreamClient
from spokefs.wire.looplag import LoopLag

__all__ = ["SpokeBackend", "SpokeConfig"]  # SpokeConfig lives in spoke.config


class SpokeBackend:
    role = "spoke"

    def __init__(self, config: SpokeConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = SpokeMetrics(self.registry)
        # Training jobs' step reports: data wait against compute (POST .../jobs/{job}/steps).
        self.jobs = JobSignal()
        self.registry.register(JobMetrics(self.jobs))
        # copies=: other members' blocks kept in spare room (a tier with --tier-copies)
        policy = make_policy(config.policy, capacity=config.cache_size,
                             copies=config.tiered() and config.tier_copies)
        self.store = BlockStore(config.cache_dir, config.cache_size, policy, fsync=config.fsync,
                                direct_io=config.direct_io())
        # Which upstream serves which dataset (spoke.upstreams), each with its own token.
        self.routes = Routes(config.upstream_specs())
        tokens = config.upstream_tokens()
        # Metadata (dataset info, manifests): small JSON answers, through aiohttp.
        self.upstreams = [UpstreamClient(s.url, max_connections=8,
                                         request_timeout=config.deadline, token=t)
                          for s, t in zip(self.routes.specs, tokens, strict=True)]
        # What the link needs in flight, measured; prefetch beyond it would only slow readers.
        self.link = LinkModel(max_window=config.prefetch_inflight) if config.pacing else None
        self.tasks = Tasks(on_failure=lambda name: self.metrics.task_failures.labels(
            name).inc())
        self.tier = make_tier(config, self.registry) if config.tiered() else None
        self.fetcher = Fetcher(self.routes, self.store, self.metrics,
                               spawn=lambda c: self.tasks.spawn(c, "fetch"),
                               max_requests=config.max_inflight, deadline=config.deadline,
                               link=self.link, finished=self._fetch_finished, tokens=tokens,
                               tier=self.tier)
        self.metadata = Metadata(self.routes, self.upstreams, self.store, self.tasks,
                                 self.metrics, deadline=config.deadline,
                                 latest_ttl=config.latest_ttl)
        self.versions = self.metadata.versions
        self.fetcher.expected_size = self._expected_size
        self.fetcher.frame_limit = self._frame_limit
        self.fetcher.commitments = self.metadata.commitments
        # What this spoke (and, in a tier, its members) holds: residency and the planner.
        self.held = Held(self.store, self.fetcher)
        self.warmups = Warmups(self.store, self.fetcher, self.held, self.metadata, self.tasks,
                               self.metrics, pin_ttl=config.pin_ttl, pin_share=config.pin_share,
                               max_inflight=config.max_inflight)
        self.audit = Audit(config.audit_log)  # a no-op without --audit-log
        # Per-dataset rules: cache deny, time-to-live, share of the cache (spoke.datasets).
        self.dataset_rules = DatasetConfig(
            Path(config.dataset_config) if config.dataset_config else None)
        self.retention = Retention(self.store, self.metadata, self.dataset_rules, self.metrics,
                                   self.audit, self.warmups, stale_after=config.stale_after)
        self.store.admit = self.retention.admit
        # Reserved shares (min_share): the store's policy wrapped while any is set.
        self.shares = FairShares(self.store, self.dataset_rules)
        self.registry.register(self.shares)
        self.counts = Counts(self.metrics)
        self.reads = Reads(self.store, self.fetcher, self.counts, upstream=self.routes.url,
                           deadline=config.deadline, read_window=config.read_window,
                           expired=self.retention.expired)
        self.local = SameHost(self.store, self.reads, self.versions, self.metrics,
                              self.metadata.block_size)
        self.member = (Member(self.tier, self.store, self.tasks, config.tier_handoff)
                       if self.tier is not None else None)
        self.prefetch: PrefetchDriver | None = None  # set by start() unless disabled
        # Writes into a writable dataset, durable here, uploaded to the hub behind (its own
        # clients: an upload's answer waits for the hub's read-back of the whole file).
        self.writeback = WriteBack(
            config.cache_dir / "writeback", self.metadata,
            [UpstreamClient(s.url, max_connections=2, request_timeout=WRITE_TIMEOUT, token=t)
             for s, t in zip(self.routes.specs, tokens, strict=True)],
            config.unsafe_quota)
        if config.keep_checkpoints > 0:
            self.writeback.keeper = Keeper(self.store, config.keep_checkpoints,
                                           config.keep_share)
        queue = self.fetcher.queue  # a demand read in flight to the upstream: uploads yield
        self.writeback.reads_waiting = lambda: queue.active > queue.prefetch_active
        self.registry.register(self.writeback)
        self.started = time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.store.open, loop.call_soon_threadsafe)
        self.metrics.watch(self.store, self.fetcher.queue, self.config.prefetch_inflight)
        self.tasks.keep(self._housekeeping, "housekeeping")
        if self.config.stale_after > 0:
            self.tasks.keep(self.retention.loop, "retire-stale")
        self.audit.watch_store(self.store, self.tasks)  # after the callbacks above: it chains
        self.tasks.keep(LoopLag(self.registry).run, "loop-lag")
        if self.member is not None:
            self.member.start()
        self.tasks.keep(self.writeback.run, "write-back")
        if self.config.prefetch:
            planner = Planner(capacity=self.store.capacity,
                              max_inflight_bytes=self.config.prefetch_inflight,
                              readahead_max_bytes=self.config.readahead_max,
                              resident=self.held)
            self.prefetch = PrefetchDriver(planner, self.store, self._prefetch,
                                           self.fetcher.cancel, self.metadata.latest_manifest)
            self.metadata.on_manifest = self.prefetch.use_manifest
            self.reads.heard = self.prefetch.heard
            self.tasks.spawn(self.prefetch.restore(), "restore-working-sets")

    async def close(self) -> None:
        await self.tasks.close()
        await self.fetcher.close()
        for client in [*self.upstreams, *self.writeback.clients]:
            await client.close()
        self.reads.close()
        await asyncio.to_thread(self.store.close)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            self.store.flush_access_times()
            self.store.retry_writable()
            self.fetcher.arenas.trim()
            self.warmups.expire()
            self.dataset_rules.reload_if_changed()
            await self.retention.enforce()

    # -- metadata (spoke.metadata) -----------------------------------------------------------
    async def datasets(self) -> list[DatasetInfo]:
        return await self.metadata.datasets()

    async def dataset(self, name: str) -> DatasetInfo:
        return await self.metadata.dataset(name)

    async def resolve(self, name: str, snap: str) -> str:
        return await self.metadata.resolve(name, snap)

    def snapshots_used(self, name: str, snap_ids: list[str]) -> None:
        self.metadata.snapshots_used(name, snap_ids)

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        return await self.metadata.manifest_blob(name, snap_id)

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        return await self.metadata.manifest(name, snap_id)

    async def create_snapshot(self, name: str) -> dict[str, object]:
        return await self.metadata.create_snapshot(name)

    async def digests(self, name: str, versions: list[str]) -> dict[str, object]:
        return await self.metadata.digests(name, versions)

    # -- data (spoke.reads) ------------------------------------------------------------------
    async def object_size(self, name: str, version: str) -> int:
        await self.versions.check(name, version)
        return await self.reads.object_size(name, version)

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        await self.versions.check(name, version)
        return self.reads.digest((version, index))

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        """The bytes of [start, end), block by block, each checked against its digests."""
        await self.versions.check(name, version)
        bs = (await self.dataset(name)).block_size
        async with contextlib.aclosing(self.reads.range(name, version, start, end, bs,
                                                        ctx or ReadContext())) as segments:
            async for seg in segments:
                yield seg

    async def batch_bytes(self, name: str, blocks: list[tuple[str, int]]) -> int:
        """The bytes a batch read of ``blocks`` holds at most (``wire.server.ByteRoom``)."""
        return await self.versions.batch_bytes(name, blocks,
                                               (await self.dataset(name)).block_size)

    async def read_blocks(self, name: str, blocks: list[tuple[str, int]],
                          peer: Peer | None = None) -> list[BlockPart]:
        """Whole blocks for a downstream spoke (a batch read): fetched first where missing.
        From another tier member (``peer``, from ``X-Spokefs-Peer``): from the cache or the
        upstream only, at the member's priority; a member's handoff (``copy``): from the
        cache only."""
        blocks, refused = await bound_blocks(self.versions, name, blocks)
        parts = merge_parts(await self.reads.blocks(name, blocks, peer), refused)
        if peer is not None and self.tier is not None:
            self.tier.metrics.served.inc(sum(p.length for p in parts if p.status == 200))
        return parts

    def _expected_size(self, name: str, key: BlockKey) -> int:
        """Bytes a fetch of this block will bring (the block size when the file is unknown)."""
        version, index = key
        bs = self.metadata.block_size(name) or DEFAULT_BLOCK_SIZE
        size = self.reads.size_of(version)
        if size is None and self.prefetch is not None:
            known = self.prefetch.path_of(name, version)
            size = known[1] if known is not None else None
        return bs if size is None else max(0, min(bs, size - index * bs))

    def _frame_limit(self, name: str, key: BlockKey) -> int:
        """The most bytes a received frame of this block may hold: what the manifest says it
        holds once the dataset is known (its block size bounds it), else the largest block."""
        if self.metadata.block_size(name) is None:
            return MAX_BLOCK_SIZE
        return self._expected_size(name, key)

    # -- the planner (spoke.prefetch) --------------------------------------------------------
    def _prefetch(self, name: str, key: BlockKey, priority: int) -> None:
        self.fetcher.want(name, key, priority)

    def _fetch_finished(self, key: BlockKey, resident: bool) -> None:
        if self.prefetch is not None:
            self.prefetch.fetch_finished(key, resident)

    # -- counts gathered from replica workers (spoke.local) ----------------------------------
    def attach_served(self, served: Counter) -> None:
        """The API's served-bytes counter: replica workers' bytes are added to it."""
        self.local.served = served

    async def before_scrape(self) -> None:
        """Every replica worker's counts gathered, so /metrics and /v1/status are exact."""
        await self.local.before_scrape()

    # -- operator view -----------------------------------------------------------------------
    READY_UPSTREAM_S = 10.0  # an upstream answer counts as recent this long (/readyz)
    _upstream_answered = -READY_UPSTREAM_S

    async def ready(self) -> str | None:
        """``/readyz`` (``wire.backend.Ready``): None while the cache folder is there and
        holds blocks, or the upstream answers (asked within 1 s, at most every
        ``READY_UPSTREAM_S`` while the cache is empty); else a generic reason. A cache that
        cannot be written is not unready: reads pass through (its metric and alert say so)."""
        if not await asyncio.to_thread(self.store.root.is_dir):
            return "the cache folder is gone"
        if self.store.data_bytes > 0:
            return None
        now = time.monotonic()
        if now - self._upstream_answered < self.READY_UPSTREAM_S:
            return None
        async def answers(client: UpstreamClient) -> bool:
            try:
                await asyncio.wait_for(client.get_json("/v1/datasets"), 1.0)
            except Exception:  # any failure to ask it: no (the cause is in the status)
                return False
            return True

        if not any(await asyncio.gather(*map(answers, self.upstreams))):
            return ("the upstream does not answer and nothing is cached" if
                    len(self.upstreams) == 1 else
                    "no upstream answers and nothing is cached")
        self._upstream_answered = now
        return None

    async def status(self) -> dict[str, object]:
        await self.before_scrape()
        c, q = self.counts, self.fetcher.queue
        return {
            "role": self.role, "upstream": self.config.upstream,
            "upstreams": [{"url": sp.url, "datasets": list(sp.datasets) or ["*"],
                           "error": self.fetcher.errors.get(i)}
                          for i, sp in enumerate(self.routes.specs)],
            "upstream_error": self.fetcher.last_error or self.metadata.last_error,
            "uptime_s": round(time.time() - self.started, 1),
            "cache": {**self.store.stats(), "warm_pinned_bytes": self.warmups.pinned_bytes},
            "datasets": {**self.dataset_rules.describe(),
                         "resident_bytes": dict(sorted(self.store.dataset_bytes.items())),
                         "shares": self.shares.status(),
                         "hits_misses": {ds: list(hm) for ds, hm
                                         in sorted(c.by_dataset.items())}},
            "hits": c.hits, "misses": c.misses,
            "hit_ratio": c.hits / (c.hits + c.misses) if c.hits + c.misses else None,
            "inflight": q.active, "queued": q.queued,
            "inflight_bytes": q.inflight_bytes,
            "link": self.link.stats() if self.link is not None else None,
            "deadline_s": self.config.deadline,
            "prefetch": self.prefetch.stats() if self.prefetch is not None else None,
            "jobs": self.jobs.describe(time.monotonic()),
            "stale": self.retention.status(),
            "tier": self.member.status() if self.member is not None else None,
        }
