"""The spoke: a read-through block cache in front of an upstream (a hub or another spoke).

A read of [start, end) of a file version becomes block reads. A resident block's bytes are
checked against their chunk digests and sent: a small range read into a buffer of its own
and checked there, a range of 1 MiB or more checked in a thread and sent with sendfile from
the same held region of the segment file. A missing block is
fetched (``spoke.fetcher``: one fetch per block, many blocks per request, demand before
prefetch), checked against the digest the upstream sent, handed to every reader waiting for
it, and written to the store in the background. Blocks are keyed by (version, index), so a
new version of a file never mixes with an old one.

When the upstream is unreachable, cached data is still served; an uncached read retries with
backoff and, after ``deadline`` seconds, fails with UpstreamUnavailable (HTTP 503).
Metadata (dataset info, manifests) is kept on disk, so a restarted spoke serves what it has
even while the upstream is down.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from spokefs.audit import Audit
from spokefs.cache.durable import load_manifest_checked, store_manifest
from spokefs.cache.feed import ResidencyFeed
from spokefs.cache.store import BlockStore, Loc, read_loc
from spokefs.errors import (
    BadRequest,
    BadUpstream,
    ConfigError,
    NotFound,
    SpokeError,
    Transient,
    UpstreamUnavailable,
)
from spokefs.integrity import DEFAULT_BLOCK_SIZE, block_count, blocks_in_range
from spokefs.linkmodel import LinkModel
from spokefs.manifest import MAX_BLOCK_SIZE, Manifest, is_snapshot_id
from spokefs.planner import Planner
from spokefs.policy import POLICIES, BlockKey, CopiesFirst, EvictionPolicy, make_policy
from spokefs.retry import retrying
from spokefs.spoke.commitments import Commitments
from spokefs.spoke.datasets import DatasetConfig
from spokefs.spoke.fetcher import Block, Fetcher
from spokefs.spoke.jobsignal import JobSignal
from spokefs.spoke.metrics import JobMetrics, SpokeMetrics
from spokefs.spoke.prefetch import PrefetchDriver
from spokefs.spoke.tier import PEER_FROM, PEER_REQUEST, Tier, make_lookup
from spokefs.tasks import Tasks
from spokefs.units import format_size
from spokefs.wire.backend import (
    BlockPart,
    DatasetInfo,
    DatasetVersions,
    FileSegment,
    LaterBlock,
    ManifestMemo,
    ReadContext,
    Segment,
    bound_blocks,
    merge_parts,
)
from spokefs.wire.client import UpstreamClient
from spokefs.wire.looplag import LoopLag
from spokefs.wire.server import BATCH_MEMORY

log = logging.getLogger(__name__)

DEMAND = 0  # priority of a block a reader is waiting for
WARM = 1 << 20  # operator warm-up: behind demand and the planner's prefetches
PEER_PREFETCH = 1 << 10  # another tier member's prefetch: behind demand, before warm-ups
CHECK_IN_THREAD = 1 << 20  # a read this large is checked off the event loop


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
    write_io: str = "auto"          # direct, buffered, or auto (direct for a cache > RAM / 2)
    # A read asks for at most this many bytes beyond what its client has taken, so a slow or
    # abandoned reader of a huge range holds and pulls one window, not the whole range.
    read_window: int = 64 << 20
    # Bytes of batch reads this process holds at once (``wire.server.ByteRoom``): the spoke's
    # budget, shared out among its worker processes (``spoke.workers``).
    batch_memory: int = BATCH_MEMORY
    pin_ttl: float = 24 * 3600.0    # a warm-up's pins are released after this long
    pin_share: float = 0.8          # most of the capacity warm-ups may pin at once
    # Blocks of a file version no snapshot in use holds (changed or removed at the source)
    # leave the cache within this long; 0 keeps them until evicted (retire_stale).
    stale_after: float = 600.0
    auth: str | None = None         # token file clients must present a token of (wire.auth)
    upstream_token_file: str | None = None  # this spoke's own token for its upstream
    dataset_config: str | None = None  # per-dataset residency and retention (spoke.datasets)
    tls_cert: str | None = None     # serve https (with tls_key)
    tls_key: str | None = None
    audit_log: str | None = None    # the primary's audit file; replica N's is FILE.worker-N
    # A spoke tier (spoke.tier): static members (URL,URL,...), or a DNS name, or a Kubernetes
    # Service whose members are listed; ``advertise`` is this member's own URL among them.
    tier: str | None = None
    tier_dns: str | None = None
    tier_kubernetes: str | None = None
    advertise: str | None = None
    tier_timeout: float = 10.0      # a member silent this long is skipped for the next one
    tier_refresh: float = 10.0      # how often a DNS or Kubernetes member list is read again
    tier_token_file: str | None = None  # the token presented to members (default: upstream's)
    tier_borrow: int = 128 << 20    # blocks got from other members and not kept, in memory
    tier_copies: bool = True        # keep copies of other members' blocks in spare room
    tier_handoff: float = 600.0     # empty at start, or members changed: ask others first

    def tls(self) -> tuple[Path, Path] | None:
        return (Path(self.tls_cert), Path(self.tls_key)) if self.tls_cert and self.tls_key \
            else None

    def tiered(self) -> bool:
        return bool(self.tier or self.tier_dns or self.tier_kubernetes)

    def tier_token(self) -> str | None:
        """The token this member presents to the other members (their --auth files hold it,
        scope ``tier``): --tier-token-file's, else none. Never the upstream token: the hub's
        credential goes to the hub only, and a member's token opens members' internal
        routes only."""
        if self.tier_token_file is None:
            return None
        from spokefs.wire.auth import read_token_file

        return read_token_file(Path(self.tier_token_file))

    def upstream_token(self) -> str | None:
        """The token this spoke presents upstream: its own, never a client's."""
        if self.upstream_token_file is None:
            return None
        from spokefs.wire.auth import read_token_file

        return read_token_file(Path(self.upstream_token_file))

    def direct_io(self) -> bool:
        """Whether cache writes bypass the page cache. A cache larger than half the memory
        cannot live in the page cache anyway: copying its fills through it only pushes out
        what readers use (and costs a copy, 1-2.6 CPU-s per GiB on a lazily backed VM). A
        smaller one is better kept there: a block read soon after it was fetched is then a
        memory read, not a disk read."""
        if self.write_io == "auto":
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return self.cache_size > memory // 2
        return self.write_io == "direct"


class SpokeBackend:
    role = "spoke"

    def __init__(self, config: SpokeConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = SpokeMetrics(self.registry)
        # Training jobs' step reports: data wait against compute (POST .../jobs/{job}/steps).
        self.jobs = JobSignal()
        self.registry.register(JobMetrics(self.jobs))
        policy = _policy(config.policy, config.cache_size)
        if config.tiered() and config.tier_copies:
            policy = CopiesFirst(policy)  # copies of other members' blocks, in spare room
        self.store = BlockStore(config.cache_dir, config.cache_size, policy, fsync=config.fsync,
                                direct_io=config.direct_io())
        # Metadata (dataset info, manifests): small JSON answers, through aiohttp.
        token = config.upstream_token()
        self.upstream = UpstreamClient(config.upstream, max_connections=8,
                                       request_timeout=config.deadline, token=token)
        # What the link needs in flight, measured; prefetch beyond it would only slow readers.
        self.link = LinkModel(max_window=config.prefetch_inflight) if config.pacing else None
        self.tasks = Tasks(on_failure=lambda name: self.metrics.task_failures.labels(
            name).inc())
        self.tier = _make_tier(config, self.registry) if config.tiered() else None
        self.fetcher = Fetcher(config.upstream, self.store, self.metrics,
                               spawn=lambda c: self.tasks.spawn(c, "fetch"),
                               max_requests=config.max_inflight, deadline=config.deadline,
                               link=self.link, finished=self._fetch_finished, token=token,
                               tier=self.tier)
        # What this spoke (and, in a tier, its members) holds: residency and the planner.
        self.held = _Held(self.store, self.fetcher)
        self.fetcher.expected_size = self._expected_size
        self.fetcher.frame_limit = self._frame_limit
        self.commitments = Commitments(self._known_dataset, self.dataset, self._upstream_digests)
        self.fetcher.commitments = self.commitments
        # Checks of large reads run here, off the event loop (the native read releases the GIL)
        self._checker = ThreadPoolExecutor(2, thread_name_prefix="spokefs-check")
        self.prefetch: PrefetchDriver | None = None  # set by start() unless disabled
        # Blocks that became resident lately, told to same-host readers (locate, reads).
        self.feed: ResidencyFeed[BlockKey, Loc] = ResidencyFeed()
        self.store.events.changed.append(
            lambda key, loc: loc is not None and self.feed.add(key, loc))
        self._datasets: dict[str, tuple[float, DatasetInfo]] = {}
        self._manifests = ManifestMemo()
        # One upstream fetch of a manifest however many ask at once, and one decode for the
        # planner per client that fetched it (see manifest_blob).
        self._blob_loads: dict[tuple[str, str], asyncio.Task[bytes]] = {}
        self._telling: set[tuple[str, str]] = set()
        self._sizes: dict[str, int] = {}  # version -> size, in front of the index
        self._just_fetched: set[BlockKey] = set()  # fetched by object_size for a waiting read
        # Per-dataset rules: cache deny, time-to-live, share of the cache (spoke.datasets).
        self.dataset_rules = DatasetConfig(
            Path(config.dataset_config) if config.dataset_config else None)
        self.store.admit = self._admit
        # Blocks pinned by warm-ups: key -> (bytes, when the pin lapses); bounded by pin_share.
        self._warm_pins: dict[BlockKey, tuple[int, float]] = {}
        self.warm_pinned_bytes = 0
        self._last_upstream_error: str | None = None
        # Snapshots readers named lately: (dataset, snapshot id) -> when (monotonic). With
        # each dataset's latest, they say which file versions are in use (retire_stale).
        self._snapshots_used: dict[tuple[str, str], float] = {}
        self.versions = DatasetVersions(self.dataset, self.manifest, self._in_use)
        self._retired_for: dict[str, frozenset[str]] = {}  # dataset -> in-use set at last pass
        self._retire_passes = 0
        self._hits_by_dataset: dict[str, list[int]] = {}  # dataset -> [hits, misses]
        self._unconfirmed: set[str] = set()  # datasets whose latest upstream could not confirm
        self.served: Any = None  # the API's served-bytes counter (wire.server sets it)
        self.audit = Audit(config.audit_log)  # a no-op without --audit-log
        self.started = time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.store.open, loop.call_soon_threadsafe)
        ev = self.store.events
        ev.on_evict = self.metrics.evictions.inc
        ev.on_corrupt = lambda: self.metrics.integrity_failures.labels("cache").inc()
        ev.on_write_error = lambda reason: self.metrics.write_errors.labels(reason).inc()
        ev.on_prefetch_used = self.metrics.prefetch_used_bytes.inc
        self.metrics.cache_capacity.set(self.store.capacity)
        self.metrics.cache_bytes.set_function(lambda: self.store.data_bytes)
        self.metrics.cache_writable.set_function(lambda: 1 if self.store.writable else 0)
        self.metrics.inflight.set_function(lambda: self.fetcher.queue.active)
        self.metrics.prefetch_window.set_function(
            lambda: self.fetcher.queue.prefetch_window or self.config.prefetch_inflight)
        self.tasks.keep(self._housekeeping, "housekeeping")
        if self.config.stale_after > 0:
            self.tasks.keep(self._retire_loop, "retire-stale")
        self.audit.watch_store(self.store, self.tasks)  # after the callbacks above: it chains
        self.tasks.keep(LoopLag(self.registry).run, "loop-lag")
        if self.tier is not None:
            # The index knows no owner (copies): ask the ranking now and whenever it changes.
            self.tier.on_change = self._members_changed
            if isinstance(self.store.policy, CopiesFirst):
                self.tasks.spawn(self._reclassify_copies(), "tier-copies")
            if self.store.data_bytes == 0:  # a new member, or a replaced node's empty disk
                self.tier.open_handoff(self.config.tier_handoff)
            self.tasks.keep(self.tier.probe_loop, "tier-probes")
            if self.tier.lookup is not None:
                self.tasks.keep(self.tier.refresh_loop, "tier-members")
        if self.config.prefetch:
            planner = Planner(capacity=self.store.capacity,
                              max_inflight_bytes=self.config.prefetch_inflight,
                              readahead_max_bytes=self.config.readahead_max,
                              resident=self.held)
            self.prefetch = PrefetchDriver(planner, self.store, self._prefetch,
                                           self.fetcher.cancel, self._latest_manifest)
            self.tasks.spawn(self.prefetch.restore(), "restore-working-sets")

    async def close(self) -> None:
        await self.tasks.close()
        await self.fetcher.close()
        await self.upstream.close()
        self._checker.shutdown(wait=True)
        await asyncio.to_thread(self.store.close)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            self.store.flush_access_times()
            self.store.retry_writable()
            self.fetcher.arenas.trim()
            self._expire_warm_pins(time.monotonic())
            self.dataset_rules.reload_if_changed()
            await self._enforce_dataset_rules()

    # -- metadata ----------------------------------------------------------------------------
    async def _retrying(self, what: str, fn: Any, *args: Any) -> Any:
        """Call an upstream coroutine, retrying transient failures with backoff until the
        deadline; then UpstreamUnavailable naming the upstream and the cause."""
        def failed(exc: Transient) -> None:
            self.metrics.upstream_errors.labels("transient").inc()
            self._last_upstream_error = str(exc)

        up, dl = self.config.upstream, self.config.deadline
        result = await retrying(
            lambda: fn(*args), dl, on_transient=failed,
            give_up=lambda cause: UpstreamUnavailable(
                f"upstream {up} unreachable for {dl:g}s while fetching {what}: {cause}",
                up, cause))
        self._last_upstream_error = None
        return result

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
                self._unconfirmed.add(name)
                log.warning("upstream down (%s); using the last known state of %r", exc, name)
                self._datasets[name] = (now, stale)  # ask again after the ttl, not per read
                return stale
            raise UpstreamUnavailable(
                f"upstream {self.config.upstream} is unreachable and dataset {name!r} was "
                f"never seen by this spoke: {exc}", self.config.upstream, str(exc)) from exc
        info = DatasetInfo.from_json(doc, DEFAULT_BLOCK_SIZE)
        self._datasets[name] = (now, info)
        self._unconfirmed.discard(name)
        self.store.kv_set(f"dataset:{name}", json.dumps(info.to_json()))
        return info

    def _known_dataset(self, name: str) -> DatasetInfo | None:
        """The dataset's info as this spoke has it now (memory, then disk); no I/O upstream."""
        cached = self._datasets.get(name)
        return cached[1] if cached is not None else self._persisted_dataset(name)

    async def _upstream_digests(self, name: str, versions: list[str]) -> dict[str, object]:
        doc = await self._retrying(f"the digests of {len(versions)} versions",
                                   self.upstream.post_json, f"/v1/datasets/{name}/digests",
                                   {"versions": versions})
        got = doc.get("digests") if isinstance(doc, dict) else None
        if not isinstance(got, dict):
            raise BadUpstream("the upstream's digests answer is malformed")
        return got

    async def digests(self, name: str, versions: list[str]) -> dict[str, object]:
        """What each version commits to, for a downstream spoke: learned from the upstream
        (and checked against the version id) once, then from memory."""
        out: dict[str, object] = {}
        for v in versions:
            try:
                await self.versions.check(name, v)
                await self.commitments.learn(name, v)
            except NotFound:
                out[v] = None
                continue
            c = self.commitments.digests_of(v)
            if c is None:  # one block: the upstream's list, as it said (checked on use)
                got = (await self._upstream_digests(name, [v])).get(v)
                out[v] = got
                continue
            out[v] = {"size": c.size, "digests": c.digests.hex()}
        return out

    def _persisted_dataset(self, name: str) -> DatasetInfo | None:
        raw = self.store.kv_get(f"dataset:{name}")
        if raw is None:
            return None
        return DatasetInfo.from_json(json.loads(raw), DEFAULT_BLOCK_SIZE)

    async def datasets(self) -> list[DatasetInfo]:
        doc = await self._retrying("the dataset list", self.upstream.get_json, "/v1/datasets")
        return [await self.dataset(d["name"]) for d in doc["datasets"]]

    async def resolve(self, name: str, snap: str) -> str:
        """A snapshot's id (``snap``: an id or "latest"); it counts as in use from now."""
        snap_id = await self._resolve(name, snap)
        self._snapshots_used[(name, snap_id)] = time.monotonic()
        return snap_id

    def snapshots_used(self, name: str, snap_ids: list[str]) -> None:
        """Readers elsewhere (a mount's short circuit, a replica worker) use these."""
        now = time.monotonic()
        for snap_id in snap_ids:
            if is_snapshot_id(snap_id):  # not "latest": that is always in use
                self._snapshots_used[(name, snap_id)] = now

    async def _resolve(self, name: str, snap: str) -> str:
        info = await self.dataset(name)
        if snap == "latest":
            if info.latest is None:
                raise NotFound(f"dataset {name!r} has no snapshot yet")
            return info.latest
        if any(s.get("id") == snap for s in info.snapshots) or (
                is_snapshot_id(snap) and self._manifest_file(name, snap).exists()):
            return snap
        # Maybe newer than our cached dataset info: ask upstream (404 if unknown there too).
        self._datasets.pop(name, None)
        info = await self.dataset(name)
        if any(s.get("id") == snap for s in info.snapshots):
            return snap
        raise NotFound(f"dataset {name!r} has no snapshot {snap!r}")

    def _manifest_file(self, name: str, snap_id: str) -> Path:
        # Both names may have come from upstream (a dataset's "latest"): checked, then joined.
        return self.store.manifest_path(name, snap_id)

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        key = (name, snap_id)
        self._snapshots_used[key] = time.monotonic()  # a client will read from it
        if self.prefetch is not None and key not in self._manifests and key not in self._telling:
            # A client that fetched the manifest will read from it: let the planner know it.
            # (manifest() loads through _manifest_blob, not here: before, each load spawned
            # another until the first was decoded -- a mount's start fetched a 113 KB
            # manifest 30-64 times over the link, 3.5-8 MB on 30-64 new connections.)
            self._telling.add(key)
            self.tasks.spawn(self.manifest(name, snap_id), "decode-manifest",
                             quiet=(SpokeError,)).add_done_callback(
                lambda _t: self._telling.discard(key))
        return await self._manifest_blob(name, snap_id)

    async def _manifest_blob(self, name: str, snap_id: str) -> bytes:
        """The manifest's bytes from disk or upstream; concurrent callers share one load."""
        key = (name, snap_id)
        load = self._blob_loads.get(key)
        if load is None:
            load = self._blob_loads[key] = self.tasks.spawn(
                self._load_manifest_blob(name, snap_id), "load-manifest", quiet=(SpokeError,))
            load.add_done_callback(lambda _t: self._blob_loads.pop(key, None))
        return await asyncio.shield(load)

    async def _load_manifest_blob(self, name: str, snap_id: str) -> bytes:
        path = self._manifest_file(name, snap_id)
        # A kept copy is served only if it decodes and matches its snapshot id; a damaged one
        # is deleted (None) and fetched again.
        blob = await asyncio.to_thread(load_manifest_checked, path, snap_id, name)
        if blob is not None:
            return blob
        blob = await self._retrying(f"the manifest of {name}@{snap_id}",
                                    self.upstream.manifest_blob, name, snap_id)
        try:
            # Checked first (ManifestError, a 502: nothing kept, nothing served), then
            # written durably (temporary file, fsync, rename, fsync of the folder).
            await asyncio.to_thread(store_manifest, path, blob, snap_id, name)
        except OSError as exc:
            log.warning("cannot keep manifest %s@%s on disk: %s", name, snap_id, exc)
        return blob

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        m, new = await self._manifests.get(name, snap_id, self._manifest_blob)
        if new and self.prefetch is not None:
            self.prefetch.use_manifest(m)
        return m

    async def _latest_manifest(self, name: str) -> Manifest | None:
        info = await self.dataset(name)
        return None if info.latest is None else await self.manifest(name, info.latest)

    async def create_snapshot(self, name: str) -> dict[str, object]:
        # Snapshots are the hub's to make; forward, so `spokefs` commands work via a spoke.
        doc = await self.upstream.post_json(f"/v1/datasets/{name}/snapshots", {})
        self._datasets.pop(name, None)
        return doc

    # -- data --------------------------------------------------------------------------------
    def _in_use(self, name: str) -> list[str]:
        return [snap for (ds, snap) in self._snapshots_used if ds == name]

    async def object_size(self, name: str, version: str) -> int:
        await self.versions.check(name, version)
        size = self._sizes.get(version)
        if size is None:
            size = self.store.object_size(version)
        if size is None:
            # Learn the size from the first block, which the reader almost always needs.
            block = await self._wait_fetch(self.fetcher.want(name, (version, 0), DEMAND),
                                           f"block 0 of {version} ({name})")
            size = block.object_size
            self._just_fetched.add((version, 0))  # so the read that follows counts a miss
        self._sizes[version] = size
        if len(self._sizes) > 100_000:
            self._sizes.pop(next(iter(self._sizes)))
        return size

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        await self.versions.check(name, version)
        key = (version, index)
        loc = self.store.get(key)
        if loc is not None:
            return loc.digest
        block = self.fetcher.recent(key)
        return block.digest if block is not None else self.fetcher.passed.get(key)

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        """The bytes of [start, end), block by block, each checked against its digests."""
        await self.versions.check(name, version)
        bs = (await self.dataset(name)).block_size
        indexes = blocks_in_range(start, end, bs)
        store, fetcher = self.store, self.fetcher
        # Missing blocks are asked for a window ahead of the one being sent (all at once for
        # a range within the window); a sent block's future is dropped at once, so neither
        # memory nor the link follows a reader that stalls or leaves. The planner hears the
        # read block by block as it is sent: told the whole range at once, its readahead
        # would fetch all of it for a reader that may take a megabyte and leave.
        window = max(2, self.config.read_window // bs)
        pending: dict[int, asyncio.Future[Block]] = {}
        asked = indexes.start
        tell = self.prefetch is not None
        for i in indexes:
            if tell:
                self._tell_planner(name, version, max(start, i * bs), min(end, (i + 1) * bs),
                                   ctx or ReadContext())
            while asked < min(i + window, indexes.stop):
                if (version, asked) not in store and fetcher.recent((version, asked)) is None:
                    pending[asked] = fetcher.want(name, (version, asked), DEMAND)
                asked += 1
            key = (version, i)
            lo = max(start, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            fut = pending.pop(i, None)
            if fut is None:
                view = await self._resident(key, lo, hi)
                if view is not None:
                    if key in self._just_fetched:
                        self._just_fetched.discard(key)
                        self._count(name, 0, 1)
                    else:
                        self._count(name, 1, 0)
                    yield view
                    continue
                block = fetcher.recent(key)
                if block is not None:
                    self._count(name, 1, 0)
                    yield await self._fetched(key, block, lo, hi)
                    continue
                fut = fetcher.want(name, key, DEMAND)  # evicted or damaged meanwhile
            self._count(name, 0, 1)
            self._just_fetched.discard(key)
            # An error after the first block reaches the reader as a cut connection
            # (wire.server.send_segments), never as an error written into the body.
            block = await self._wait_fetch(fut, f"block {i} of {version} ({name})")
            yield await self._fetched(key, block, lo, hi)

    # -- per-dataset rules ---------------------------------------------------------------------
    def _admit(self, dataset: str, size: int) -> bool:
        """Whether a fetched block of ``dataset`` may be kept (else it is served only)."""
        rules = self.dataset_rules.get(dataset)
        if not rules.cache:
            return False
        if rules.max_share is not None:
            limit = rules.max_share * self.store.capacity
            held = (self.store.dataset_bytes.get(dataset, 0)
                    + self.store.dataset_reserved.get(dataset, 0))  # being written counts
            return held + size <= limit
        return True

    def _expired(self, key: BlockKey) -> bool:
        """A resident block its dataset's rules no longer let be served (past its time to
        live, or caching denied since): dropped now, so it is fetched again."""
        loc = self.store.get(key)
        if loc is None:
            return False
        rules = self.dataset_rules.get(loc.dataset)
        if rules.cache and (rules.ttl is None or time.time() - loc.stored <= rules.ttl):
            return False
        self.store.drop(key, "ttl" if rules.cache else "cache denied")
        return True

    async def _enforce_dataset_rules(self) -> None:
        """Drop every block past its time to live or of a dataset now denied (so a same-host
        reader of the cache files, which does not ask, is held to the rules within a pass)."""
        if not self.dataset_rules.any_ttl_or_deny:
            return
        for n, key in enumerate(list(self.store.keys())):
            self._expired(key)
            if n % 20_000 == 19_999:
                await asyncio.sleep(0)

    def reload_dataset_rules(self) -> None:
        self.dataset_rules.reload()

    async def _resident(self, key: BlockKey, lo: int, hi: int) -> Segment | None:
        """Checked bytes [lo, hi) of a resident block (None: not resident, or damaged and
        dropped). A small range is read into a buffer of its own and checked there. A large
        one is checked in a thread (the checker's scratch buffer) and then sent by the kernel
        from the same region of the segment file (sendfile: no buffer of the read's size is
        held while a slow client drains); the block is held meanwhile, so nothing evicts or
        frees it."""
        if self._expired(key):
            return None
        if hi - lo < CHECK_IN_THREAD:
            return self.store.read(key, lo, hi)
        loc = self.store.hold(key)
        if loc is None:
            return self.store.read(key, lo, hi)  # absent, or an old copy still being sent
        try:
            ok = await asyncio.get_running_loop().run_in_executor(
                self._checker, _check, loc, lo, hi, self.store.chunk_size)
        except BaseException:
            self.store.let_go(key, loc)
            raise
        if not ok:
            self.store.let_go(key, loc)
            self.store.corrupt(key, loc)  # a no-op if it already left the cache
            return None
        self.store.touch(key)
        return self._file_segment(key, loc, lo, hi)

    def _file_segment(self, key: BlockKey, loc: Loc, lo: int, hi: int) -> FileSegment:
        return FileSegment(loc.seg.file, loc.offset + lo, hi - lo, owned=False,
                           done=functools.partial(self.store.let_go, key, loc))

    async def _fetched(self, key: BlockKey, block: Block, lo: int, hi: int) -> Segment:
        """A fetched block's bytes, from the buffer they arrived in (still warm in memory;
        the copy the store writes goes to disk with direct I/O, not to the page cache)."""
        return block.view[lo:hi]

    async def batch_bytes(self, name: str, blocks: list[tuple[str, int]]) -> int:
        """The bytes a batch read of ``blocks`` holds at most (``wire.server.ByteRoom``)."""
        return await self.versions.batch_bytes(name, blocks,
                                               (await self.dataset(name)).block_size)

    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        """Whole blocks for a downstream spoke (a batch read): fetched first where missing.
        From another tier member (``X-Spokefs-Peer``): from the cache or the upstream only,
        at the member's priority; a member's handoff (``copy``): from the cache only."""
        peer = PEER_REQUEST.get()
        blocks, refused = await bound_blocks(self.versions, name, blocks)
        if peer == "copy":  # a member's handoff: what this member holds, nothing fetched
            parts = [await self._cached_block(name, key) for key in blocks]
        else:
            parts = await self._blocks_for(name, blocks, peer)
        parts = merge_parts(parts, refused)
        if peer is not None and self.tier is not None:
            self.tier.metrics.served.inc(sum(p.length for p in parts if p.status == 200))
        return parts

    async def _blocks_for(self, name: str, blocks: list[tuple[str, int]],
                          peer: str | None) -> list[BlockPart]:
        direct = peer is not None
        asker = PEER_FROM.get() if direct else None
        prio = PEER_PREFETCH if peer == "prefetch" else DEMAND
        futs = {key: self.fetcher.want(name, key, prio, direct, asker) for key in blocks
                if key not in self.store and self.fetcher.recent(key) is None}
        parts = []
        for key in blocks:
            loc = self.store.get(key) if key not in futs else None
            if loc is not None and loc.size < CHECK_IN_THREAD:
                # Resident and small: read and checked as it is sent (``LaterBlock``), so a
                # batch holds one such block at a time (a large one goes out by sendfile).
                read = functools.partial(self._later_block, name, key, direct, asker)
                parts.append(BlockPart(200, LaterBlock(loc.size, read),
                                       self.store.object_size(key[0]) or 0, loc.digest))
                continue
            try:
                parts.append(await self._whole_block(name, key, futs.get(key), direct, asker))
            except SpokeError as exc:
                parts.append(BlockPart.error(exc))
        return parts

    async def _later_block(self, name: str, key: BlockKey, direct: bool, asker: str | None
                           ) -> bytes | memoryview | None:
        """A batch's block as it is sent (fetched again if it left meanwhile); None cuts
        the batch (it cannot be had now, or came as a file region)."""
        try:
            part = await self._whole_block(name, key, None, direct, asker)
        except SpokeError as exc:
            log.warning("block %d of %s left a batch read unfinished: %s", key[1], key[0], exc)
            return None
        p = part.payload
        return p if part.status == 200 and isinstance(p, bytes | memoryview) else None

    async def _cached_block(self, name: str, key: BlockKey) -> BlockPart:
        """A block from this member's cache (or a fetch just done) for another member's
        handoff; a 503 frame when it is not here (the asker goes to the upstream)."""
        loc = self.store.get(key)
        view = await self._resident(key, 0, loc.size) if loc is not None else None
        if loc is not None and view is not None:
            return BlockPart(200, view, self.store.object_size(key[0]) or 0, loc.digest)
        block = self.fetcher.recent(key)
        if block is not None:
            return BlockPart(200, await self._fetched(key, block, 0, block.size),
                             block.object_size, block.digest)
        return BlockPart.error(UpstreamUnavailable(
            f"block {key[1]} of {key[0]} ({name}) is not cached on this member",
            self.config.upstream, "not cached"))

    async def _whole_block(self, name: str, key: BlockKey,
                           fut: asyncio.Future[Block] | None,
                           direct: bool = False, asker: str | None = None) -> BlockPart:
        what = f"block {key[1]} of {key[0]} ({name})"
        if fut is None:  # resident, else just fetched, else fetched now
            loc = self.store.get(key)
            if loc is not None:
                view = await self._resident(key, 0, loc.size)
                if view is not None:
                    self._count(name, 1, 0)
                    size = self.store.object_size(key[0]) or 0
                    return BlockPart(200, view, size, loc.digest)
            block = self.fetcher.recent(key)
            if block is not None:
                self._count(name, 1, 0)
                return BlockPart(200, await self._fetched(key, block, 0, block.size),
                                 block.object_size, block.digest)
            fut = self.fetcher.want(name, key, DEMAND, direct, asker)
        self._count(name, 0, 1)
        block = await self._wait_fetch(fut, what)
        return BlockPart(200, await self._fetched(key, block, 0, block.size),
                         block.object_size, block.digest)

    async def _wait_fetch(self, fut: asyncio.Future[Block], what: str) -> Block:
        """Wait for a fetch, but not past the deadline of upstream silence: a reader queued
        behind fetches that stalled (all slots taken, nothing failing yet) still gets its 503
        once the upstream has sent no byte for ``deadline`` seconds while it waited. A slow
        link keeps sending, so it only makes readers slower."""
        began = time.monotonic()
        while True:
            silent_since = max(began, self.fetcher.last_received)
            left = silent_since + self.config.deadline - time.monotonic()
            if left <= 0:
                cause = self.fetcher.last_error or "no answer (connections stalled)"
                raise UpstreamUnavailable(
                    f"upstream {self.config.upstream} sent nothing for "
                    f"{self.config.deadline:g}s while waiting for {what}: {cause}",
                    self.config.upstream, cause)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError:
                if fut.done():  # it ended just as our wait did: its own answer stands
                    return fut.result()

    def _prefetch(self, name: str, key: BlockKey, priority: int) -> None:
        self.fetcher.want(name, key, priority)

    def _fetch_finished(self, key: BlockKey, resident: bool) -> None:
        if self.prefetch is not None:
            self.prefetch.fetch_finished(key, resident)

    def _expected_size(self, name: str, key: BlockKey) -> int:
        """Bytes a fetch of this block will bring (the block size when the file is unknown)."""
        version, index = key
        cached = self._datasets.get(name)
        bs = cached[1].block_size if cached is not None else DEFAULT_BLOCK_SIZE
        size = self._sizes.get(version) or self.store.object_size(version)
        if size is None and self.prefetch is not None:
            known = self.prefetch.path_of(name, version)
            size = known[1] if known is not None else None
        return bs if size is None else max(0, min(bs, size - index * bs))

    def _frame_limit(self, name: str, key: BlockKey) -> int:
        """The most bytes a received frame of this block may hold: what the manifest says it
        holds once the dataset is known (its block size bounds it), else the largest block."""
        if name not in self._datasets:
            return MAX_BLOCK_SIZE
        return self._expected_size(name, key)

    # -- other processes reading the cache (replica workers, same-host mounts) --------------
    def cache_info(self) -> dict[str, object]:
        return {"dir": str(self.store.root.resolve()), "id": self.store.instance,
                "chunk_size": self.store.chunk_size}

    async def locate(self, name: str, keys: list[BlockKey], fetch: bool,
                     ctx: ReadContext | None = None, span: tuple[int, int] | None = None
                     ) -> list[dict[str, object] | None]:
        """Where each block is in the cache (spokefs.cache.shared), None where it is not.
        With ``fetch``, missing blocks are fetched first (as demand) and written; a block the
        cache could not keep stays None (the caller reads it through the spoke). ``ctx`` and
        ``span`` describe the read, for the planner, and make it count: a hit or a miss per
        block, as if this spoke had served it (what a replica or a mount reads elsewhere is
        part of what the spoke does)."""
        for version in dict.fromkeys(v for v, _ in keys):
            await self.versions.check(name, version)
        if ctx is not None and span is not None and self.prefetch is not None and keys:
            self._tell_planner(name, keys[0][0], span[0], span[1], ctx)
        for key in keys:
            self._expired(key)  # what the rules no longer allow is not located, but fetched
        waits: dict[BlockKey, asyncio.Future[Block]] = {}
        if fetch:
            waits = {k: self.fetcher.want(name, k, DEMAND) for k in keys
                     if k not in self.store and self.fetcher.recent(k) is None}
        if ctx is not None:
            self._count(name, len(keys) - len(waits), len(waits))
        out: list[dict[str, object] | None] = []
        for key in keys:
            loc = self.store.get(key)
            if loc is None and fetch:
                block = self.fetcher.recent(key)
                if block is None:
                    fut = waits.get(key) or self.fetcher.want(name, key, DEMAND)
                    block = await self._wait_fetch(fut, f"block {key[1]} of {key[0]} ({name})")
                if block.written is not None:
                    await asyncio.shield(block.written)
                loc = self.store.get(key)
            out.append(None if loc is None else self._loc_doc(key, loc, key in waits))
        return out

    def _loc_doc(self, key: BlockKey, loc: Loc, fetched: bool = False) -> dict[str, object]:
        return {"seg": loc.seg.id, "offset": loc.offset, "size": loc.size,
                "digest": loc.digest.hex(), "chunks": loc.chunks.hex(),
                "object_size": self.store.object_size(key[0]), "fetched": fetched}

    NEWS_LIMIT = 1024  # feed entries looked at per answer (~1 ms to encode)

    def news(self, name: str, cursor: int) -> dict[str, object]:
        """Blocks of dataset ``name`` that became resident after ``cursor`` (and are still
        where they were put), for a same-host reader to know before it asks: ``{"cursor":
        ask with this next, "blocks": [[version, index, location], ...], "more": bool}``."""
        entries, nxt = self.feed.since(cursor, self.NEWS_LIMIT)
        blocks = [[k[0], k[1], self._loc_doc(k, loc)] for k, loc in entries
                  if loc.dataset == name and self.store.get(k) is loc]
        return {"cursor": nxt, "blocks": blocks, "more": nxt < self.feed.end}

    def recheck(self, keys: list[BlockKey]) -> None:
        """Another process found these blocks' bytes wrong: check them here; a damaged one
        is dropped and counted (and fetched again by whoever asks next)."""
        for key in keys:
            loc = self.store.get(key)
            if loc is not None:
                self.store.read(key, 0, loc.size)

    def _count(self, dataset: str, hits: int, misses: int) -> None:
        """Blocks readers found resident (hits) or waited for (misses), in all and per
        dataset (per dataset in /v1/status only: a label would cost every read more)."""
        if hits:
            self.metrics.hits.inc(hits)
        if misses:
            self.metrics.misses.inc(misses)
        row = self._hits_by_dataset.get(dataset)
        if row is None:
            row = self._hits_by_dataset[dataset] = [0, 0]
        row[0] += hits
        row[1] += misses

    def reads_elsewhere(self, name: str, reads: list[tuple[str, int, int, ReadContext]],
                        by_mount: bool = False, extra_bytes: int = 0) -> None:
        """Reads served by another process from the cache (version, start, end, context):
        the planner learns from them as from its own, and each block counts as a hit; the
        bytes count as served (a replica worker's) or short-circuited (a mount's)."""
        cached = self._datasets.get(name)
        bs = cached[1].block_size if cached is not None else DEFAULT_BLOCK_SIZE
        nbytes = extra_bytes
        for version, start, end, ctx in reads:
            if end > start:
                nbytes += end - start
                n = 0
                for i in blocks_in_range(start, end, bs):
                    self.store.touch((version, i))
                    n += 1
                self._count(name, n, 0)
            if self.prefetch is not None:
                self._tell_planner(name, version, start, end, ctx)
        if by_mount:
            self.metrics.short_circuit_bytes.inc(nbytes)
        elif self.served is not None:
            self.served.inc(nbytes)

    async def before_scrape(self) -> None:
        """Ask every replica worker to report what it counted, so /metrics and /v1/status
        are exact at the moment they are read (a replica reports every 50 ms otherwise)."""
        from spokefs.spoke.workers import replica_sockets

        async def flush(path: Path) -> None:
            client = UpstreamClient("http://spoke-replica", max_connections=1, token=None,
                                    request_timeout=2.0, unix_socket=str(path))
            try:
                await client.post_json("/v1/workers/flush", {})
            except (Transient, SpokeError) as exc:  # restarting, or gone: its counts wait
                log.debug("replica %s did not report: %s", path.name, exc)
            finally:
                await client.close()

        socks = replica_sockets(self.store.root)
        if socks:
            await asyncio.gather(*(flush(p) for p in socks))

    def add_counts(self, counts: dict[str, int]) -> None:
        """What a replica worker counted since it last said (bytes served; its hits and
        misses come with its reads and locates): /metrics shows the whole spoke."""
        if self.served is not None:
            self.served.inc(max(0, int(counts.get("served_bytes", 0))))

    def _tell_planner(self, name: str, version: str, start: int, end: int,
                      ctx: ReadContext) -> None:
        assert self.prefetch is not None
        known = (ctx.path, ctx.size) if ctx.path is not None else self.prefetch.path_of(
            name, version)
        if known is not None and known[1] is not None:
            self.prefetch.on_read(name, known[0], version, known[1], start, end, ctx.reader,
                                  ctx.job)

    # -- warm-up, residency, purge -----------------------------------------------------------
    # -- announced orders (the routes' way to the planner) --------------------------------------
    def announce(self, m: Manifest, job: str, epoch: int, files: list[int],
                 ranges: list[tuple[int, int]] | None) -> None:
        """A job's order of ``m``'s files for an epoch (checked whole by the caller)."""
        if self.prefetch is None:
            raise BadRequest("this spoke runs without prefetch (--no-prefetch)")
        self.prefetch.use_manifest(m)
        self.prefetch.announce(m.dataset, job, epoch, files, ranges)

    def epoch(self, dataset: str, job: str, epoch: int) -> None:
        if self.prefetch is not None:
            self.prefetch.epoch(dataset, job, epoch)

    def end_job(self, dataset: str, job: str) -> None:
        if self.prefetch is not None:
            self.prefetch.job_ended(dataset, job)

    def warm(self, m: Manifest, files: list[int], pin: bool = False) -> dict[str, int]:
        """Fetch every block of ``files`` in the background (behind demand reads), optionally
        pinned; returns what it will fetch. Progress: ``residency``."""
        bs = m.block_size
        keys = [(m.versions[i], b) for i in files for b in range(block_count(m.sizes[i], bs))]
        if pin:
            self._pin_warm(m, files)
        todo = [k for k in keys if k not in self.store]
        self.tasks.spawn(self._warm(m.dataset, todo), "warm")
        return {"files": len(files), "blocks": len(keys), "bytes": sum(m.sizes[i] for i in files),
                "blocks_to_fetch": len(todo)}

    def _file_blocks(self, m: Manifest, files: list[int]) -> list[tuple[BlockKey, int]]:
        bs = m.block_size
        return [((m.versions[i], b), min(bs, m.sizes[i] - b * bs)) for i in files
                for b in range(block_count(m.sizes[i], bs))]

    def _pin_warm(self, m: Manifest, files: list[int]) -> None:
        """Pin the blocks of ``files`` for ``pin_ttl`` (again: the pin is renewed). Refused,
        with nothing pinned, if warm-ups would then hold more than ``pin_share`` of the
        cache: a cache that can evict nothing serves every other read by pass-through."""
        blocks = self._file_blocks(m, files)
        new = sum(size for key, size in dict(blocks).items() if key not in self._warm_pins)
        limit = int(self.config.pin_share * self.store.capacity)
        if self.warm_pinned_bytes + new > limit:
            raise BadRequest(
                f"pinning these files would hold {self.warm_pinned_bytes + new} bytes of a "
                f"{self.store.capacity}-byte cache; warm-ups may pin at most {limit} "
                "(unpin others, or warm without pinning)")
        until = time.monotonic() + self.config.pin_ttl
        for key, size in blocks:
            if key not in self._warm_pins:
                self.store.pin(key)
                self.warm_pinned_bytes += size
            self._warm_pins[key] = (size, until)

    def unpin_warm(self, m: Manifest, files: list[int]) -> dict[str, int]:
        """Release warm-up pins of ``files`` (the blocks stay cached, now evictable)."""
        released = 0
        for key, _ in self._file_blocks(m, files):
            held = self._warm_pins.pop(key, None)
            if held is not None:
                self.store.unpin(key)
                self.warm_pinned_bytes -= held[0]
                released += 1
        return {"blocks_unpinned": released, "warm_pinned_bytes": self.warm_pinned_bytes}

    def _expire_warm_pins(self, now: float) -> None:
        lapsed = [k for k, (_, until) in self._warm_pins.items() if until <= now]
        for key in lapsed:
            size, _ = self._warm_pins.pop(key)
            self.store.unpin(key)
            self.warm_pinned_bytes -= size
        if lapsed:
            log.info("warm-up pins lapsed on %d blocks (--pin-ttl)", len(lapsed))

    async def _warm(self, name: str, keys: list[BlockKey]) -> None:
        # A bounded window of fetches queued at a time: a million blocks is not a million
        # futures; enough that batches stay full.
        window = asyncio.Semaphore(max(1024, 4 * self.config.max_inflight))
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

    RESIDENCY_SLICE = 20_000  # files looked at between turns of the event loop

    async def residency(self, m: Manifest, files: list[int]) -> dict[str, object]:
        """How much of ``files`` is cached. A million files take ~0.5 s to look at: done in
        slices, letting other requests run between them (the index is the loop's to read)."""
        bs = m.block_size
        total = resident = full = 0
        store = self.held  # in a tier, blocks other members were seen to hold count too
        for n, i in enumerate(files):
            if n and n % self.RESIDENCY_SLICE == 0:
                await asyncio.sleep(0)
            size = m.sizes[i]
            total += size
            v = m.versions[i]
            have = sum(min(bs, size - b * bs) for b in range(block_count(size, bs))
                       if (v, b) in store)
            resident += have
            full += have == size
        return {"files": len(files), "bytes": total, "resident_bytes": resident,
                "resident_files": full, "fraction": resident / total if total else 1.0}

    async def purge(self, name: str | None, keep: list[str] | None = None) -> int:
        """Drop cached blocks: all, a dataset's, or (``keep``: snapshot ids or "latest") a
        dataset's blocks of file versions in none of those snapshots -- what a source change
        left behind (rewritten or deleted files), without touching the current ones."""
        versions: set[str] = set()
        if keep is not None:
            if name is None:
                raise BadRequest("purging by kept snapshots needs a dataset")
            for snap in keep:
                m = await self.manifest(name, await self.resolve(name, snap))
                versions.update(m.versions)
        return await self._drop_all(self.store.purge_keys(name, versions))

    async def purge_versions(self, name: str, versions: set[str]) -> int:
        """Drop the cached blocks of these file versions (named files or folders, now)."""
        return await self._drop_all([k for k in self.store.purge_keys(name) if k[0] in versions])

    @property
    def _retire_period(self) -> float:
        return max(1.0, min(60.0, self.config.stale_after / 4))

    async def _retire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._retire_period)
            await self.retire_stale()

    async def retire_stale(self) -> int:
        """Drop the cached blocks of file versions no snapshot in use holds -- files the
        source changed or removed -- so they leave within ``stale_after``; the bytes freed.

        In use: each dataset's latest snapshot and every snapshot a reader named (a read, a
        manifest, an order, a warm-up, a mount's or replica's report) within the last
        ``stale_after`` less one pass. Warm-up pins hold their blocks. A dataset is skipped
        while the upstream cannot confirm its latest snapshot or a manifest in use cannot be
        loaded: nothing leaves on a guess. A pass over a dataset whose in-use set did not
        change since the last one costs nothing (only reads of a snapshot bring its blocks,
        and a read marks it in use)."""
        now = time.monotonic()
        window = self.config.stale_after - self._retire_period
        used = self._snapshots_used
        for key in [k for k, t in used.items() if now - t > window]:
            del used[key]
        freed = 0
        for ds in [d for d, n in self.store.dataset_bytes.items() if n > 0]:
            try:
                info = await self.dataset(ds)
                if info.latest is None or ds in self._unconfirmed:
                    continue
                snaps = frozenset({info.latest, *(s for d, s in used if d == ds)})
                if self._retired_for.get(ds) == snaps:
                    continue
                keep: set[str] = set()
                for snap in snaps:
                    keep.update((await self.manifest(ds, snap)).versions)
            except SpokeError as exc:
                log.debug("stale blocks of %s stay for now: %s", ds, exc)
                continue
            keys = []
            for n, key in enumerate(list(self.store.keys())):
                if n % 50_000 == 49_999:
                    await asyncio.sleep(0)  # millions of blocks: readers go on meanwhile
                if key[0] in keep or key in self._warm_pins:
                    continue
                loc = self.store.get(key)
                if loc is not None and loc.dataset == ds:
                    keys.append(key)
            if keys:
                n = await self._drop_all(keys, "stale")
                freed += n
                self.metrics.stale_blocks.inc(len(keys))
                log.info("%s: dropped %d blocks (%s) of file versions no snapshot in use holds "
                         "(changed or removed at the source)", ds, len(keys), format_size(n))
            self._retired_for[ds] = snaps
        self._retire_passes += 1
        return freed

    async def _drop_all(self, keys: list[BlockKey], reason: str = "purge") -> int:
        """Drop blocks (a purge, or stale versions); the bytes freed."""
        if reason == "purge":
            self.audit.purging(keys)  # their removals are recorded as purged
        freed = 0
        for n, key in enumerate(keys):
            freed += self.store.size_of(key)
            self.store.drop(key, reason)
            if n % 2000 == 1999:
                await asyncio.sleep(0)  # a big purge must not stop every reader meanwhile
        # Done means done: the space is free and the index says so when this returns.
        await asyncio.to_thread(self.store.worker.flush)
        return freed

    async def inventory(self) -> list[dict[str, object]]:
        """What this spoke holds, per dataset and per snapshot it keeps a manifest of:
        resident files and bytes, and the least and most recent use of its blocks."""
        counts = self.store.by_dataset()
        times = await asyncio.to_thread(self.store.use_times)
        folder = self.store.root / "manifests"
        out: list[dict[str, object]] = []
        for ds in sorted(set(counts) | {p.name for p in folder.glob("*") if p.is_dir()}):
            blocks, nbytes = counts.get(ds, [0, 0])
            used = times.get(ds)
            snaps = []
            for path in sorted((folder / ds).glob("*.json.gz")):
                snap = path.name.removesuffix(".json.gz")
                try:
                    m = await self.manifest(ds, snap)
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

    # -- operator view -----------------------------------------------------------------------
    async def status(self) -> dict[str, object]:
        await self.before_scrape()
        m = self.metrics
        hits, misses = m.hits._value.get(), m.misses._value.get()
        q = self.fetcher.queue
        return {
            "role": self.role, "upstream": self.config.upstream,
            "upstream_error": self.fetcher.last_error or self._last_upstream_error,
            "uptime_s": round(time.time() - self.started, 1),
            "cache": {**self.store.stats(), "warm_pinned_bytes": self.warm_pinned_bytes},
            "datasets": {**self.dataset_rules.describe(),
                         "resident_bytes": dict(sorted(self.store.dataset_bytes.items())),
                         "hits_misses": {ds: list(hm) for ds, hm
                                         in sorted(self._hits_by_dataset.items())}},
            "hits": hits, "misses": misses,
            "hit_ratio": hits / (hits + misses) if hits + misses else None,
            "inflight": q.active, "queued": q.queued,
            "inflight_bytes": q.inflight_bytes,
            "link": self.link.stats() if self.link is not None else None,
            "deadline_s": self.config.deadline,
            "prefetch": self.prefetch.stats() if self.prefetch is not None else None,
            "jobs": self.jobs.describe(time.monotonic()),
            "stale": self._stale_status(),
            "tier": self._tier_status(),
        }

    def _stale_status(self) -> dict[str, object]:
        """What keeps old file versions cached: the snapshots in use, per dataset."""
        now = time.monotonic()
        in_use: dict[str, list[str]] = {}
        for (ds, snap), t in sorted(self._snapshots_used.items()):
            if now - t <= self.config.stale_after:
                in_use.setdefault(ds, []).append(snap)
        return {"after_s": self.config.stale_after, "passes": self._retire_passes,
                "snapshots_in_use": in_use}

    def _members_changed(self) -> None:
        """Members joined or left: shares moved (copies may now be owned, and the reverse),
        and blocks this member now owns are likely held by others: a handoff."""
        if isinstance(self.store.policy, CopiesFirst):
            self.tasks.spawn(self._reclassify_copies(), "tier-copies")
        if self.tier is not None:
            self.tier.open_handoff(self.config.tier_handoff)

    async def _reclassify_copies(self) -> None:
        """Which cached blocks are copies of other members' blocks (they leave first) and
        which this member owns, by the ranking: at start (the index does not say) and when
        members join or leave. In slices: millions of blocks, readers go on meanwhile."""
        policy, tier = self.store.policy, self.tier
        assert isinstance(policy, CopiesFirst) and tier is not None
        router = tier.router
        keys = policy.resident_keys()
        moved = 0
        for i in range(0, len(keys), 20_000):
            moved += policy.reclassify(keys[i:i + 20_000],
                                       lambda key: router.owner(key) != router.self_url)
            await asyncio.sleep(0)
        if moved:
            log.info("tier: %d cached blocks changed class (copies of other members' blocks "
                     "leave first; %s of copies now)", moved, format_size(policy.copy_bytes))

    def _tier_status(self) -> dict[str, object] | None:
        if self.tier is None:
            return None
        policy = self.store.policy
        copies = policy.copy_bytes if isinstance(policy, CopiesFirst) else None
        return {**self.tier.status(), "copies": copies is not None, "copy_bytes": copies or 0}


class _Held:
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


def _make_tier(config: SpokeConfig, registry: CollectorRegistry) -> Tier:
    from spokefs.tier.sources import parse_static

    if config.advertise is None:
        raise ConfigError("a spoke tier needs --advertise URL (this member's URL as the "
                          "others name it)")
    members = parse_static(config.tier) if config.tier else [config.advertise]
    lookup, source = make_lookup(config.tier_dns, config.tier_kubernetes, config.advertise)
    return Tier(config.advertise, members, registry, token=config.tier_token(),
                timeout=config.tier_timeout, lookup=lookup, source=source,
                refresh=config.tier_refresh, borrow_bytes=config.tier_borrow,
                max_connections=config.max_inflight)


_scratch = threading.local()


def _check(loc: Loc, lo: int, hi: int, chunk: int) -> bool:
    """Whether bytes [lo, hi) of a block match their digests (a checker thread: its own
    reused scratch buffer, so a large check costs no allocation)."""
    need = hi - lo + 2 * chunk
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < need:
        buf = _scratch.buf = bytearray(max(need, 4 << 20))
    return read_loc(loc, lo, hi, chunk, buf) is not None


def _policy(name: str, capacity: int) -> EvictionPolicy:
    cls = POLICIES.get(name)
    wants_capacity = cls is not None and "capacity" in inspect.signature(cls).parameters
    return make_policy(name, **({"capacity": capacity} if wants_capacity else {}))
