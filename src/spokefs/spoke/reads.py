"""The spoke's read path: one way to a block, ``Reads.block``: resident, else just fetched,
else fetched.

- Resident: its bytes are read from the segment file and checked against their chunk
  digests: a small range into a buffer of its own, a range of ``CHECK_IN_THREAD`` or more in
  a checker thread, then sent with sendfile from the same region, the block held (not
  evicted, its region not freed) until the send is done. A block its dataset's rules no
  longer allow (past its time to live, or denied since) is dropped and fetched again; a
  damaged one is dropped, counted and fetched again.
- Just fetched: handed out by the fetch path and still being written, or (tier) got from
  another member and held in memory a while (``FetchPath.recent``).
- Fetched: through the fetch path (``spoke.fetcher``: one fetch per block however many
  wait for it), waited for no longer than the deadline of upstream silence.

Range reads (``range``), batch reads (``blocks``) and same-host locates (``spoke.local``) all
take this path. A tier member's batch read says what it is (``spoke.tier.Peer``, an argument):
served from the cache or the upstream, never a third member, at the member's priority; a
member's handoff (``copy``) from the cache only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from spokefs.cache.store import BlockStore, Loc, read_loc
from spokefs.errors import SpokeError, UpstreamUnavailable
from spokefs.integrity import blocks_in_range
from spokefs.policy import BlockKey
from spokefs.spoke.fetcher import Block
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.tier import Peer
from spokefs.wire.backend import BlockPart, FileSegment, LaterBlock, ReadContext, Segment

log = logging.getLogger(__name__)

DEMAND = 0  # priority of a block a reader is waiting for
WARM = 1 << 20  # operator warm-up: behind demand and the planner's prefetches
PEER_PREFETCH = 1 << 10  # another tier member's prefetch: behind demand, before warm-ups
CHECK_IN_THREAD = 1 << 20  # a read this large is checked off the event loop

# (dataset, version, start, end, context): a read the planner hears of.
Heard = Callable[[str, str, int, int, ReadContext], None]


class FetchPath(Protocol):
    """What the read path needs of the fetch path: ``spoke.fetcher.Fetcher`` (over HTTP to
    the upstream and the tier's members), or an in-memory stand-in in the unit tests."""

    last_error: str | None  # the last transport failure, None once a request succeeded

    @property
    def passed(self) -> Mapping[BlockKey, bytes]: ...  # digests of blocks served, not kept

    @property
    def last_received(self) -> float: ...  # when bytes last arrived (time.monotonic)

    def want(self, dataset: str, key: BlockKey, priority: int, direct: bool = False,
             asker: str | None = None) -> asyncio.Future[Block]: ...

    def recent(self, key: BlockKey) -> Block | None: ...


def peer_priority(peer: Peer | None) -> int:
    """The fetch priority of a member's batch read: its prefetch behind readers' demand."""
    return PEER_PREFETCH if peer is not None and peer.kind == "prefetch" else DEMAND


class Counts:
    """Blocks readers found resident (hits) or waited for (misses), in all (the metrics, and
    here for ``/v1/status``) and per dataset (in ``/v1/status`` only: a label would cost
    every read more)."""

    def __init__(self, metrics: SpokeMetrics) -> None:
        self.metrics = metrics
        self.hits = self.misses = 0
        self.by_dataset: dict[str, list[int]] = {}  # dataset -> [hits, misses]

    def count(self, dataset: str, hits: int, misses: int) -> None:
        if hits:
            self.hits += hits
            self.metrics.hits.inc(hits)
        if misses:
            self.misses += misses
            self.metrics.misses.inc(misses)
        row = self.by_dataset.get(dataset)
        if row is None:
            row = self.by_dataset[dataset] = [0, 0]
        row[0] += hits
        row[1] += misses


@dataclass(slots=True)
class Piece:
    """Bytes of one block as ``Reads.block`` found them, with what a batch frame says."""

    segment: Segment
    object_size: int
    digest: bytes


class Reads:
    """Blocks and ranges of blocks, each checked, from the cache or the fetch path.

    ``expired(key)``: whether a resident block's dataset rules drop it now
    (``spoke.retention``); ``heard``: the planner's ear, set while it runs."""

    def __init__(self, store: BlockStore, fetches: FetchPath, counts: Counts, *,
                 upstream: str | Callable[[str], str | None], deadline: float,
                 read_window: int = 64 << 20,
                 expired: Callable[[BlockKey], bool] = lambda key: False,
                 clock: Callable[[], float] = time.monotonic,
                 checker: Executor | None = None) -> None:
        self.store = store
        self.fetches = fetches
        self.counts = counts
        # The upstream a dataset's blocks come from, for messages (spoke.upstreams).
        self.upstream_of: Callable[[str], str | None] = (
            (lambda name: upstream) if isinstance(upstream, str) else upstream)
        self.deadline = deadline
        # A read asks for at most this many bytes ahead of what its client has taken.
        self.read_window = read_window
        self.expired = expired
        self.clock = clock
        self.heard: Heard | None = None
        # Checks of large reads run here, off the event loop (the native read releases the GIL)
        self._checker = checker or ThreadPoolExecutor(2, thread_name_prefix="spokefs-check")
        self._sizes: dict[str, int] = {}  # version -> size, in front of the index
        self._just_fetched: set[BlockKey] = set()  # fetched by object_size for a waiting read

    def close(self) -> None:
        self._checker.shutdown(wait=True)

    # -- the one path to a block -------------------------------------------------------------
    def ask(self, name: str, key: BlockKey, priority: int = DEMAND,
            peer: Peer | None = None) -> asyncio.Future[Block] | None:
        """Start fetching ``key`` unless it is resident or just fetched (None then): what a
        read asks for ahead of the block it sends."""
        if key in self.store or self.fetches.recent(key) is not None:
            return None
        return self.fetch(name, key, priority, peer)

    def fetch(self, name: str, key: BlockKey, priority: int = DEMAND,
              peer: Peer | None = None) -> asyncio.Future[Block]:
        """The block's fetch (started, or the one under way). A member's request
        (``peer``) may be served from the upstream only (never a third member)."""
        return self.fetches.want(name, key, priority, peer is not None,
                                 peer.member if peer is not None else None)

    async def block(self, name: str, key: BlockKey, priority: int = DEMAND,
                    peer: Peer | None = None, lo: int = 0, hi: int | None = None,
                    fut: asyncio.Future[Block] | None = None) -> Piece:
        """Bytes [lo, hi) of block ``key`` (to its end without ``hi``): resident, else just
        fetched, else fetched at ``priority`` (or awaited in ``fut``, asked for ahead). A
        member's handoff (``peer.kind == "copy"``) is answered from here only, else
        UpstreamUnavailable. Each block counts as a hit or a miss (a handoff's does not:
        no reader of this spoke asked)."""
        copy = peer is not None and peer.kind == "copy"
        if fut is None:
            loc = self.store.get(key)
            if loc is not None:
                view = await self._resident(key, lo, loc.size if hi is None else hi)
                if view is not None:
                    if not copy:
                        self._hit(name, key)
                    return Piece(view, self.store.object_size(key[0]) or 0, loc.digest)
            block = self.fetches.recent(key)
            if block is not None:
                if not copy:
                    self.counts.count(name, 1, 0)
                return Piece(block.view[lo:hi], block.object_size, block.digest)
            if copy:
                raise UpstreamUnavailable(
                    f"block {key[1]} of {key[0]} ({name}) is not cached on this member",
                    self.upstream_of(name) or "", "not cached")
            fut = self.fetch(name, key, priority, peer)  # missing, or evicted meanwhile
        self.counts.count(name, 0, 1)
        self._just_fetched.discard(key)
        block = await self.wait(fut, f"block {key[1]} of {key[0]} ({name})", name)
        # From the buffer it arrived in (still warm in memory; the copy the store writes goes
        # to disk with direct I/O, not to the page cache).
        return Piece(block.view[lo:hi], block.object_size, block.digest)

    def _hit(self, name: str, key: BlockKey) -> None:
        if key in self._just_fetched:  # object_size fetched it for this read: a miss
            self._just_fetched.discard(key)
            self.counts.count(name, 0, 1)
        else:
            self.counts.count(name, 1, 0)

    async def wait(self, fut: asyncio.Future[Block], what: str, name: str) -> Block:
        """Wait for a fetch, but not past the deadline of upstream silence: a reader queued
        behind fetches that stalled (all slots taken, nothing failing yet) still gets its 503
        once the upstream has sent no byte for ``deadline`` seconds while it waited. A slow
        link keeps sending, so it only makes readers slower."""
        began = self.clock()
        while True:
            silent_since = max(began, self.fetches.last_received)
            left = silent_since + self.deadline - self.clock()
            if left <= 0:
                cause = self.fetches.last_error or "no answer (connections stalled)"
                url = self.upstream_of(name) or ""
                raise UpstreamUnavailable(
                    f"upstream {url} sent nothing for {self.deadline:g}s while "
                    f"waiting for {what}: {cause}", url, cause)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError:
                if fut.done():  # it ended just as our wait did: its own answer stands
                    return fut.result()

    # -- ranges and batches ------------------------------------------------------------------
    async def range(self, name: str, version: str, start: int, end: int, block_size: int,
                    ctx: ReadContext) -> AsyncIterator[Segment]:
        """The bytes of [start, end), block by block, each checked against its digests.

        Missing blocks are asked for a window ahead of the one being sent (all at once for a
        range within the window); a sent block's future is dropped at once, so neither
        memory nor the link follows a reader that stalls or leaves. The planner hears the
        read block by block as it is sent: told the whole range at once, its readahead would
        fetch all of it for a reader that may take a megabyte and leave."""
        bs = block_size
        indexes = blocks_in_range(start, end, bs)
        window = max(2, self.read_window // bs)
        pending: dict[int, asyncio.Future[Block]] = {}
        asked = indexes.start
        heard = self.heard
        for i in indexes:
            a, b = max(start, i * bs), min(end, (i + 1) * bs)
            if heard is not None:
                heard(name, version, a, b, ctx)
            while asked < min(i + window, indexes.stop):
                fut = self.ask(name, (version, asked))
                if fut is not None:
                    pending[asked] = fut
                asked += 1
            # An error after the first block reaches the reader as a cut connection
            # (wire.server.send_segments), never as an error written into the body.
            piece = await self.block(name, (version, i), DEMAND, None, a - i * bs, b - i * bs,
                                     pending.pop(i, None))
            yield piece.segment

    async def blocks(self, name: str, keys: list[BlockKey], peer: Peer | None = None
                     ) -> list[BlockPart]:
        """Whole blocks for a batch read, fetched first where missing; a block that cannot
        be had is an error frame. Resident small blocks are read and checked as they are
        sent (``LaterBlock``), so a batch holds one such block at a time (a large one goes
        out by sendfile)."""
        if peer is not None and peer.kind == "copy":  # a handoff: nothing fetched
            return [await self._part(name, key, peer) for key in keys]
        priority = peer_priority(peer)
        futs: dict[BlockKey, asyncio.Future[Block]] = {}
        for key in keys:
            if key not in futs and (fut := self.ask(name, key, priority, peer)) is not None:
                futs[key] = fut
        parts = []
        for key in keys:
            loc = self.store.get(key) if key not in futs else None
            if loc is not None and loc.size < CHECK_IN_THREAD:
                read = functools.partial(self._later, name, key, peer)
                parts.append(BlockPart(200, LaterBlock(loc.size, read),
                                       self.store.object_size(key[0]) or 0, loc.digest))
                continue
            parts.append(await self._part(name, key, peer, futs.get(key)))
        return parts

    async def _part(self, name: str, key: BlockKey, peer: Peer | None,
                    fut: asyncio.Future[Block] | None = None) -> BlockPart:
        try:
            p = await self.block(name, key, DEMAND, peer, fut=fut)
        except SpokeError as exc:
            return BlockPart.error(exc)
        return BlockPart(200, p.segment, p.object_size, p.digest)

    async def _later(self, name: str, key: BlockKey, peer: Peer | None
                     ) -> bytes | memoryview | None:
        """A batch's block as it is sent (fetched again if it left meanwhile); None cuts
        the batch (it cannot be had now, or came as a file region)."""
        try:
            seg = (await self.block(name, key, DEMAND, peer)).segment
        except SpokeError as exc:
            log.warning("block %d of %s left a batch read unfinished: %s", key[1], key[0], exc)
            return None
        return seg if isinstance(seg, bytes | memoryview) else None

    # -- sizes and digests -------------------------------------------------------------------
    async def object_size(self, name: str, version: str) -> int:
        """The version's size: remembered, indexed, or learned from its first block, which
        the reader almost always needs (that read then counts it as a miss)."""
        size = self.size_of(version)
        if size is None:
            block = await self.wait(self.fetch(name, (version, 0)),
                                    f"block 0 of {version} ({name})", name)
            size = block.object_size
            self._just_fetched.add((version, 0))
        self._sizes[version] = size
        if len(self._sizes) > 100_000:
            self._sizes.pop(next(iter(self._sizes)))
        return size

    def size_of(self, version: str) -> int | None:
        """The version's size if known here (no I/O)."""
        size = self._sizes.get(version)
        return size if size is not None else self.store.object_size(version)

    def digest(self, key: BlockKey) -> bytes | None:
        """The block's digest if this spoke has it (cached, just fetched, or served)."""
        loc = self.store.get(key)
        if loc is not None:
            return loc.digest
        block = self.fetches.recent(key)
        return block.digest if block is not None else self.fetches.passed.get(key)

    # -- resident blocks ---------------------------------------------------------------------
    async def _resident(self, key: BlockKey, lo: int, hi: int) -> Segment | None:
        """Checked bytes [lo, hi) of a resident block (None: not resident, or damaged and
        dropped). A small range is read into a buffer of its own and checked there. A large
        one is checked in a thread (the checker's scratch buffer) and then sent by the kernel
        from the same region of the segment file (sendfile: no buffer of the read's size is
        held while a slow client drains); the block is held meanwhile, so nothing evicts or
        frees it."""
        if self.expired(key):
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
        return FileSegment(loc.seg.file, loc.offset + lo, hi - lo, owned=False,
                           done=functools.partial(self.store.let_go, key, loc))


_scratch = threading.local()


def _check(loc: Loc, lo: int, hi: int, chunk: int) -> bool:
    """Whether bytes [lo, hi) of a block match their digests (a checker thread: its own
    reused scratch buffer, so a large check costs no allocation)."""
    need = hi - lo + 2 * chunk
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < need:
        buf = _scratch.buf = bytearray(max(need, 4 << 20))
    return read_loc(loc, lo, hi, chunk, buf) is not None
