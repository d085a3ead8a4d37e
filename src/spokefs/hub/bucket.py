"""A dataset in an object store: ``spokefs hub serve s3://bucket/prefix`` (or ``gs://``,
``az://``; docs/s3.md).

The objects under the prefix are published as a dataset (keys become paths), through the same
HTTP API as a directory (``wire/server.py``), so spokes, mounts and clients work unchanged.

- **A snapshot is a listing**, pinned by each object's ETag (and VersionId where the bucket
  keeps versions): no byte is read to make one, so a snapshot of a large bucket costs its
  listing requests only (1,000 keys a request, no request per object).
- **A version id** binds bucket, key, size, ETag, VersionId and block size
  (``version_id``): blake2b-128, 32 lower-case hex digits, like a directory's (which digests
  the content instead: a bucket's identity is what it says of the object, so a snapshot need
  not read it). An overwritten object gets a new version id; cached blocks never mix.
- **Block digests are made as blocks are read** (xxh3-128, ``integrity``), then kept in the
  state database: a block read again is checked against the digest it had the first time
  (never served if it differs). ``spokefs hub snapshot s3://... --hash`` reads and records
  them all ahead.
- **Every read is conditional** (If-Match the ETag; the VersionId where known): an object
  overwritten or deleted since the snapshot is a 410 ``version_gone``, never other bytes.
  The hub reads whole blocks only, so every byte it serves is checked or recorded.

Keys that cannot be a path of a POSIX tree are left out, each with a warning (``key_paths``):
a key ending in "/" is a folder marker (an empty folder; left out if it has content), a key
with an empty, "." or ".." part is left out, and a key that is also a folder (``a/b`` when
``a/b/c`` exists) is left out: the folder wins, whatever order the keys were written in.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from spokefs import integrity
from spokefs.errors import BadRequest, IntegrityError, SpokeError, TooLarge, VersionGone
from spokefs.hub.backend import HubCounters
from spokefs.hub.snapshot import ScanResult, SnapshotLedger, default_state_dir, write_transaction
from spokefs.manifest import Manifest
from spokefs.origin.base import (
    BucketUrl,
    ObjectInfo,
    ObjectStoreOrigin,
    open_store,
    parse_store_url,
)
from spokefs.wire.backend import BlockPart, Segment

log = logging.getLogger(__name__)

MODE = 0o444            # published read-only; a bucket has no permission bits to keep
GETS_IN_FLIGHT = 64     # ranged GETs at once (S3: ~85-90 MB/s each, so a fast link needs many)
READ_AHEAD = 4          # blocks fetched ahead of a plain read's position
BATCH_BYTES = 64 << 20  # bytes one batch read may hold in memory (see read_blocks)
FLUSH_AFTER = 0.2       # seconds new digests wait, gathered, before they are written

def version_id(bucket: str, obj: ObjectInfo, block_size: int, scheme: str = "s3") -> str:
    """The version id of an object as listed (32 hex, the form ``manifest`` requires)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (scheme, bucket, obj.key, str(obj.size), obj.etag, obj.version_id or "",
                 str(block_size)):
        h.update(part.encode())
        h.update(b"\0")  # no part holds a NUL, so the parts cannot run into each other
    return h.hexdigest()


def key_paths(objects: Iterable[ObjectInfo], prefix: str
              ) -> tuple[dict[str, ObjectInfo], list[str], list[tuple[str, str]]]:
    """(path -> object, every folder sorted with "" first, [(key, why left out)])."""
    files: dict[str, ObjectInfo] = {}
    markers: set[str] = set()
    skipped: list[tuple[str, str]] = []
    for o in objects:
        rel = o.key[len(prefix):]
        if not rel or rel == "/":
            continue  # a marker of the prefix itself
        if rel.endswith("/"):
            if o.size:
                skipped.append((o.key, "it ends with '/' and has content (not a file name)"))
            elif _clean(rel[:-1]):
                markers.add(rel[:-1])
            continue
        if not _clean(rel):
            skipped.append((o.key, "it has an empty, '.' or '..' part, or a NUL"))
            continue
        files[rel] = o
    dirs = {""}
    for p in [*files, *markers]:
        parts = p.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    dirs.update(markers)
    for p in sorted(dirs.intersection(files)):
        skipped.append((files.pop(p).key, "it is also a folder (another key goes on under "
                                          "it): the folder is published"))
    return files, sorted(dirs), skipped


def _clean(path: str) -> bool:
    return "\x00" not in path and all(c not in ("", ".", "..") for c in path.split("/"))


class BucketState(SnapshotLedger):
    """An object store dataset's ledger: listed objects, snapshots, manifests, block digests
    (SQLite + manifest files in ``state_dir``)."""

    kind = "bucket"

    def __init__(self, url: BucketUrl, origin: ObjectStoreOrigin, state_dir: Path, name: str,
                 block_size: int = integrity.DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(state_dir, name, block_size)
        self.url = url
        self.origin = origin
        self.root = str(url)  # shown in status, as a directory hub shows its folder
        self.digests: dict[tuple[str, int], bytes] = {}

    def _source_key(self) -> str:
        return str(self.url)

    def open(self) -> BucketState:
        super().open()
        return self

    def _load_rows(self, db: sqlite3.Connection) -> dict[str, Any]:
        by_version = {r[0]: ObjectInfo(*r[1:]) for r in db.execute(
            "SELECT version, key, size, etag, version_id, mtime_ns FROM objects")}
        digests = {(r[0], r[1]): r[2] for r in db.execute(
            "SELECT version, idx, digest FROM digests")}
        digests.update(self.digests)  # made here and not yet written
        self.digests = digests
        return by_version

    def stored(self, version: str) -> ObjectInfo | None:
        return self._view.by_version.get(version)

    def save_digests(self, rows: list[tuple[str, int, bytes]]) -> None:
        with self._db_lock, write_transaction(self.db) as db:
            db.executemany("INSERT OR REPLACE INTO digests VALUES (?,?,?)", rows)

    # -- snapshots (blocking: the CLI, or a thread) --------------------------------------
    def scan(self, show_progress: bool = False) -> ScanResult:
        """List the bucket under the prefix and record a snapshot if anything changed."""
        objects = list(self.origin.list(self.origin.versioned()))
        files, dirs, skipped = key_paths(objects, self.url.prefix)
        for key, why in skipped:
            log.warning("left out key %r: %s", key, why)
        rows = []
        paths = sorted(files)
        versions = []
        for p in paths:
            o = files[p]
            v = version_id(self.url.bucket, o, self.block_size, self.url.scheme)
            versions.append(v)
            rows.append((v, o.key, o.size, o.etag, o.version_id, o.mtime_ns))
        m = Manifest(self.name, "", 0.0, self.block_size, paths, [files[p].size for p in paths],
                     [MODE] * len(paths), [files[p].mtime_ns for p in paths], versions, dirs)
        with self._db_lock:
            with write_transaction(self.db) as db:
                db.executemany("INSERT OR IGNORE INTO objects VALUES (?,?,?,?,?,?)", rows)
                result = ScanResult(*self._publish(db, m), 0, 0)
            self._load_locked()
        if result.created_new:
            s = result.snapshot
            log.info("snapshot %s of %s: %d objects, %d bytes (%d keys left out)", s.id,
                     self.name, s.files, s.bytes, len(skipped))
        return result



class BucketReads:
    """An object store dataset's blocks (``hub.backend.DatasetReads``): whole blocks by
    conditional ranged GETs, many in flight, one GET per block however many readers want it,
    each checked against its recorded digest or recorded now."""

    def __init__(self, counters: HubCounters, state: BucketState) -> None:
        self.st = state
        self.counters = counters
        self._gets: asyncio.Semaphore | None = None
        self._flying: dict[tuple[str, int], asyncio.Task[memoryview]] = {}
        self._pending: list[tuple[str, int, bytes]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._bound_memo: tuple[str, int, dict[str, object]] | None = None

    def _stored(self, version: str) -> ObjectInfo:
        obj = self.st.stored(version)
        if obj is None and self.st.refresh():
            obj = self.st.stored(version)
        if obj is None:
            self.counters.gone.inc()
            raise VersionGone(f"version {version} of a file in {self.st.name!r} is not on this "
                              "hub; use a newer snapshot")
        return obj

    async def digests(self, version: str) -> dict[str, object] | None:
        """A bucket's version ids name a listing, not content (``content_ids`` false): they
        commit to no digests, so there are none to give."""
        return None

    async def block_digest(self, version: str, index: int) -> bytes | None:
        return self.st.digests.get((version, index))

    # -- blocks ------------------------------------------------------------------------------
    async def _block(self, version: str, obj: ObjectInfo, index: int) -> memoryview:
        """Block ``index`` of ``obj``, checked against its recorded digest or recorded now.
        Readers of one block share one GET."""
        key = (version, index)
        task = self._flying.get(key)
        if task is None:
            # Its own task: a reader that gives up (a plain read cancels its read-ahead)
            # does not cancel the GET others wait for.
            task = asyncio.get_running_loop().create_task(self._fetch(version, obj, index))
            self._flying[key] = task
            task.add_done_callback(lambda t: self._landed(key, t))
        return await asyncio.shield(task)

    def _landed(self, key: tuple[str, int], task: asyncio.Task[memoryview]) -> None:
        if self._flying.get(key) is task:
            del self._flying[key]
        if not task.cancelled():
            task.exception()  # retrieved: no warning when every reader had gone

    async def _fetch(self, version: str, obj: ObjectInfo, index: int) -> memoryview:
        if self._gets is None:
            self._gets = asyncio.Semaphore(GETS_IN_FLIGHT)
        start, end = integrity.block_span(index, obj.size, self.st.block_size)
        async with self._gets:
            self.counters.origin_gets.inc()
            try:
                data = await self.st.origin.get(obj, start, end)
            except VersionGone:
                self.counters.gone.inc()
                raise
        self.counters.origin_bytes.inc(len(data))
        digest = integrity.block_digest(data)  # xxh3: ~0.3 ms for 4 MiB, not worth a thread
        known = self.st.digests.get((version, index))
        if known is None:
            self.st.digests[(version, index)] = digest
            self._pending.append((version, index, digest))
            if self._flusher is None:
                self._flusher = asyncio.get_running_loop().create_task(self._flush())
        elif known != digest:
            self.counters.mismatches.inc()
            log.error("block %d of %r (version %s) read from the bucket differs from its "
                      "recorded digest: not served", index, obj.key, version)
            raise IntegrityError(f"block {index} of version {version} differs from what the "
                                 "bucket gave before under the same ETag; not served")
        return data

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(FLUSH_AFTER)
        finally:
            self._flusher = None
        rows, self._pending = self._pending, []
        if rows:
            try:
                await asyncio.to_thread(self.st.save_digests, rows)
            except sqlite3.Error as exc:  # kept in memory; recomputed after a restart
                log.warning("could not record %d block digests: %s", len(rows), exc)

    async def read(self, version: str, start: int, end: int) -> AsyncIterator[Segment]:
        obj = self._stored(version)
        bs = self.st.block_size
        blocks = integrity.blocks_in_range(start, end, bs)
        ahead: dict[int, asyncio.Task[memoryview]] = {}
        try:
            for i in blocks:
                for j in range(i, min(i + READ_AHEAD, blocks.stop)):
                    if j not in ahead:
                        ahead[j] = asyncio.ensure_future(self._block(version, obj, j))
                data = await ahead.pop(i)
                lo = max(start - i * bs, 0)
                yield data[lo:min(end - i * bs, len(data))]
        finally:
            for t in ahead.values():
                t.cancel()

    async def read_blocks(self, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        bs = self.st.block_size
        # A batch is answered from memory (a folder's hub sends from its files): past
        # BATCH_BYTES the rest are error frames, so one request cannot hold gigabytes here.
        # A spoke asks for at most 16 MiB a request.
        budget = [max(BATCH_BYTES, bs)]

        async def one(version: str, index: int) -> BlockPart:
            try:
                obj = self._stored(version)
                if index >= integrity.block_count(obj.size, bs):
                    raise BadRequest(f"block {index} of {version} is past the end "
                                     f"({obj.size} bytes)")
                start, end = integrity.block_span(index, obj.size, bs)
                if end - start > budget[0]:
                    raise TooLarge(f"a batch read from a bucket hub is at most {BATCH_BYTES} "
                                   "bytes: ask for the rest in another request")
                budget[0] -= end - start
                data = await self._block(version, obj, index)
            except SpokeError as exc:
                return BlockPart.error(exc)
            return BlockPart(200, data, obj.size, self.st.digests[(version, index)])

        return list(await asyncio.gather(*(one(v, i) for v, i in blocks)))

    def status(self, snap_id: str | None) -> dict[str, object]:
        return {"digests": self._bound(snap_id) if snap_id else None}

    async def close(self) -> None:
        if self._flusher is not None:  # the digests made so far written, not lost
            await self._flusher
        close = getattr(self.st.origin, "close", None)
        if close is not None:
            await close()

    def _bound(self, snap_id: str) -> dict[str, object]:
        """How much of a snapshot's blocks have their digest recorded: a block without one
        takes as its truth what the bucket holds when it is first read (docs/s3.md,
        "Digests"); ``bound`` once every block has one (``hub snapshot --hash``). Counted
        again only when the snapshot or the number of recorded digests changed."""
        known = len(self.st.digests)
        if self._bound_memo is not None and self._bound_memo[:2] == (snap_id, known):
            return self._bound_memo[2]
        m = Manifest.decode(self.st.manifest_path(snap_id).read_bytes())
        bs, digests = self.st.block_size, self.st.digests
        blocks = unbound = 0
        for v, size in zip(m.versions, m.sizes, strict=True):
            n = integrity.block_count(size, bs)
            blocks += n
            unbound += sum((v, i) not in digests for i in range(n))
        doc: dict[str, object] = {"bound": unbound == 0, "blocks": blocks,
                                  "first_read_blocks": unbound}
        self._bound_memo = (snap_id, known, doc)
        return doc


# -- hashing ahead -------------------------------------------------------------------------
async def hash_all(state: BucketState, snap_id: str, parallel: int = 16) -> tuple[int, int]:
    """Read every block of a snapshot that has no digest yet and record it: (blocks, bytes).
    A block whose bytes differ from a digest already recorded stops it (IntegrityError)."""
    m = Manifest.decode(state.manifest_path(snap_id).read_bytes())
    reads = BucketReads(HubCounters(), state)
    todo = [(v, i) for v, size in zip(m.versions, m.sizes, strict=True)
            for i in range(integrity.block_count(size, state.block_size))
            if (v, i) not in state.digests]
    sem = asyncio.Semaphore(parallel)
    done = [0, 0]

    async def one(v: str, i: int) -> None:
        async with sem:
            obj = state.stored(v)
            assert obj is not None
            data = await reads._block(v, obj, i)
            done[0] += 1
            done[1] += len(data)

    try:
        await asyncio.gather(*(one(v, i) for v, i in todo))
    finally:
        await reads.close()
    return done[0], done[1]


# -- opening (hub/namespace.py, and ``spokefs hub snapshot`` of a bucket) -----------------
def state_tag(url: BucketUrl, endpoint: str | None) -> bytes:
    """What a bucket's default state folder is named after (``default_state_dir``)."""
    return f"{endpoint or ''}\0{url}".encode()


def open_bucket(source: str, name: str | None, state_dir: str | Path | None,
                block_size: int, endpoint: str | None) -> BucketState:
    """Checks the source, the credentials and the bucket before anything else is done."""
    from spokefs.wire.paths import check_dataset_name

    url = parse_store_url(source)
    origin = open_store(url, endpoint)
    origin.check()
    name = check_dataset_name(name or url.default_name)
    sdir = (Path(state_dir) if state_dir
            else default_state_dir(state_tag(url, origin.endpoint), name))
    return BucketState(url, origin, sdir, name, block_size).open()


def open_bucket_state(args: argparse.Namespace) -> BucketState:
    return open_bucket(args.dir, args.name, args.state_dir, args.block_size, args.endpoint_url)


def snapshot_bucket(args: argparse.Namespace) -> int:
    state = open_bucket_state(args)
    try:
        result = state.scan()
        out: dict[str, object] = {"dataset": state.name, "new": result.created_new,
                                  "files_hashed": 0, **result.snapshot.to_json()}
        if args.hash:
            blocks, nbytes = asyncio.run(hash_all(state, result.snapshot.id))
            out.update(blocks_hashed=blocks, bytes_hashed=nbytes)
    finally:
        state.close()
    print(json.dumps(out))
    return 0
