"""The spoke's block store: verified blocks packed into segment files, indexed in memory.

Layout of ``cache_dir``::

    lock                         flock'd by the one process that owns the folder; holds its pid
    instance                     the folder's random id (spokefs.cache.shared)
    index.sqlite                 what is resident (WAL mode), object sizes, small facts
                                 (spokefs.cache.index)
    segments/<id>.seg            blocks appended at 4 KiB boundaries (spokefs.cache.segments)
    manifests/<dataset>/<snapshot>.json.gz   (spokefs.cache.durable)

One owner. ``open`` takes an exclusive ``flock`` on ``lock`` and holds it until ``close`` (or
the process ends: a killed spoke leaves no stale lock), so a second spoke, or a mount's embedded
cache, on the same folder fails at once with ``CacheLocked`` naming the holder's pid instead of
freeing regions the first one still indexes. Readers that only read -- a spoke's replica
workers and a same-host mount (spokefs.cache.shared), ``spokefs.cache.inspect`` -- never take
the lock and are never blocked by it. File names are built from integers (segment ids) and
fixed names only; the one path built from names that can come from upstream, a manifest's, is
checked right before it is built (``manifest_path``).

Who does what. The event loop owns the index in memory (a dict of ``Loc``) and the eviction
policy and never waits on the disk or on SQL; it queues the index file's rows
(``spokefs.cache.index``, which owns that file), and one worker thread
(``spokefs.cache.worker``) writes blocks into their regions (gathered:
``spokefs.cache.segments``), frees evicted regions (hole punching) and commits the queued rows
in batches. A block costs no file, no rename, no fsync and no commit of its own.

Why this is crash-safe without an fsync per block: every byte served is checked against a
digest first. Each block keeps the upstream's xxh3-128 digest and an xxh3-64 digest of each
``chunk_size`` piece (256 KiB); a read checks the pieces it touches, every time (about 40 us
for a 128 KiB read, 0.1 s per GiB of large reads). So a row whose bytes never reached the
disk, a torn write, bit rot or a stray write is caught on the read, the block is dropped and
fetched again, and never served. The check runs on the reader's own copy of the bytes (one
``pread``), so what was checked is what is served; a spoke's read of 1 MiB or more is checked
on a copy in a thread and then sent with sendfile from the same region, which ``hold`` keeps
from being freed (or evicted) until the send is done. At open, regions that no row points to
(a crash between write and commit) are freed, and rows whose segment is gone are dropped.

``capacity`` is a hard bound on the disk bytes of resident plus reserved blocks (each rounded
up to 4 KiB); the eviction policy (spokefs.policy) chooses victims. When nothing can be
evicted (all pinned) or the disk refuses a write, ``reserve`` returns None or the write fails,
and the caller serves the bytes it has without keeping them ("pass-through").
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from spokefs.cache import index as block_index
from spokefs.cache.durable import manifest_file
from spokefs.cache.index import BlockIndex, BlockRow, Loaded
from spokefs.cache.segments import (
    BlockWrite,
    Segment,
    SegmentFiles,
    WriteGatherer,
    aligned,
    check_hole_punching,
)
from spokefs.cache.storm import StormWatch
from spokefs.cache.worker import StoreWorker
from spokefs.errors import CacheLocked, ConfigError
from spokefs.policy import BlockKey, EvictionPolicy

try:  # the native core: required (docs/architecture.md, "The native core")
    from spokefs import _native
except ImportError as exc:
    raise ImportError("spokefs's native core (spokefs._native) is not built: run `make setup` "
                      "or `pip install -e .` (needs cargo, from https://rustup.rs)") from exc

log = logging.getLogger(__name__)

CHUNK = 256 * 1024

INSTANCE_FILE = "instance"
KEY_FILE = "internal.key"  # the internal routes' credential for same-host readers (0600)
LOCK_FILE = "lock"
def lock_folder(root: Path) -> int | None:
    """Take the cache folder's lock for this process (the descriptor holds it; closing it lets
    go). CacheLocked, naming the folder and the holder's pid, if another process has it. None
    (and a warning) where the filesystem has no locks: the folder is then unguarded."""
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            pid = ""
        os.close(fd)
        holder = f"process {pid}" if pid.isdigit() else "another process"
        raise CacheLocked(
            f"cache folder {root} is in use by {holder} (another spoke, or a mount with an "
            f"embedded cache, holds {path}); give each one a --cache-dir of its own, or stop "
            "that one first") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            log.warning("cache: %s has no file locks (%s); nothing stops a second spoke from "
                        "using the folder at the same time", root, exc)
            return None
        raise
    try:  # who holds it, for the message above (the lock itself is the flock, not this)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a full volume: the lock still holds, the message names no pid
    return fd


def _kept_secret(path: Path, nbytes: int, mode: int) -> str:
    """A random hex string made once and kept at ``path`` (written whole, then renamed into
    place, never through a symlink); the one already there if there is one."""
    try:
        existing = path.read_text().strip()
        if existing:
            return existing
    except FileNotFoundError:
        pass
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(nbytes) + "\n")
    tmp.replace(path)
    return path.read_text().strip()


def instance_id(cache_dir: Path) -> str:
    """The cache folder's id, made once and kept in the folder: what another process reads
    to prove it sees this very folder (spokefs.cache.shared)."""
    return _kept_secret(cache_dir / INSTANCE_FILE, 16, 0o644)


def internal_key(cache_dir: Path) -> bytes:
    """The cache folder's secret, made once (mode 0600): a process that can read it can read
    the cache files too, so presenting it (``X-Spokefs-Internal``) is what lets a same-host
    reader of those files (a mount's short circuit) use the spoke's internal routes."""
    return _kept_secret(cache_dir / KEY_FILE, 32, 0o600).encode()


def _make_private(root: Path) -> None:
    """The cache folder is the spoke user's alone (mode 0700): its files are the dataset's
    bytes, readable by nobody the spoke's tokens would not let read them, and a same-host
    reader trusts only a folder so kept (``cache.shared.SharedCache.trusted_key``)."""
    mode = os.stat(root).st_mode & 0o777
    if mode & 0o077:
        os.chmod(root, mode & 0o700)
        log.info("cache: %s is now mode %o (was %o): the spoke's user's alone", root,
                 mode & 0o700, mode)


def chunk_digests(data: memoryview | bytes, chunk: int = CHUNK) -> bytes:
    """xxh3-64 of each ``chunk``-byte piece, concatenated (8 bytes a piece, big-endian as
    ``xxhash.xxh3_64_digest``); b"" for no data. Any buffer (bytes, bytearray, memoryview);
    native, without the GIL for 64 KiB or more."""
    return _native.chunk_digests(data, chunk)


@dataclass(slots=True, eq=False)
class Loc:
    """Where a resident block is and what its bytes must hash to."""

    seg: Segment
    offset: int
    size: int
    digest: bytes     # xxh3-128 of the whole block, as the upstream sent it
    chunks: bytes     # xxh3-64 of each chunk_size piece
    dataset: str
    stored: float = 0.0  # when it was written (time.time()): what a time-to-live counts from


def read_loc(loc: Loc, lo: int, hi: int, chunk: int = CHUNK,
             scratch: bytearray | None = None) -> memoryview | None:
    """Bytes [lo, hi) of a block, read into a buffer (``scratch`` if given and large enough,
    else a new one) and checked there against the digests of the chunks they touch; None if
    they do not match (or cannot be read). The whole chunks around [lo, hi) are read, so a
    scratch of ``hi - lo + 2 * chunk`` bytes is always large enough; the view returned is
    of ``scratch`` when used (valid until it is reused). Safe in any thread: one native call
    (pread and checks) without the GIL."""
    if hi <= lo:
        return memoryview(b"")
    a = lo - lo % chunk
    b = min(loc.size, hi + (-hi % chunk))
    if scratch is not None and len(scratch) >= b - a:
        buf = memoryview(scratch)[:b - a]
    else:
        buf = memoryview(bytearray(b - a))
    if not _native.read_checked(loc.seg.fd, loc.offset + a, buf, a, chunk, loc.chunks):
        return None
    return buf[lo - a:hi - a]


def read_loc_into(loc: Loc, lo: int, out: memoryview, chunk: int = CHUNK,
                  scratch: bytearray | None = None) -> bool:
    """Fill ``out`` with checked bytes [lo, lo+len(out)) of a block: read in place when the
    range is whole chunks (a streaming read), else through ``scratch``; False if they do
    not match their digests (or cannot be read). Safe in any thread: one native call
    (pread and checks) without the GIL."""
    hi = lo + len(out)
    if lo % chunk == 0 and (hi % chunk == 0 or hi == loc.size):
        return _native.read_checked(loc.seg.fd, loc.offset + lo, out, lo, chunk, loc.chunks)
    data = read_loc(loc, lo, hi, chunk, scratch)
    if data is None:
        return False
    out[:] = data
    return True


@dataclass(slots=True, eq=False)
class Reservation:
    """Room for one block being fetched: a region of a segment, counted against capacity."""

    key: BlockKey
    size: int
    dataset: str
    seg: Segment
    offset: int
    chunks: bytes = b""
    copy: bool = False  # a tier member's copy of a block another member owns
    seq: int = 0  # the store's count of reservations when made (``forget_writes``)


@dataclass(slots=True, eq=False, kw_only=True)
class _Write(BlockWrite):
    """A block write with what indexing it needs once written."""

    res: Reservation
    digest: bytes
    done: Callable[[bool], None] | None


class StoreEvents:
    """Counters the store bumps; the service maps them onto Prometheus metrics. ``changed``
    hears every block that became resident (with its Loc) or left (None)."""

    def __init__(self) -> None:
        self.on_evict: Callable[[int], None] = lambda n: None
        self.on_corrupt: Callable[[], None] = lambda: None
        self.on_write_error: Callable[[str], None] = lambda reason: None
        self.on_prefetch_used: Callable[[int], None] = lambda nbytes: None
        self.changed: list[Callable[[BlockKey, Loc | None], None]] = []


class BlockStore:
    """The block cache on disk: where each block is, what it costs, and every read checked.

    Why one class of ~570 lines: its invariant, "the bytes counted against the capacity are
    the bytes the index and the segment files hold", is kept by reservations, evictions,
    writes and recovery together, so they live together. What could leave it has: the index
    (``cache.index``), write gathering (``cache.segments``), the writer thread
    (``cache.worker``) and the checked reads (the native core)."""

    def __init__(self, root: Path, capacity: int, policy: EvictionPolicy,
                 fsync: bool = True, chunk_size: int = CHUNK, direct_io: bool = False,
                 busy_timeout: float = 30.0) -> None:
        self.root = root
        self.busy_timeout = busy_timeout  # how long opening waits out a lock on the index
        self._lock_fd: int | None = None
        self.capacity = capacity
        self.policy = policy
        self.fsync = fsync
        self.chunk_size = chunk_size
        self.events = StoreEvents()
        self._storm = StormWatch()
        self._prefetched: dict[BlockKey, int] = {}  # prefetched blocks not read yet: size
        self.used = 0          # aligned bytes of indexed blocks (what capacity bounds)
        self.data_bytes = 0    # their exact bytes
        self.reserved = 0      # aligned bytes of blocks being fetched or written
        self.writable = True   # False after a write failed (disk full, read-only): pass-through
        self._records: dict[BlockKey, Loc] = {}
        self.dataset_bytes: dict[str, int] = {}  # exact bytes resident, per dataset
        self.dataset_reserved: dict[str, int] = {}  # exact bytes being written, per dataset
        # Whether a block of (dataset, size) may be kept (per-dataset policies; None: all).
        self.admit: Callable[[str, int], bool] | None = None
        self._segs = SegmentFiles(root / "segments", direct=direct_io)
        self._index: BlockIndex | None = None
        self._worker: StoreWorker | None = None
        self._loop_call: Callable[[Callable[[], None]], None] | None = None
        self._touched: dict[BlockKey, float] = {}
        self._last_flush = 0.0
        self._write_error_logged = False
        self._sizes: dict[str, int] = {}   # version -> object size
        self._kv: dict[str, str] = {}
        self._pending: dict[int, int] = {}  # segment id -> reservations being written
        # Reservations up to these counts are not kept when their writes end: a purge
        # (per dataset, None: all) forgets what was being fetched when it ran.
        self._seq = 0
        self._forgotten: dict[str | None, int] = {}
        self._held: dict[BlockKey, list] = {}  # key -> [holders, Loc, removed meanwhile]
        self.instance = ""  # the folder's id (spokefs.cache.shared), set by open()
        self.key: bytes | None = None  # the folder's internal key (internal_key), by open()
        self._gather: WriteGatherer[_Write] = WriteGatherer(self._segs)

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self, call_in_loop: Callable[[Callable[[], None]], None] | None = None
             ) -> BlockStore:
        """Load the index and start the worker (blocking: call it before serving, off the
        loop). ``call_in_loop(fn)`` runs fn on the owner's event loop from the worker
        (``loop.call_soon_threadsafe``); without it, fn runs in the worker (tests)."""
        self._loop_call = call_in_loop
        self.root.mkdir(parents=True, exist_ok=True)
        # Cached bytes are a copy of the data: readable by this service's user only (a mount
        # on this host reads them only as that user, else it reads over HTTP).
        os.chmod(self.root, 0o700)
        # First of all: nothing below (least of all dropping an index) happens in a folder
        # another process owns.
        self._lock_fd = lock_folder(self.root)
        try:
            return self._open_locked()
        except BaseException:
            if self._index is not None:  # failed after the index opened: not started yet
                self._index.close()
                self._index = None
                self._worker = None
            self._segs.close()
            self._unlock()
            raise

    def _open_locked(self) -> BlockStore:
        for sub in ("segments", "manifests"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        check_hole_punching(self.root / "segments")
        try:
            index = BlockIndex.open(self.root, self.busy_timeout)
            try:
                loaded = index.load()
            except BaseException:
                index.close()
                raise
        except sqlite3.Error as exc:
            path = self.root / block_index.FILE
            why = block_index.why_unusable(exc, self.root)
            if why is None:
                # Busy ("database is locked": another process has the index open and writes
                # to it, past busy_timeout), unreadable, an I/O error: the blocks may be
                # perfectly good. Fail to start, loudly, and leave every byte as it is.
                raise ConfigError(
                    f"cache: cannot open the index {path}: {exc}. The cache was left as it "
                    "is; if another process uses this folder, stop it, then start again"
                    ) from exc
            # Damaged, or no room to open it: without the index no block can be trusted, so
            # start empty rather than fail to start (a crash loop needs an operator).
            # Removing the segments also frees their space.
            log.error("cache: index %s is unusable: %s (%s); starting with an empty cache",
                      path, why, exc)
            block_index.remove(self.root)
            shutil.rmtree(self.root / "segments", ignore_errors=True)
            (self.root / "segments").mkdir()
            index = BlockIndex.open(self.root, self.busy_timeout)
            loaded = Loaded()
        self._index = index  # closed by open() if anything below fails
        if index.old_format_dropped:
            log.warning("cache: %s holds blocks in an older format; they are dropped and will "
                        "be fetched again", self.root)
            for old in ("blocks", "tmp"):  # format 1: a file per block
                shutil.rmtree(self.root / old, ignore_errors=True)
        self._sizes, self._kv = loaded.object_sizes, loaded.kv
        self.instance = instance_id(self.root)
        self.key = internal_key(self.root)
        _make_private(self.root)
        self._worker = StoreWorker(index, self.fsync, self._index_failed)
        self._recover(loaded.blocks)
        self._worker.start()
        return self

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # lets go of the flock
            self._lock_fd = None

    def manifest_path(self, dataset: str, snapshot_id: str) -> Path:
        """Where a manifest is kept in this folder; ManifestError unless the dataset is a
        dataset name and the id a snapshot id (either may have come from upstream)."""
        return manifest_file(self.root, dataset, snapshot_id)

    def _recover(self, rows: list[BlockRow]) -> None:
        files = self._segs.existing()
        live: dict[int, list[tuple[int, int]]] = {}
        dropped = []
        # Millions of rows at a large cache's start: the loop keeps to locals.
        records, by_dataset, insert = self._records, self.dataset_bytes, self.policy.insert
        segments, chunk_size = self._segs.segments, self.chunk_size
        used = data_bytes = 0
        for row in rows:
            seg_id, off, size, chunks = row.seg, row.off, row.size, row.chunks
            seg = segments.get(seg_id)
            if seg is None and (path := files.get(seg_id)) is not None:
                try:
                    seg = self._segs.open_existing(seg_id, path)
                except OSError as exc:
                    log.warning("cache: cannot open segment %s: %s", path, exc)
                    files.pop(seg_id, None)
            expect = len(chunks) == 8 * -(-size // chunk_size) if size else chunks == b""
            key = (row.version, row.idx)
            if seg is None or off % 4096 or off + size > seg.size or not expect:
                dropped.append(key)
                continue
            dataset, room = row.dataset, aligned(size)
            records[key] = Loc(seg, off, size, row.digest, chunks, dataset, float(row.stored))
            by_dataset[dataset] = by_dataset.get(dataset, 0) + size
            seg.live += 1
            seg.live_bytes += room
            used += room
            data_bytes += size
            insert(key, size)
            live.setdefault(seg_id, []).append((off, room))
        self.used += used
        self.data_bytes += data_bytes
        for key in dropped:
            self.index.delete(key)
        orphans = 0
        for seg_id, path in files.items():
            seg = self._segs.segments.get(seg_id)
            if seg is None:  # no block in it: a crash after writing, before any commit
                path.unlink(missing_ok=True)
                orphans += 1
                continue
            # Free what no row points to (written, never committed), gap by gap.
            at = 0
            for off, n in sorted(live.get(seg_id, [])):
                if off > at:
                    self._segs.punch(seg, at, off - at)
                at = max(at, off + n)
            if at < seg.size:
                self._segs.punch(seg, at, seg.size - at)
        if rows or orphans:
            log.info("cache: %d blocks (%d bytes) resident in %d segments; %d rows dropped, "
                     "%d empty segments removed", len(self._records), self.used,
                     len(self._segs.segments), len(dropped), orphans)
        self._evict_to(self.capacity)

    def close(self) -> None:
        if self._worker is not None:
            self.flush_access_times(force=True)
            cur = self._segs.current
            if cur is not None and cur.live == 0 and cur.id not in self._pending:
                self._segs.forget(cur)  # nothing in it: leave no empty file behind
                self._worker.submit(lambda: self._segs.remove(cur))
            self._worker.close()
            self._worker = None
        if self._index is not None:
            self._index.close()
            self._index = None
        self._segs.close()
        self._unlock()  # last: the folder is consistent on disk before another may take it

    @property
    def worker(self) -> StoreWorker:
        if self._worker is None:
            raise RuntimeError("BlockStore.open() was not called")
        return self._worker

    @property
    def index(self) -> BlockIndex:
        """The index file's writer (rows queued here are committed by the worker)."""
        if self._index is None:
            raise RuntimeError("BlockStore.open() was not called")
        return self._index

    def _in_loop(self, fn: Callable[[], None]) -> None:
        (self._loop_call or (lambda f: f()))(fn)

    # -- reads -------------------------------------------------------------------------------
    def get(self, key: BlockKey) -> Loc | None:
        return self._records.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._records))

    def read(self, key: BlockKey, lo: int, hi: int) -> memoryview | None:
        """Checked bytes [lo, hi) of a resident block, in a buffer of their own. None if
        absent or damaged (a damaged block is dropped and counted; the caller fetches it
        again)."""
        loc = self._records.get(key)
        if loc is None:
            return None
        data = read_loc(loc, lo, hi, self.chunk_size)
        if data is None:
            self.corrupt(key, loc)
            return None
        self.touch(key)
        return data

    def corrupt(self, key: BlockKey, loc: Loc) -> None:
        """A check found ``loc``'s bytes damaged: drop the block (if still that one)."""
        if self._records.get(key) is not loc:
            return
        self.events.on_corrupt()
        log.warning("cache: block %s-%d failed its integrity check; dropped, will refetch",
                    key[0], key[1], extra={"event": "integrity_failure", "where": "cache"})
        self.drop(key, "corrupt")

    def touch(self, key: BlockKey) -> None:
        if key in self._records:
            self.policy.access(key)
            self._touched[key] = time.time()
            if self._prefetched and (size := self._prefetched.pop(key, None)) is not None:
                self.events.on_prefetch_used(size)

    def prefetched(self, key: BlockKey, size: int, read: bool = False) -> None:
        """A prefetch brought ``key``: its first read counts as a prefetch used (``read``:
        a reader already took it on arrival)."""
        if read:
            self.events.on_prefetch_used(size)
        elif key in self._records:
            self._prefetched[key] = size

    def flush_access_times(self, force: bool = False) -> None:
        """Persist recent access times (batched: eviction order survives a restart)."""
        now = time.monotonic()
        if not force and now - self._last_flush < 5.0:
            return
        touched, self._touched = self._touched, {}
        self._last_flush = now
        records = self._records
        self.index.touch((k, t) for k, t in touched.items() if k in records)

    # -- writes ------------------------------------------------------------------------------
    def reserve(self, key: BlockKey, size: int, dataset: str,
                copy: bool = False) -> Reservation | None:
        """Room for a block about to be written; None when it cannot be kept (already
        resident, not writable, larger than the cache, or everything else pinned).
        ``copy``: a copy of a block another tier member owns, which only free room or other
        copies make room for (a policy that ``keeps_copies``; None with one that does not)."""
        need = aligned(size)
        if key in self._records or not self.writable or need > self.capacity:
            return None
        if copy and not self.policy.keeps_copies:
            return None
        if self.admit is not None and not self.admit(dataset, size):
            return None  # the dataset's policy keeps it out (served, not kept)
        if not self._evict_to(self.capacity - need, copies_only=copy, dataset=dataset):
            return None
        prev = self._segs.current
        try:
            seg, offset = self._segs.allocate(size)
        except OSError as exc:
            self._write_failed(exc)
            return None
        if prev is not None and prev is not seg:
            self._maybe_remove(prev)
        self.reserved += need
        self.dataset_reserved[dataset] = self.dataset_reserved.get(dataset, 0) + size
        self._pending[seg.id] = self._pending.get(seg.id, 0) + 1
        self._seq += 1
        return Reservation(key, size, dataset, seg, offset, copy=copy, seq=self._seq)

    def write(self, res: Reservation, data: memoryview, digest: bytes,
              done: Callable[[bool], None] | None = None, chunks: bytes | None = None,
              padded: memoryview | None = None) -> None:
        """Write a verified block into its reservation (in the worker), then index it (on the
        loop) and call ``done(kept)``. ``data`` must not change until then.

        Writes are gathered (``spokefs.cache.segments.WriteGatherer``): the worker writes
        every block queued so far in one job and reports them back in one call.

        ``padded``: the same bytes in a page-aligned buffer, followed by whatever fills it up
        to the region's 4 KiB boundary; given, the block is written with direct I/O
        (``BlockWrite``)."""
        # Given (the fetcher hashed a large block off the loop) or made here (~2 us/128 KiB).
        res.chunks = chunk_digests(data, self.chunk_size) if chunks is None else chunks
        write = _Write(res.seg, res.offset, res.size, data, padded, res=res, digest=digest,
                       done=done)
        if self._gather.add(write):
            self.worker.submit(self._write_queued_blocks)

    def _write_queued_blocks(self) -> None:
        """(worker) Write every queued block; report back once."""
        batch = self._gather.write_queued(self.worker.wrote)
        self._in_loop(lambda: self._written(batch))

    def _written(self, batch: list[_Write]) -> None:
        for w in batch:
            if w.error is None:
                kept = self._commit(w.res, w.digest)
            else:
                kept = False
                self._release(w.res)
                self._write_failed(w.error)
            if w.done is not None:
                w.done(kept)

    def cancel(self, res: Reservation) -> None:
        """Give back a reservation that will not be written (the fetch failed)."""
        self._release(res)
        self.worker.submit(lambda: self._segs.punch(res.seg, res.offset, res.size))
        self._maybe_remove(res.seg)

    def _release(self, res: Reservation) -> None:
        self.reserved -= aligned(res.size)
        left_ds = self.dataset_reserved.get(res.dataset, 0) - res.size
        if left_ds > 0:
            self.dataset_reserved[res.dataset] = left_ds
        else:
            self.dataset_reserved.pop(res.dataset, None)
        left = self._pending.get(res.seg.id, 1) - 1
        if left:
            self._pending[res.seg.id] = left
        else:
            self._pending.pop(res.seg.id, None)

    def _commit(self, res: Reservation, digest: bytes) -> bool:
        self._release(res)
        key, size = res.key, res.size
        forgotten = max(self._forgotten.get(None, 0), self._forgotten.get(res.dataset, 0))
        if key in self._records or not self.writable or res.seq <= forgotten:
            # raced another write of it, a switch to pass-through, or a purge: served, not kept
            self.worker.submit(lambda: self._segs.punch(res.seg, res.offset, size))
            self._maybe_remove(res.seg)
            return key in self._records
        now = time.time()
        loc = Loc(res.seg, res.offset, size, digest, res.chunks, res.dataset, now)
        self.dataset_bytes[res.dataset] = self.dataset_bytes.get(res.dataset, 0) + size
        self._records[key] = loc
        res.seg.live += 1
        res.seg.live_bytes += aligned(size)
        self.used += aligned(size)
        self.data_bytes += size
        if res.copy:
            self.policy.insert_copy(key, size)
        else:
            self.policy.insert(key, size)
        self.index.insert(key, res.seg.id, res.offset, size, digest, res.chunks, res.dataset,
                          now)
        for fn in self.events.changed:
            fn(key, loc)
        return True

    def _index_failed(self, exc: Exception) -> None:
        self._in_loop(lambda: self._write_failed(OSError(errno.ENOSPC, f"index: {exc}")))

    def _write_failed(self, exc: OSError) -> None:
        reason = errno.errorcode.get(exc.errno or 0, str(exc))
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                         errno.EIO):
            # The volume refuses writes: stop trying, serve by passing data through.
            self.writable = False
        if not self._write_error_logged:
            log.error("cache: cannot write to %s (%s); serving by passing data through "
                      "until the cache is writable again", self.root, exc)
            self._write_error_logged = True
        self.events.on_write_error(reason)

    def retry_writable(self) -> None:
        """Called periodically: after space was freed, try caching again."""
        if not self.writable:
            self.writable = True
            self._write_error_logged = False

    # -- eviction ----------------------------------------------------------------------------
    def _evict_to(self, limit: int, copies_only: bool = False,
                  dataset: str | None = None) -> bool:
        """Evict until used + reserved <= limit. False if pinned blocks prevent it (or,
        ``copies_only``, the tier copies there are: owned blocks stay; or the room is for
        ``dataset`` and what is left is others' reserved shares)."""
        n, before = 0, self.data_bytes
        policy = self.policy
        victim = (policy.copy_victim if copies_only else policy.victim if dataset is None
                  else functools.partial(policy.victim_for, dataset))
        while self.used + self.reserved > limit:
            key = victim()
            if key is None:
                break
            self._remove(key)
            n += 1
        if n:
            self.events.on_evict(n)
            storm = self._storm.evicted(before - self.data_bytes, time.monotonic(), self.capacity)
            if storm is not None:
                log.warning("cache: eviction storm: %d bytes evicted in the last %g s (%.0f%% "
                            "of the capacity): the working sets do not fit, or a scan is "
                            "flushing them", storm, self._storm.window_s,
                            100 * storm / max(1, self.capacity),
                            extra={"event": "eviction_storm", "evicted_bytes": storm})
        return self.used + self.reserved <= limit

    def _remove(self, key: BlockKey) -> None:
        loc = self._records.pop(key)
        self._prefetched.pop(key, None)  # evicted unread: a prefetch wasted
        self.policy.remove(key)
        left = self.dataset_bytes.get(loc.dataset, 0) - loc.size
        if left > 0:
            self.dataset_bytes[loc.dataset] = left
        else:
            self.dataset_bytes.pop(loc.dataset, None)
        self.used -= aligned(loc.size)
        self.data_bytes -= loc.size
        seg = loc.seg
        seg.live -= 1
        seg.live_bytes -= aligned(loc.size)
        self._touched.pop(key, None)
        self.index.delete(key)
        held = self._held.get(key)
        if held is not None and held[1] is loc:
            # Being sent (held): freed when the last sender lets go. Counted as reserved
            # meanwhile, so the disk still never holds more than the capacity.
            held[2] = True
            self.reserved += aligned(loc.size)
        else:
            self._free(loc)
        for fn in self.events.changed:
            fn(key, None)

    def _free(self, loc: Loc) -> None:
        # Freed in the worker, in order after any write queued before: the disk never holds
        # more than the capacity, and no later job touches a removed segment.
        seg = loc.seg
        self.worker.submit(lambda: self._segs.punch(seg, loc.offset, loc.size))
        self._maybe_remove(seg)

    def _maybe_remove(self, seg: Segment) -> None:
        if (seg.live == 0 and seg.held == 0 and seg.id not in self._pending
                and seg is not self._segs.current and seg.id in self._segs.segments):
            self._segs.forget(seg)
            self.worker.submit(lambda: self._segs.remove(seg))

    # -- holding a block while its file region is sent ---------------------------------------
    def hold(self, key: BlockKey) -> Loc | None:
        """Keep a resident block's region from being freed (and the block from being
        evicted) until ``let_go``: for a sender that sends it from the file (sendfile)."""
        loc = self._records.get(key)
        if loc is None:
            return None
        held = self._held.get(key)
        if held is None or held[1] is not loc:
            if held is not None:  # an earlier copy, evicted and still being sent
                return None
            self._held[key] = [1, loc, False]
        else:
            held[0] += 1
        loc.seg.held += 1
        self.policy.pin(key)
        return loc

    def let_go(self, key: BlockKey, loc: Loc) -> None:
        held = self._held.get(key)
        if held is None or held[1] is not loc:
            return
        held[0] -= 1
        loc.seg.held -= 1
        self.policy.unpin(key)
        if held[0] == 0:
            del self._held[key]
            if held[2]:  # removed while held: free it now
                self.reserved -= aligned(loc.size)
                self._free(loc)
            else:
                self._maybe_remove(loc.seg)

    def drop(self, key: BlockKey, reason: str) -> None:
        if key in self._records:
            self._remove(key)
            log.debug("cache: dropped %s-%d (%s)", key[0], key[1], reason)

    def purge_keys(self, dataset: str | None = None, keep: Container[str] = ()
                   ) -> list[BlockKey]:
        """Blocks (of ``dataset``) whose version is not in ``keep``: what a purge drops."""
        return [k for k, loc in self._records.items()
                if (dataset is None or loc.dataset == dataset) and k[0] not in keep]

    def forget_writes(self, dataset: str | None = None) -> None:
        """Blocks (of ``dataset``; None: all) being fetched or written now are not kept when
        their writes end (their readers still get them): after a purge, nothing it was
        meant to drop comes back from a fetch that was in flight."""
        self._forgotten[dataset] = self._seq

    def size_of(self, key: BlockKey) -> int:
        loc = self._records.get(key)
        return 0 if loc is None else loc.size

    # -- small persistent facts --------------------------------------------------------------
    def object_size(self, version: str) -> int | None:
        return self._sizes.get(version)

    def set_object_size(self, version: str, size: int) -> None:
        if self._sizes.get(version) != size:
            self._sizes[version] = size
            self.index.set_object_size(version, size)

    def kv_get(self, key: str) -> str | None:
        return self._kv.get(key)

    def kv_set(self, key: str, value: str, soon: bool = False) -> None:
        """Keep a small fact; ``soon``: committed as the worker's next job rather than within
        its commit interval (a dataset's newest state, which a restart with the upstream
        down serves from)."""
        if self._kv.get(key) != value:
            self._kv[key] = value
            self.index.set_kv(key, value)
            if soon and self._worker is not None:
                self._worker.commit_soon()

    def kv_delete(self, key: str) -> None:
        if self._kv.pop(key, None) is not None:
            self.index.delete_kv(key)

    def kv_items(self, prefix: str) -> list[tuple[str, str]]:
        return sorted((k, v) for k, v in self._kv.items() if k.startswith(prefix))

    def pin(self, key: BlockKey) -> None:
        self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.policy.unpin(key)

    def set_future(self, keys: Sequence[BlockKey], stream: str, append: bool = False) -> None:
        """The blocks a job will read, in order (a policy that looks ahead evicts by it;
        others ignore it). ``append``: after what the stream was told before."""
        fn = getattr(self.policy, "extend_future" if append else "set_future", None)
        if fn is not None:
            fn(keys, stream)

    def disk_bytes(self) -> int:
        return self._segs.disk_bytes()

    def by_dataset(self) -> dict[str, list[int]]:
        """dataset -> [blocks, bytes] of what is resident (call on the owner's loop)."""
        out: dict[str, list[int]] = {}
        for loc in self._records.values():
            row = out.setdefault(loc.dataset, [0, 0])
            row[0] += 1
            row[1] += loc.size
        return out

    def use_times(self) -> dict[str, tuple[float, float]]:
        """dataset -> (least, most recent use) of its committed blocks, from the index (a
        connection of its own: safe in a thread; the index lags up to 50 ms and access times
        up to the last flush)."""
        return block_index.use_times(self.root, self.busy_timeout)

    def stats(self) -> dict[str, object]:
        return {"dir": str(self.root.resolve()), "id": self.instance,
                "chunk_size": self.chunk_size, "blocks": len(self._records),
                "used_bytes": self.used,
                "data_bytes": self.data_bytes,
                "capacity_bytes": self.capacity, "reserved_bytes": self.reserved,
                "segments": len(self._segs.segments), "writable": self.writable,
                "policy": self.policy.name,
                **({"tier_copy_bytes": self.policy.copy_bytes}
                   if self.policy.keeps_copies else {})}
