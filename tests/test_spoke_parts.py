"""The spoke's parts in one process, in milliseconds: the read path (``spoke.reads``: resident,
just fetched, in flight, fetched, failed, evicted while read), the metadata twin
(``spoke.metadata``), warm-up pins (``spoke.warmup``) and the per-dataset rules
(``spoke.retention``), each over a real block store in a temporary folder.

What the fakes here replace is the hub over HTTP, and only that: ``FakeFetchPath`` stands in
for ``spoke.fetcher.Fetcher`` (batch reads from the upstream or a tier member), implementing
the ``FetchPath`` interface the read path uses; ``FakeHub`` for the metadata client
(``wire.client.UpstreamClient``); ``Clock`` for the monotonic clock the parts are given. The
process-level tests (test_spoke.py, test_tier.py, test_stale.py, ...) prove the whole, with
real servers on sockets.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from spokefs.audit import Audit
from spokefs.cache.store import BlockStore
from spokefs.errors import NotFound, SpokeError, Transient, UpstreamUnavailable
from spokefs.integrity import block_digest
from spokefs.manifest import Manifest
from spokefs.policy import BlockKey, make_policy
from spokefs.spoke.datasets import DatasetConfig
from spokefs.spoke.fetcher import Block
from spokefs.spoke.metadata import Metadata
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.reads import (
    CHECK_IN_THREAD,
    DEMAND,
    PEER_PREFETCH,
    WARM,
    Counts,
    FetchPath,
    Reads,
)
from spokefs.spoke.retention import Retention
from spokefs.spoke.tier import Peer
from spokefs.spoke.upstreams import Routes, UpstreamSpec
from spokefs.spoke.warmup import Warmups
from spokefs.tasks import Tasks
from spokefs.wire.backend import FileSegment, LaterBlock, ReadContext, Segment

BS = 64 << 10  # the dataset's block size here
DS = "ds"


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeFetchPath:
    """The upstream's blocks in memory, behind the interface ``Reads`` fetches through: one
    fetch per block however many ask (single flight, as ``Fetcher.want``), answered on the
    next turn of the loop, or when the test says (``hold``); ``fail`` makes a block's next
    fetch fail with that error."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.asked: list[tuple[BlockKey, int, bool, str | None]] = []
        self.inflight: dict[BlockKey, asyncio.Future[Block]] = {}
        self.writing: dict[BlockKey, Block] = {}  # handed out, not yet in the store
        self.fail: dict[BlockKey, SpokeError] = {}
        self.hold = False
        self.passed: dict[BlockKey, bytes] = {}
        self.last_error: str | None = None
        self.last_received = 0.0

    def block(self, key: BlockKey) -> Block:
        bs = BLOCK_SIZE.get(key[0], BS)
        data = self.files[key[0]][key[1] * bs:(key[1] + 1) * bs]
        return Block(memoryview(bytes(data)), block_digest(data), len(self.files[key[0]]))

    def want(self, dataset: str, key: BlockKey, priority: int, direct: bool = False,
             asker: str | None = None) -> asyncio.Future[Block]:
        fut = self.inflight.get(key)
        if fut is not None:
            return fut
        self.asked.append((key, priority, direct, asker))
        fut = self.inflight[key] = asyncio.get_running_loop().create_future()
        if not self.hold:
            asyncio.get_running_loop().call_soon(self.answer, key)
        return fut

    def answer(self, key: BlockKey) -> None:
        fut = self.inflight.pop(key)
        error = self.fail.pop(key, None)
        if error is not None:
            self.last_error = str(error)
            fut.set_exception(error)
            return
        fut.set_result(self.block(key))

    def recent(self, key: BlockKey) -> Block | None:
        return self.writing.get(key)


def _content(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


FILES = {"a" * 32: _content(3 * BS + 100, 1), "b" * 32: _content(BS, 2),
         "c" * 32: _content(CHECK_IN_THREAD + BS, 3)}
A, B, C = FILES
BLOCK_SIZE = {C: 2 << 20}  # C is one block, large enough to be sent from the file


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[BlockStore]:
    s = BlockStore(tmp_path / "cache", 64 << 20, make_policy("lru"), fsync=False)
    await asyncio.to_thread(s.open, asyncio.get_running_loop().call_soon_threadsafe)
    yield s
    await asyncio.to_thread(s.close)


@pytest.fixture
def upstream() -> FakeFetchPath:
    return FakeFetchPath(FILES)


@pytest.fixture
def reads(store: BlockStore, upstream: FakeFetchPath) -> Iterator[Reads]:
    path: FetchPath = upstream  # the interface the read path takes
    r = Reads(store, path, Counts(SpokeMetrics(CollectorRegistry())), upstream="http://hub",
              deadline=5.0, read_window=4 * BS)
    yield r
    r.close()


async def put(store: BlockStore, upstream: FakeFetchPath, key: BlockKey) -> None:
    """Make ``key`` resident, as a fetch does once its block is written."""
    block = upstream.block(key)
    res = store.reserve(key, block.size, DS)
    assert res is not None
    done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    store.write(res, block.view, block.digest, done.set_result)
    assert await done
    store.set_object_size(key[0], block.object_size)


def data(seg: Segment) -> bytes:
    if isinstance(seg, FileSegment):
        return os.pread(seg.file.fileno(), seg.count, seg.offset)
    assert not isinstance(seg, LaterBlock)
    return bytes(seg)


async def read_all(reads: Reads, version: str, start: int = 0, end: int | None = None
                   ) -> bytes:
    end = len(FILES[version]) if end is None else end
    out = bytearray()
    async for seg in reads.range(DS, version, start, end, BS, ReadContext()):
        out += data(seg)
        if isinstance(seg, FileSegment):
            seg.release()
    return bytes(out)


def hits_misses(reads: Reads) -> tuple[int, int]:
    return reads.counts.hits, reads.counts.misses


# -- the read path's branches -----------------------------------------------------------------
async def test_resident_blocks_are_read_from_the_cache(reads: Reads, store: BlockStore,
                                                       upstream: FakeFetchPath) -> None:
    await put(store, upstream, (B, 0))
    assert await read_all(reads, B, 10, 5000) == FILES[B][10:5000]
    assert upstream.asked == []
    assert hits_misses(reads) == (1, 0)
    assert reads.counts.by_dataset == {DS: [1, 0]}


async def test_just_fetched_blocks_are_served_from_their_buffer(
        reads: Reads, upstream: FakeFetchPath) -> None:
    upstream.writing[(B, 0)] = upstream.block((B, 0))  # handed out, being written
    assert await read_all(reads, B) == FILES[B]
    assert upstream.asked == []
    assert hits_misses(reads) == (1, 0)


async def test_missing_blocks_are_fetched_a_window_ahead_at_demand(
        reads: Reads, upstream: FakeFetchPath) -> None:
    assert await read_all(reads, A) == FILES[A]
    assert [(k, p) for k, p, _, _ in upstream.asked] == [((A, i), DEMAND) for i in range(4)]
    assert hits_misses(reads) == (0, 4)


async def test_two_readers_of_a_block_in_flight_share_one_fetch(
        reads: Reads, upstream: FakeFetchPath) -> None:
    upstream.hold = True
    first = asyncio.create_task(read_all(reads, B))
    second = asyncio.create_task(read_all(reads, B, 100, 200))
    while not upstream.inflight:
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # both readers are waiting now
    assert [k for k, *_ in upstream.asked] == [(B, 0)]
    upstream.answer((B, 0))
    assert await first == FILES[B]
    assert await second == FILES[B][100:200]
    assert len(upstream.asked) == 1
    assert hits_misses(reads) == (0, 2)


async def test_a_failed_fetch_reaches_the_reader_and_the_next_read_asks_again(
        reads: Reads, upstream: FakeFetchPath) -> None:
    upstream.fail[(B, 0)] = UpstreamUnavailable("hub down", "http://hub", "refused")
    with pytest.raises(UpstreamUnavailable, match="hub down"):
        await read_all(reads, B)
    assert await read_all(reads, B) == FILES[B]  # not remembered as failed: asked again
    assert [k for k, *_ in upstream.asked] == [(B, 0), (B, 0)]


async def test_a_block_evicted_after_the_read_saw_it_resident_is_fetched(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    await put(store, upstream, (A, 0))
    await put(store, upstream, (A, 1))
    segments = reads.range(DS, A, 0, 2 * BS, BS, ReadContext())
    assert data(await anext(segments)) == FILES[A][:BS]
    assert upstream.asked == []  # both were resident when the read asked ahead
    store.drop((A, 1), "test")  # evicted (or purged) before its turn
    assert data(await anext(segments)) == FILES[A][BS:2 * BS]
    assert [k for k, *_ in upstream.asked] == [(A, 1)]
    assert hits_misses(reads) == (1, 1)


async def test_a_large_block_evicted_while_it_is_sent_stays_readable_until_released(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    await put(store, upstream, (C, 0))
    seg = (await reads.block(DS, (C, 0), lo=0, hi=CHECK_IN_THREAD)).segment
    assert isinstance(seg, FileSegment)  # checked in a thread, then sent from the file
    store.drop((C, 0), "test")
    assert (C, 0) not in store
    assert data(seg) == FILES[C][:CHECK_IN_THREAD]  # held: the region was not freed
    seg.release()


async def test_a_damaged_resident_block_is_dropped_and_fetched(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    await put(store, upstream, (B, 0))
    loc = store.get((B, 0))
    assert loc is not None
    fd = os.open(loc.seg.path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 16, loc.offset + 100)
    finally:
        os.close(fd)
    assert await read_all(reads, B) == FILES[B]
    assert [k for k, *_ in upstream.asked] == [(B, 0)]
    assert hits_misses(reads) == (0, 1)


async def test_a_silent_upstream_fails_the_wait_at_the_deadline(
        reads: Reads, upstream: FakeFetchPath) -> None:
    upstream.hold = True
    upstream.last_error = "connection reset"
    reads.deadline = 0.05
    with pytest.raises(UpstreamUnavailable, match=r"sent nothing for 0\.05s.*connection reset"):
        await read_all(reads, B)


async def test_object_size_fetches_block_zero_and_the_read_counts_it_a_miss(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    assert await reads.object_size(DS, A) == len(FILES[A])
    await put(store, upstream, (A, 0))  # written, as the fetch path does
    assert await read_all(reads, A, 0, BS) == FILES[A][:BS]
    assert hits_misses(reads) == (0, 1)
    assert await reads.object_size(DS, A) == len(FILES[A])  # remembered: no second fetch
    assert len(upstream.asked) == 1


# -- batch reads and tier members --------------------------------------------------------------
async def test_a_batch_read_sends_small_resident_blocks_as_they_are_read(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    await put(store, upstream, (B, 0))
    parts = await reads.blocks(DS, [(B, 0), (A, 3)])
    assert [p.status for p in parts] == [200, 200]
    later = parts[0].payload
    assert isinstance(later, LaterBlock)
    assert bytes(await later.read() or b"") == FILES[B]
    assert data(parts[1].payload) == FILES[A][3 * BS:]
    assert parts[1].object_size == len(FILES[A])
    assert parts[1].digest == block_digest(FILES[A][3 * BS:])
    assert [k for k, *_ in upstream.asked] == [(A, 3)]


async def test_a_members_prefetch_is_fetched_upstream_at_its_priority(
        reads: Reads, upstream: FakeFetchPath) -> None:
    member = "http://10.0.0.2:9000"
    parts = await reads.blocks(DS, [(A, 0)], Peer("prefetch", member))
    assert parts[0].status == 200
    assert upstream.asked == [((A, 0), PEER_PREFETCH, True, member)]


async def test_a_handoff_answers_from_the_cache_only(
        reads: Reads, store: BlockStore, upstream: FakeFetchPath) -> None:
    await put(store, upstream, (B, 0))
    parts = await reads.blocks(DS, [(B, 0), (A, 0)], Peer("copy", "http://10.0.0.2:9000"))
    assert parts[0].status == 200 and data(parts[0].payload) == FILES[B]
    assert parts[1].status == 503 and b"upstream_unavailable" in bytes(parts[1].payload)
    assert upstream.asked == []  # nothing fetched for a handoff
    assert hits_misses(reads) == (0, 0)  # no reader of this spoke asked


async def test_a_failed_block_is_an_error_frame_not_a_failed_batch(
        reads: Reads, upstream: FakeFetchPath) -> None:
    upstream.fail[(A, 1)] = UpstreamUnavailable("gone", "http://hub", "refused")
    parts = await reads.blocks(DS, [(A, 0), (A, 1)])
    assert [p.status for p in parts] == [200, 503]


# -- metadata: the upstream's datasets, as last seen -------------------------------------------
class FakeHub:
    """The metadata half of a hub in memory, behind the calls ``Metadata`` makes of
    ``UpstreamClient``; ``down`` makes every call fail as a refused connection does."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.calls: list[str] = []
        self.down = False

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if self.down:
            raise Transient("connection refused")

    async def get_json(self, path: str) -> dict[str, object]:
        self._call(path)
        m = self.manifest
        if path == "/v1/datasets":
            return {"datasets": [{"name": DS}]}
        return {"name": DS, "block_size": m.block_size, "latest": m.snapshot,
                "snapshots": [{"id": m.snapshot}]}

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        self._call(f"manifest {snap_id}")
        if snap_id != self.manifest.snapshot:
            raise NotFound(f"no snapshot {snap_id}")
        return self.manifest.encode()


def a_manifest() -> Manifest:
    paths, versions = ["a.bin", "b.bin"], [A, B]
    sizes = [len(FILES[v]) for v in versions]
    m = Manifest(DS, "", 0.0, BS, paths, sizes, [0o644] * 2, [1] * 2, versions, [""])
    return Manifest(DS, m.content_id(), 0.0, BS, paths, sizes, [0o644] * 2, [1] * 2,
                    versions, [""])


@pytest.fixture
async def tasks() -> AsyncIterator[Tasks]:
    t = Tasks()
    yield t
    await t.close()


def make_metadata(hub: FakeHub, store: BlockStore, tasks: Tasks, clock: Clock) -> Metadata:
    return Metadata(Routes([UpstreamSpec("http://hub")]), [hub],  # type: ignore[list-item]
                    store, tasks, SpokeMetrics(CollectorRegistry()),
                    deadline=0.2, latest_ttl=10.0, clock=clock)


async def test_dataset_info_is_trusted_for_its_ttl_then_asked_again(
        store: BlockStore, tasks: Tasks) -> None:
    hub, clock = FakeHub(a_manifest()), Clock()
    md = make_metadata(hub, store, tasks, clock)
    info = await md.dataset(DS)
    clock.now += 9.0
    assert await md.dataset(DS) is info
    assert hub.calls == [f"/v1/datasets/{DS}"]
    clock.now += 2.0  # past latest_ttl
    await md.dataset(DS)
    assert len(hub.calls) == 2


async def test_an_upstream_down_serves_the_last_known_state_unconfirmed(
        store: BlockStore, tasks: Tasks) -> None:
    m = a_manifest()
    hub, clock = FakeHub(m), Clock()
    md = make_metadata(hub, store, tasks, clock)
    assert (await md.manifest(DS, await md.resolve(DS, "latest"))).versions == m.versions
    hub.down = True
    # A new twin (a restarted spoke) over the same folder: dataset and manifest from disk.
    again = make_metadata(hub, store, tasks, clock)
    assert (await again.dataset(DS)).latest == m.snapshot
    assert DS in again.unconfirmed  # nothing leaves the cache on a guess
    assert (await again.manifest(DS, m.snapshot)).paths == m.paths
    with pytest.raises(UpstreamUnavailable, match="never seen"):
        await again.dataset("other")


async def test_snapshots_named_by_readers_count_as_in_use(
        store: BlockStore, tasks: Tasks) -> None:
    m = a_manifest()
    md = make_metadata(FakeHub(m), store, tasks, Clock())
    assert await md.resolve(DS, "latest") == m.snapshot
    md.snapshots_used(DS, ["latest", "0" * 12])  # "latest" is always in use: not recorded
    assert md.in_use(DS) == [m.snapshot, "0" * 12]


# -- warm-up pins and the dataset rules ----------------------------------------------------------
async def test_warm_up_pins_lapse_after_their_ttl(store: BlockStore, upstream: FakeFetchPath,
                                                  tasks: Tasks) -> None:
    m, clock = a_manifest(), Clock()
    md = make_metadata(FakeHub(m), store, tasks, clock)
    warm = Warmups(store, upstream, store, md, tasks,  # type: ignore[arg-type]
                   SpokeMetrics(CollectorRegistry()), pin_ttl=60.0, pin_share=0.8,
                   max_inflight=4, clock=clock)
    plan = warm.warm(m, [1], pin=True)
    assert plan == {"files": 1, "blocks": 1, "bytes": BS, "blocks_to_fetch": 1}
    assert (B, 0) in warm and warm.pinned_bytes == BS
    while upstream.inflight or not upstream.asked:
        await asyncio.sleep(0)
    assert upstream.asked == [((B, 0), WARM, False, None)]
    clock.now += 59.0
    warm.expire()
    assert (B, 0) in warm
    clock.now += 2.0
    warm.expire()
    assert (B, 0) not in warm and warm.pinned_bytes == 0


async def test_rules_keep_denied_datasets_out_and_expire_old_blocks(
        store: BlockStore, upstream: FakeFetchPath, tasks: Tasks, tmp_path: Path) -> None:
    rules_file = tmp_path / "rules.toml"
    rules_file.write_text(f'[datasets.{DS}]\nttl = "1h"\n\n[datasets.secret]\n'
                          'cache = "deny"\n')
    now = [0.0]
    md = make_metadata(FakeHub(a_manifest()), store, tasks, Clock())
    retention = Retention(store, md, DatasetConfig(rules_file),
                          SpokeMetrics(CollectorRegistry()), Audit(), set(), stale_after=600.0,
                          wall=lambda: now[0])
    assert not retention.admit("secret", 100)
    assert retention.admit(DS, 100)
    await put(store, upstream, (B, 0))
    loc = store.get((B, 0))
    assert loc is not None
    now[0] = loc.stored + 3599.0
    assert not retention.expired((B, 0)) and (B, 0) in store
    now[0] = loc.stored + 3601.0
    assert retention.expired((B, 0)) and (B, 0) not in store
