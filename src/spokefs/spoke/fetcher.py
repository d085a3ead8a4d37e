"""Fetching blocks from the upstream: one fetch per block, many blocks per request.

A block the spoke needs (a reader's miss, a prefetch, a warm-up) becomes one ``Fetch``,
shared by everyone who asks while it is under way; asking again at a higher priority (a
reader catching up with a prefetch) moves it up the queue. The queue (``FetchQueue``) groups
waiting blocks into batch reads (``POST /v1/datasets/{ds}/blocks``) under the request limit
and the link's prefetch window. Each frame of the response is received into a pooled buffer
of its own, checked against the digest the upstream sent once the whole frame is in, then
handed to the readers waiting for it and written to the store by its worker thread, all
while later frames are still arriving.

In a spoke tier (``spoke.tier``), each block has a route: the upstream, or the member that
owns it (a batch read marked ``X-Spokefs-Peer``); batches never mix routes. A member that
fails or goes silent gives its blocks back to be routed again without it (the next member in
the block's ranking, then the upstream), at once, with no backoff. A block fetched from
another member is handed to its readers and kept as a copy where there is spare room (the
store's ``CopiesFirst``: copies leave before any block this member owns), else held in memory
a while (``borrowed``): its owner keeps it.

Failures: a connection that fails or goes silent gives back the blocks it did not deliver,
which are retried with backoff until ``deadline`` seconds after their fetch began, then fail
with ``UpstreamUnavailable``; a frame whose digest does not match is fetched again, three
tries in all (then ``IntegrityError``); an error frame (410, 404...) is that block's final answer.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import mmap
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from spokefs.cache.segments import aligned
from spokefs.cache.store import BlockStore, chunk_digests
from spokefs.errors import (
    IntegrityError,
    NotFound,
    SpokeError,
    Transient,
    UpstreamUnavailable,
    from_status,
)
from spokefs.linkmodel import LinkModel
from spokefs.manifest import MAX_BLOCK_SIZE
from spokefs.policy import BlockKey
from spokefs.retry import UPSTREAM
from spokefs.spoke.commitments import Commitments
from spokefs.spoke.fetchqueue import QUEUED, Batch, Entry, FetchQueue
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.tier import Route, Tier
from spokefs.spoke.upstreams import Routes, UpstreamSpec
from spokefs.tier.membership import State
from spokefs.wire.frames import FrameError, FrameHeader
from spokefs.wire.headers import H_MEMBER, H_PEER
from spokefs.wire.http1 import DataClient, Superseded

log = logging.getLogger(__name__)

DEMAND = 0
MAX_DIGEST_FAILURES = 3
HASH_IN_THREAD = 1 << 20  # a block this large is checked off the event loop


class Block:
    """A fetched block whose bytes matched their digest (its own buffer: hold the object
    or the view for as long as you like). ``written`` resolves to whether the store kept
    it (None: it will not be kept)."""

    __slots__ = ("chunks", "digest", "object_size", "padded", "view", "written")

    def __init__(self, view: memoryview, digest: bytes, object_size: int,
                 chunks: bytes | None = None) -> None:
        self.view = view
        self.digest = digest
        self.object_size = object_size
        self.chunks = chunks
        self.padded: memoryview | None = None  # the bytes page-aligned, up to 4 KiB more
        self.written: asyncio.Future[bool] | None = None

    @property
    def size(self) -> int:
        return len(self.view)


class Arenas:
    """Receive buffers, reused. A new buffer's first touch costs a page fault per 4 KiB
    (here ~1 us each, ~250 us per MiB, and taken on the event loop, in the recv that fills
    it); a reused one none. A buffer is reused only once nothing refers to it any more: every
    view of it (a block handed to readers, a write not yet done) holds a reference, so
    CPython's reference count says when the last one is gone. Buffers come in size classes
    (``_size_class``), each with a ring of its own, tried oldest first (the likeliest to be
    free), a few per take: one ring of mixed sizes missed whenever its oldest buffers were
    too small for the batch at hand, and then every batch made a new buffer (measured: ~1
    take in 1.3 on a cold fill of small files, the spare-maker's faulting ~18% of the spoke's
    CPU). When none is free, a spare made ready in a thread is used (anonymous memory,
    faulted in by reading /dev/zero into it: in the kernel, without the GIL), and another
    spare is made.

    Kept buffers are memory the process holds while idle (shared anonymous memory: RSS), so
    ``trim`` (the spoke's housekeeping, every few seconds) gives back every free buffer and
    spare that no take used since the trim before: a spoke that filled once and now serves
    hits holds none, and a fill in progress keeps what it cycles through."""

    def __init__(self, keep_bytes: int = 192 << 20, tries: int = 8) -> None:
        self.keep_bytes = keep_bytes
        self.kept = 0
        self.tries = tries
        self._rings: dict[int, collections.deque[mmap.mmap]] = {}  # size class -> buffers
        self._spare: dict[int, list[mmap.mmap]] = {}
        self._making: set[int] = set()
        self._maker: ThreadPoolExecutor | None = None
        self._used: set[int] = set()  # id() of the buffers taken since the last trim
        self._sizes_used: set[int] = set()  # size classes whose spare was wanted since then
        self.made = 0  # buffers made because no kept one was free (a reuse miss)

    def take(self, n: int) -> mmap.mmap:
        size = _size_class(n)
        ring = self._rings.setdefault(size, collections.deque())
        for _ in range(min(self.tries, len(ring))):
            a = ring[0]
            ring.rotate(-1)  # to the back: used now, or busy
            # 3: the deque, the local name and getrefcount's own argument.
            if sys.getrefcount(a) == 3:
                self._used.add(id(a))
                return a
            del a
        self.made += 1
        self._sizes_used.add(size)
        spare = self._spare.get(size)
        a = spare.pop() if spare else mmap.mmap(-1, size)
        self._make_spare(size)
        if self.kept + size <= self.keep_bytes:  # else used once and freed
            ring.append(a)
            self.kept += size
            self._used.add(id(a))
        return a

    def trim(self) -> int:
        """Give back the free buffers and spares unused since the last trim; bytes freed."""
        freed = 0
        for size, ring in list(self._rings.items()):
            keep: collections.deque[mmap.mmap] = collections.deque()
            while ring:
                a = ring.popleft()
                # 2: the local name and getrefcount's own argument (it left the deque).
                if id(a) in self._used or sys.getrefcount(a) > 2:
                    keep.append(a)
                else:
                    self.kept -= len(a)
                    freed += len(a)
                    a.close()
                del a
            if keep:
                self._rings[size] = keep
            else:
                del self._rings[size]
        for size in [s for s in self._spare if s not in self._sizes_used]:
            for a in self._spare.pop(size):
                freed += len(a)
                a.close()
        self._used.clear()
        self._sizes_used.clear()
        return freed

    def _make_spare(self, size: int) -> None:
        if size in self._making or self._spare.get(size):
            return
        if self._maker is None:
            self._maker = ThreadPoolExecutor(1, thread_name_prefix="spokefs-arena")
        self._making.add(size)
        fut = asyncio.get_running_loop().run_in_executor(self._maker, _faulted, size)

        def made(f: asyncio.Future[mmap.mmap]) -> None:
            self._making.discard(size)
            if not f.cancelled() and f.exception() is None:
                self._spare.setdefault(size, []).append(f.result())

        fut.add_done_callback(made)

    def close(self) -> None:
        if self._maker is not None:
            self._maker.shutdown(wait=False, cancel_futures=True)


def _size_class(n: int) -> int:
    """Powers of two up to 1 MiB, then whole MiB: a 4 MiB batch takes 4 MiB, not 8."""
    if n <= 1 << 20:
        return 1 << max(17, (n - 1).bit_length())
    return (n + (1 << 20) - 1) & ~((1 << 20) - 1)


def _faulted(size: int) -> mmap.mmap:
    """Anonymous memory with every page already faulted in (off the event loop)."""
    m = mmap.mmap(-1, size)
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        view = memoryview(m)
        done = 0
        while done < size:
            done += os.readv(fd, [view[done:]])
        view.release()
    finally:
        os.close(fd)
    return m


def _digests(data: memoryview, chunk: int) -> tuple[bytes, bytes]:
    """The block's digest (to check against the upstream's) and its chunk digests (what
    the store keeps to check every later read)."""
    return xxhash.xxh3_128_digest(data), chunk_digests(data, chunk)


class FetchCancelled(Exception):
    """A queued prefetch was withdrawn before it went out."""


class Fetch:
    __slots__ = ("bad", "dataset", "delays", "direct", "entry", "future", "keep", "key",
                 "limit", "prefetch", "started", "tried")

    def __init__(self, key: BlockKey, dataset: str, future: asyncio.Future[Block],
                 entry: Entry, direct: bool = False) -> None:
        self.key = key
        self.dataset = dataset
        self.future = future
        self.entry = entry
        self.started = time.monotonic()
        self.delays: Iterator[float] | None = None
        self.bad = 0  # digest failures
        self.prefetch = False  # came in a prefetch batch (counted as prefetched bytes)
        self.direct = direct  # a tier member asked: the cache or the upstream only
        self.keep = True  # kept in the store once fetched (tier: owned, or asked as owner)
        self.tried: set[str] = set()  # tier members that failed this block
        self.limit = MAX_BLOCK_SIZE  # the most bytes a frame of this block may claim


def _check_length(h: FrameHeader, f: Fetch) -> None:
    if h.length > f.limit:  # before a buffer of that size is made (the sender names it)
        raise FrameError(f"a frame of {h.length} bytes for block {f.key[1]} of {f.key[0]}, "
                         f"which holds at most {f.limit}")


Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]


class Fetcher:
    """The spoke's fetch path. ``finished(key, resident)`` hears every fetch's end (resident:
    the block was indexed; False: failed, cancelled, or passed through).

    Why one class of ~550 lines: the single-flight table, the batches in flight, the link's
    pacing and the deadline share one state that every fetch's end changes at once; split,
    each part would reach into the others. The policy of what to ask for next is already
    apart (``fetchqueue``, sans-I/O), as are the receive buffers (``Arenas``). The bytes'
    half of this class is what the native data plane (issue 28) moves out of Python next."""

    def __init__(self, upstream: str | Routes, store: BlockStore, metrics: SpokeMetrics, *,
                 spawn: Spawn, max_requests: int = 64, deadline: float = 30.0,
                 link: LinkModel | None = None,
                 finished: Callable[[BlockKey, bool], None] | None = None,
                 tokens: Sequence[str | None] = (), tier: Tier | None = None) -> None:
        # The upstreams and which serves which dataset (spoke.upstreams); a batch holds one
        # dataset's blocks, so it goes to that dataset's upstream whole. They share the
        # queue and the link's pacing: the window is the spoke's, over all its links.
        self.routes = upstream if isinstance(upstream, Routes) else Routes(
            [UpstreamSpec(upstream)])
        self.upstream = self.routes.specs[0].url
        self.tier = tier
        self.store = store
        self.metrics = metrics
        self.spawn = spawn
        self.deadline = deadline
        self.link = link
        self.finished = finished or (lambda key, resident: None)
        tokens = list(tokens) or [None] * len(self.routes)
        self.clients = [DataClient(sp.url, max_connections=max_requests,
                                   idle_timeout=deadline, token=t)
                        for sp, t in zip(self.routes.specs, tokens, strict=True)]
        self.queue = FetchQueue(max_requests, prefetch_window=(
            link.window() if link is not None else None))
        self._fetches: dict[BlockKey, Fetch] = {}
        # Tier: fetches from the upstream for a member's request while this member's own
        # fetch of the block is out to another member (never wait on a member for a member).
        self._direct: dict[BlockKey, Fetch] = {}
        self._writing: dict[BlockKey, Block] = {}   # handed out, not yet indexed
        # Tier: blocks got from other members, held in memory only (most recent last).
        self.borrowed: OrderedDict[BlockKey, Block] = OrderedDict()
        self.borrowed_bytes = 0
        # Digests of blocks served without being kept (single-block reads send them).
        self.passed: OrderedDict[BlockKey, bytes] = OrderedDict()
        self.last_error: str | None = None
        self.errors: dict[int, str] = {}  # upstream -> its last failure, until it answers
        self._down_since: dict[int, float] = {}  # upstream -> when it went down (the log)
        self._deadline_logged: tuple[float, int] | None = None  # last such line, blocks since
        self._pump_due = False
        self.arenas = Arenas()
        self._hasher: ThreadPoolExecutor | None = None
        self.expected_size: Callable[[str, BlockKey], int] = lambda ds, key: 4 << 20
        # The most bytes a frame of the block may hold (its size from the manifest, else the
        # block size): checked before a buffer is made for it at the length the sender names.
        self.frame_limit: Callable[[str, BlockKey], int] = lambda ds, key: MAX_BLOCK_SIZE
        # What each version commits to (spoke.commitments); None: frames' digests only.
        self.commitments: Commitments | None = None

    # -- asking --------------------------------------------------------------------------------
    def want(self, dataset: str, key: BlockKey, priority: int,
             direct: bool = False, asker: str | None = None) -> asyncio.Future[Block]:
        """The block's fetch (started now, or the one under way, raised to ``priority``).
        ``direct``: another tier member (``asker``, when it said) asks; only the upstream
        may be asked for it, or, in a handoff, a member other than the asker."""
        f = self._fetches.get(key)
        if f is not None:
            # Out to the member that owns it (not a handoff, which asks a member's cache and
            # never goes further): a member's request does not wait on a member for a member.
            if direct and f.entry.route is not None and not f.keep:
                if f.entry.state != QUEUED:  # out to a member: a fetch of its own
                    d = self._direct.get(key)
                    if d is not None:
                        self.queue.raise_priority(d.entry, priority)
                        self._pump()
                        return d.future
                    return self._start(dataset, key, priority, True, self._direct, asker)
                self.queue.remove(f.entry)  # queued for a member: to the upstream instead
                f.direct = True
                f.entry = self._enqueue(f, min(priority, f.entry.priority))
            else:
                self.queue.raise_priority(f.entry, priority)
            self._pump()
            return f.future
        block = self.recent(key)
        if block is not None:  # fetched a moment ago (being written, or borrowed)
            fut: asyncio.Future[Block] = asyncio.get_running_loop().create_future()
            fut.set_result(block)
            if key in self.borrowed:  # the planner may be waiting on it
                asyncio.get_running_loop().call_soon(self.finished, key, True)
            return fut
        return self._start(dataset, key, priority, direct, self._fetches, asker)

    def _start(self, dataset: str, key: BlockKey, priority: int, direct: bool,
               table: dict[BlockKey, Fetch], asker: str | None = None
               ) -> asyncio.Future[Block]:
        fut: asyncio.Future[Block] = asyncio.get_running_loop().create_future()
        f = Fetch(key, dataset, fut, None, direct)  # type: ignore[arg-type]  # set below
        if asker is not None:  # it lacks the block: no handoff asks it
            f.tried.add(asker)
        f.entry = self._enqueue(f, priority)
        table[key] = f
        self._pump()
        return fut

    def _enqueue(self, f: Fetch, priority: int) -> Entry:
        entry = self.queue.add(f.key, f.dataset, priority,
                               self.expected_size(f.dataset, f.key))
        entry.data = f
        f.limit = self.frame_limit(f.dataset, f.key)
        self._assign(f, entry)
        return entry

    def _assign(self, f: Fetch, entry: Entry) -> None:
        """The route of ``f`` (tier: the owner, or the next member, or the upstream)."""
        if self.tier is None:
            return
        r = self.tier.route(f.key, f.tried, f.direct)
        # The queue batches by route: never two members, nor a handoff with a read.
        entry.route, f.keep = (r if r.peer is not None else None), r.keep

    def fetching(self, key: BlockKey) -> bool:
        return key in self._fetches or key in self._direct

    def recent(self, key: BlockKey) -> Block | None:
        """A block fetched and handed out, still being written to the store, or (tier) got
        from another member and held in memory a while."""
        block = self._writing.get(key)
        if block is None and self.borrowed:
            block = self.borrowed.get(key)
            if block is not None:
                self.borrowed.move_to_end(key)
        return block

    @property
    def last_received(self) -> float:
        """When bytes last came from the upstream or (tier) any member."""
        t = max(c.last_received for c in self.clients)
        return t if self.tier is None else max(t, self.tier.last_received)

    def _borrow(self, key: BlockKey, block: Block) -> None:
        assert self.tier is not None
        old = self.borrowed.pop(key, None)
        if old is not None:
            self.borrowed_bytes -= old.size
        self.borrowed[key] = block
        self.borrowed_bytes += block.size
        while self.borrowed_bytes > self.tier.borrow_bytes and self.borrowed:
            _, gone = self.borrowed.popitem(last=False)
            self.borrowed_bytes -= gone.size

    def cancel(self, key: BlockKey) -> bool:
        """Withdraw a queued prefetch (one that went out runs to its end)."""
        f = self._fetches.get(key)
        if f is None or f.entry.priority == DEMAND or not self.queue.remove(f.entry):
            return False
        self._end(f, error=FetchCancelled(f"prefetch of block {key[1]} of {key[0]} withdrawn"))
        return True

    @property
    def held_back(self) -> bool:
        return self.queue.held_back

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        if self.tier is not None:
            await self.tier.close()
        self.arenas.close()
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)

    # -- requests ------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Send what may go, at the end of this turn of the event loop: blocks asked for in
        one burst (a planner's prefetch, a warm-up, a read of many blocks) leave together,
        in batches, not one request each."""
        if not self._pump_due:
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._pump_due = False
        while (batch := self.queue.next_batch()) is not None:
            self.spawn(self._request(batch))

    async def _request(self, batch: Batch) -> None:
        fetches: list[Fetch] = [e.data for e in batch.entries]
        if batch.route is not None:
            await self._peer_request(batch, fetches)
            return
        ds = batch.group
        up = self.routes.index(ds)
        if up is None:  # the dataset's info came from no upstream: nothing to ask
            for f in fetches:
                self._end(f, error=NotFound(f"dataset {ds!r} is served by no upstream of "
                                            "this spoke"))
            self.queue.finished(batch)
            self._pump()
            return
        url = self.routes.specs[up].url
        kind = "prefetch" if batch.prefetch else "demand"
        self.metrics.upstream_requests.labels(kind).inc()
        self.metrics.upstream_blocks.labels(kind).inc(len(fetches))
        body = json.dumps({"blocks": [list(f.key) for f in fetches]}).encode()
        bufs: dict[int, memoryview] = {}
        padded: dict[int, memoryview] = {}
        done: set[int] = set()
        first_byte: list[float] = []
        # One buffer for the batch's expected bytes, carved into its blocks (one allocation,
        # not one per block); a block that does not fit gets its own.
        # Blocks start on 4 KiB boundaries of a page-aligned buffer: the store can write
        # them with direct I/O straight from here.
        arena = memoryview(self.arenas.take(sum(aligned(e.size) for e in batch.entries)))
        used = 0

        def begin(h: FrameHeader) -> memoryview | None:
            nonlocal used
            if h.status != 200 or h.seq >= len(fetches) or h.seq in done:
                return None
            _check_length(h, fetches[h.seq])
            if not first_byte:
                first_byte.append(time.monotonic())
            room = aligned(h.length)
            if used + room <= len(arena):
                buf = arena[used:used + h.length]
                padded[h.seq] = arena[used:used + room]
                used += room
            else:
                buf = memoryview(bytearray(h.length))
            bufs[h.seq] = buf
            return buf

        def end(h: FrameHeader, payload: memoryview) -> None:
            if h.seq >= len(fetches) or h.seq in done:
                raise ValueError(f"frame {h.seq} was not asked for or came twice")
            done.add(h.seq)
            self._frame(fetches[h.seq], h, payload, bufs.pop(h.seq, None), batch.prefetch,
                        padded.pop(h.seq, None))

        def arrived(n: int) -> None:
            if self.link is not None:
                self.link.received(n)
            self.queue.received(batch, n)
            if self.queue.held_back:
                self._pump()

        link = self.link
        sent = link.sent(time.monotonic(), app_limited=not self.queue.held_back) if link else None
        t0 = time.monotonic()
        cause: str | None = None
        final: SpokeError | None = None
        try:
            await self.clients[up].read_blocks(f"/v1/datasets/{ds}/blocks", body, begin,
                                               end, progress=arrived)
            self.errors.pop(up, None)
            if not self.errors:
                self.last_error = None
            down = self._down_since.pop(up, None)
            if down is not None:  # one line per transition, not per request
                log.info("upstream link up: %s answers again after %.1f s down",
                         url, time.monotonic() - down,
                         extra={"event": "link_up", "upstream": url})
        except Transient as exc:
            cause = str(exc)
            self.last_error = self.errors[up] = cause
            if up not in self._down_since:
                self._down_since[up] = time.monotonic()
                log.warning("upstream link down: %s: %s (retrying until each read's "
                            "deadline, %g s)", url, cause, self.deadline,
                            extra={"event": "link_down", "upstream": url})
            self.metrics.upstream_errors.labels("transient").inc()
        except SpokeError as exc:  # the upstream refused the whole batch: final for each
            final = exc
        finally:
            self.queue.finished(batch)
        now = time.monotonic()
        self.metrics.fetch_seconds.observe(now - t0)
        if link is not None and sent is not None:
            link.delivered(sent, 0, now, first_byte[0] if first_byte else None)
            self.queue.prefetch_window = link.window()
        left = [f for seq, f in enumerate(fetches) if seq not in done]
        if final is not None:
            for f in left:
                self._end(f, error=final)
        elif left:
            self._retry(left, cause or "the upstream's answer ended early")
        self._pump()

    async def _peer_request(self, batch: Batch, fetches: list[Fetch]) -> None:
        """A batch read from the tier member that owns these blocks (marked, so it asks no
        other member). A member that fails, goes silent or refuses us gives the blocks it did
        not deliver back to be routed without it, at once."""
        tier, route = self.tier, batch.route
        assert tier is not None and isinstance(route, Route) and route.peer is not None
        peer, handoff = route.peer, route.handoff
        body = json.dumps({"blocks": [list(f.key) for f in fetches]}).encode()
        bufs: dict[int, memoryview] = {}
        padded: dict[int, memoryview] = {}
        done: set[int] = set()
        got = [0, 0]  # bytes, blocks

        def begin(h: FrameHeader) -> memoryview | None:
            if h.status != 200 or h.seq >= len(fetches) or h.seq in done:
                return None
            _check_length(h, fetches[h.seq])
            # A reused buffer of its own, not a share of one for the batch: a block got from
            # a member may be held a while (borrowed), and would keep its batch's buffer from
            # reuse. Not a new bytearray: zeroing and faulting in 4 MiB per block was 12% of
            # a fresh member's CPU in a tier restore (py-spy, bench checkpoint).
            room = aligned(h.length)
            arena = memoryview(self.arenas.take(room))
            padded[h.seq] = arena[:room]  # page-aligned: the store may write it direct
            bufs[h.seq] = arena[:h.length]
            return bufs[h.seq]

        def end(h: FrameHeader, payload: memoryview) -> None:
            if h.seq >= len(fetches) or h.seq in done:
                raise ValueError(f"frame {h.seq} was not asked for or came twice")
            done.add(h.seq)
            f = fetches[h.seq]
            if handoff:
                tier.handoff_result(h.status == 200)
            if h.status >= 500:  # the member could not get it (or holds no copy): the next
                # one, or the upstream
                self._reroute([f], peer)
                return
            if h.status == 200:
                got[0] += h.length
                got[1] += 1
            self._frame(f, h, payload, bufs.pop(h.seq, None), batch.prefetch,
                        padded.pop(h.seq, None), peer)

        def arrived(n: int) -> None:
            self.queue.received(batch, n)
            if self.queue.held_back:
                self._pump()

        # Only the blocks' owner, asked for them first, is waited for while silent: a stand-in
        # for a member that failed, or a handoff's copy, gets the plain timeout (waits must
        # not compound: the stand-in may be waiting on the failed member itself).
        waits = not handoff and all(not f.tried and tier.router.owner(f.key) == peer
                                    for f in fetches)
        # A prefetch the owner holds back (its link's pacing) is waited for only while no
        # reader waits on any of its blocks; then it is given up and its blocks asked of the
        # owner again, now as a demand, which joins the owner's fetch and goes first there
        # (asking anyone else would bring them across the WAN twice). A demand read the
        # owner cannot deliver within half the deadline (``wait_limit``) goes elsewhere.
        patience = None if not waits else tier.patience(
            peer, None if not batch.prefetch else
            lambda: any(f.entry.priority == DEMAND for f in fetches))
        failure: str | None = None
        superseded = False
        try:
            await tier.client(peer).read_blocks(
                f"/v1/datasets/{batch.group}/blocks", body, begin, end, progress=arrived,
                headers={H_PEER: "copy" if handoff else
                         "prefetch" if batch.prefetch else "demand", H_MEMBER: tier.self_url},
                patience=patience)
        except Superseded:
            superseded = True
        except Transient as exc:
            failure = str(exc)
        except SpokeError as exc:
            if exc.status in (401, 403):  # a member that refuses us is no member to ask
                failure = f"refused ({exc.status}): {exc}"
                if tier.router.state(peer, tier.clock()) is State.UP:  # once, not per batch
                    log.warning("tier member %s refused a batch read: %s (does its --auth "
                                "file hold this member's tier token?)", peer, exc,
                                extra={"event": "tier_refused", "member": peer})
            else:  # final for each block (the same answer the upstream would give)
                for seq, f in enumerate(fetches):
                    if seq not in done:
                        self._end(f, error=exc)
                tier.answered(peer, got[0], got[1])
                self._pump()
                return
        finally:
            self.queue.finished(batch)
        left = [f for seq, f in enumerate(fetches) if seq not in done]
        if superseded:  # the owner again, the joined blocks now as a demand
            log.debug("tier: a prefetch of %d blocks held back at %s is now awaited by a "
                      "reader: asked again", len(left), peer)
            self._requeue_all(left)
            self._pump()
            return
        if failure is None:
            tier.answered(peer, got[0], got[1])
            if left:  # an answer without some of its frames: those go elsewhere
                tier.rerouted(peer, len(left))
        else:
            tier.failed(peer, failure, len(left))
        if left:
            self._reroute(left, peer)
        self._pump()

    def _reroute(self, fetches: list[Fetch], peer: str) -> None:
        """Ask again without ``peer``: the next member in each block's ranking, else the
        upstream (no pause: another source, not the same one again)."""
        for f in fetches:
            f.tried.add(peer)
            self._requeue(f)

    def _frame(self, f: Fetch, h: FrameHeader, payload: memoryview, buf: memoryview | None,
               prefetch: bool, padded: memoryview | None = None,
               peer: str | None = None) -> None:
        if h.status != 200:
            try:
                doc = json.loads(bytes(payload))
            except ValueError:
                doc = None
            if h.status >= 500:
                self._retry([f], f"upstream answered {h.status} for block {f.key[1]} of "
                            f"{f.key[0]}")
            else:
                self._end(f, error=from_status(h.status, doc, f"upstream answered {h.status}"))
            return
        assert buf is not None
        if peer is None:
            self.metrics.upstream_bytes.labels("prefetch" if prefetch else "demand").inc(
                h.length)
        f.prefetch = prefetch
        chunk = self.store.chunk_size
        if h.length < HASH_IN_THREAD:
            self._checked(f, h, buf, _digests(payload, chunk), padded, peer)
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(2, thread_name_prefix="spokefs-hash")
        fut = asyncio.get_running_loop().run_in_executor(self._hasher, _digests, payload, chunk)
        fut.add_done_callback(lambda d: self._checked(f, h, buf, d.result(), padded, peer))

    def _checked(self, f: Fetch, h: FrameHeader, buf: memoryview,
                 digests: tuple[bytes, bytes], padded: memoryview | None,
                 peer: str | None = None) -> None:
        if digests[0] != h.digest:
            self._refused(f, peer, "failed its digest check")
            return
        self._committed(f, h, buf, digests, padded, peer)

    def _committed(self, f: Fetch, h: FrameHeader, buf: memoryview,
                   digests: tuple[bytes, bytes], padded: memoryview | None,
                   peer: str | None) -> None:
        """Keep the block only if its digest is the one its version commits to
        (``spoke.commitments``), learning the version's digest list first when needed."""
        verdict = (True if self.commitments is None
                   else self.commitments.verdict(f.dataset, f.key, h.digest, h.object_size))
        if verdict is None:
            assert self.commitments is not None
            learn = self.commitments.learn(f.dataset, f.key[0])

            def learned(fut: asyncio.Future[None]) -> None:
                if f.future.done():
                    return
                if fut.cancelled() or fut.exception() is not None:
                    exc = None if fut.cancelled() else fut.exception()
                    if isinstance(exc, Transient | UpstreamUnavailable) or exc is None:
                        self._retry([f], f"the digests of {f.key[0]}: {exc}")
                    else:
                        self._end(f, error=exc)
                    return
                if self.commitments.verdict(f.dataset, f.key, h.digest,  # type: ignore[union-attr]
                                            h.object_size) is None:
                    self._end(f, error=IntegrityError(
                        f"the upstream gave no digests for {f.key[0]} ({f.dataset})"))
                    return
                self._committed(f, h, buf, digests, padded, peer)

            learn.add_done_callback(learned)
            return
        if not verdict:
            self._refused(f, peer, "is not what its version commits to")
            return
        block = Block(buf, h.digest, h.object_size, digests[1])
        block.padded = padded
        if peer is not None and self.tier is not None:
            self.tier.got(f.key)
        self._end(f, block=block)

    def _refused(self, f: Fetch, peer: str | None, why: str) -> None:
        """A block whose bytes are not the dataset's: never kept or served. Asked again
        (of the next member, for a member's), and after MAX_DIGEST_FAILURES an error."""
        f.bad += 1
        where = "upstream" if peer is None else "peer"
        self.metrics.integrity_failures.labels(where).inc()
        what = f"block {f.key[1]} of {f.key[0]} ({f.dataset})"
        log.warning("%s from %s %s (attempt %d)", what,
                    "upstream" if peer is None else f"tier member {peer}", why, f.bad,
                    extra={"event": "integrity_failure", "where": where})
        if peer is not None and f.bad < MAX_DIGEST_FAILURES:
            self._reroute([f], peer)  # not from that member again
            return
        if f.bad >= MAX_DIGEST_FAILURES:
            self._end(f, error=IntegrityError(
                f"{what} {why} {f.bad} times; the upstream's copy may be changing, damaged "
                "or altered on the way"))
        else:
            self._requeue(f)

    # -- ends ----------------------------------------------------------------------------------
    def _end(self, f: Fetch, block: Block | None = None,
             error: BaseException | None = None) -> None:
        key = f.key
        if self._fetches.get(key) is f:
            del self._fetches[key]
        elif self._direct.get(key) is f:
            del self._direct[key]
        if block is None:
            if not f.future.done():
                f.future.set_exception(error or RuntimeError("fetch ended without a block"))
                f.future.exception()  # retrieved: a failed prefetch nobody awaits is no error
            self.finished(key, False)
            return
        self.store.set_object_size(key[0], block.object_size)
        # Tier: a block another member owns is kept as a copy if there is spare room, else
        # held in memory a while (its owner keeps it).
        res = self.store.reserve(key, block.size, f.dataset, copy=not f.keep)
        if res is None and not f.keep:
            self._borrow(key, block)
            if not f.future.done():
                f.future.set_result(block)
            self.finished(key, True)
            return
        if res is None:
            self._passed(key, block)
            self.finished(key, False)
        else:
            self._writing[key] = block
            block.written = asyncio.get_running_loop().create_future()
            self.queue.backlog += block.size

            def written(kept: bool) -> None:
                self.queue.backlog -= block.size
                self._pump()
                if self._writing.get(key) is block:
                    del self._writing[key]
                if not kept:
                    self._passed(key, block)
                assert block.written is not None
                block.written.set_result(kept)
                self.finished(key, kept)
                if kept and f.prefetch:  # for prefetch accuracy; a reader that caught it in
                    # flight (raised to demand) has read it already
                    self.store.prefetched(key, block.size, read=f.entry.priority == DEMAND)

            self.store.write(res, block.view, block.digest, written, block.chunks,
                             block.padded)
        if not f.future.done():
            f.future.set_result(block)

    def _passed(self, key: BlockKey, block: Block) -> None:
        self.metrics.passthrough_bytes.inc(block.size)
        self.passed[key] = block.digest
        while len(self.passed) > 4096:
            self.passed.popitem(last=False)

    def _retry(self, fetches: list[Fetch], cause: str) -> None:
        """Try again after a pause (each fetch's own backoff; together, so the blocks of a
        failed request go out again in one request); past a fetch's deadline it fails."""
        now = time.monotonic()
        policy = UPSTREAM.within(self.deadline)
        again, delay = [], 0.0
        for f in fetches:
            if f.delays is None:
                f.delays = policy.delays()
            pause = policy.pause(next(f.delays), now - f.started)
            if pause is None:
                url = self.routes.url(f.dataset) or self.upstream
                self._log_deadline(now, url, cause)
                self._end(f, error=UpstreamUnavailable(
                    f"upstream {url} unreachable for {self.deadline:g}s while "
                    f"fetching block {f.key[1]} of {f.key[0]} ({f.dataset}): {cause}",
                    url, cause))
                continue
            # Held out of the queue until the pause is over (one last try at the deadline).
            delay = max(delay, pause)
            again.append(f)
        if again:
            asyncio.get_running_loop().call_later(delay, self._requeue_all, again)

    def _log_deadline(self, now: float, url: str, cause: str) -> None:
        # At most one line in 10 s: an outage fails every block in flight at once.
        last, count = self._deadline_logged or (now - 10.0, 0)
        if now - last < 10.0:
            self._deadline_logged = (last, count + 1)
            return
        log.warning("deadline exceeded: upstream %s gave no block for %g s (%d more blocks "
                    "since the last such line): %s", url, self.deadline, count,
                    cause, extra={"event": "deadline_exceeded", "upstream": url})
        self._deadline_logged = (now, 0)

    def _requeue_all(self, fetches: list[Fetch]) -> None:
        for f in fetches:
            self._requeue(f)

    def _requeue(self, f: Fetch) -> None:
        live = self._fetches.get(f.key) is f or self._direct.get(f.key) is f
        if live and f.entry.state != QUEUED:
            self._assign(f, f.entry)  # a member may have gone down or come back meanwhile
            self.queue.requeue(f.entry)
            self._pump()

    def stats(self) -> dict[str, object]:
        return {"requests": self.queue.active, "queued": self.queue.queued,
                "inflight_bytes": self.queue.inflight_bytes,
                "writing": len(self._writing), "borrowed_bytes": self.borrowed_bytes}
