"""A mount of a whole namespace: every dataset the token may read, each a folder.

``spokefs mount http://spoke:8471/ /mnt/data`` shows ``/mnt/data/imagenet/...``,
``/mnt/data/coco/...``, one folder per dataset the upstream lists to this token
(``GET /v1/datasets``). The listing is asked again at most every ``LIST_TTL`` seconds, so a
dataset added at the hub appears without a remount. A dataset's snapshot is resolved, and
its manifest loaded, the first time anything inside its folder is looked up or listed; from
then on it stays pinned for as long as the mount lives, so a job that started on one
snapshot never sees another mid-run. For reproducible runs, pin ahead: ``--pin
DATASET@SNAPSHOT`` (repeatable, ``-o pin=...``) makes the folder DATASET that snapshot, and
``/mnt/data/DATASET@SNAPSHOT/...`` reaches any snapshot by name (looked up, never listed).

Inode numbers: the namespace root is 1 (FUSE's ROOT_INODE); member ``k`` (1, 2, ...: in the
order folders are first named) owns the numbers ``k << SHIFT | n`` for its own table's
inode ``n``, so each dataset keeps the numbering of a one-dataset mount and a member's root
is ``k << SHIFT | 1``. The table is sans-I/O: loading is injected (``NamespaceFS``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat as statmod
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3

from spokefs.errors import ConfigError, NotFound, ReadFailed, SpokeError
from spokefs.mount.fs import Reader, SnapshotFS
from spokefs.mount.inodes import ROOT, Attr, InodeTable, Perms
from spokefs.wire.paths import split_dataset_ref

log = logging.getLogger(__name__)

SHIFT = 40                  # 2**40 inodes per dataset: more files than any manifest holds
_LOCAL = (1 << SHIFT) - 1
LIST_TTL = 10.0             # seconds a listing of the datasets is trusted


@dataclass
class Member:
    """One folder of the namespace: a dataset at a snapshot, loaded on first use."""

    ref: str                          # the folder's name: "imagenet" or "imagenet@3fa9c1d2"
    dataset: str
    snapshot: str                     # "latest" until loaded, then the id it is pinned to
    table: InodeTable | None = None
    reader: Reader | None = None


class NamespaceTable:
    """The inode table of a namespace mount: the root's listing and the loaded members'
    tables, numbered apart (see the module doc). Same questions as ``InodeTable``."""

    def __init__(self, created_ns: int, pins: dict[str, str] | None = None) -> None:
        self.created_ns = created_ns
        self.pins = dict(pins or {})      # dataset -> snapshot its listed folder shows
        self.members: list[Member | None] = [None]  # index k; 0 is the root
        self.by_ref: dict[str, int] = {}
        self.listed: list[str] = []       # the datasets the root lists, sorted
        self.listed_at: float | None = None

    # -- members -----------------------------------------------------------------------------
    def set_listing(self, names: list[str], now: float) -> None:
        self.listed = sorted(set(names))
        self.listed_at = now
        for name in self.listed:
            self.member_for(name)

    def member_for(self, ref: str) -> int:
        """The member number of folder ``ref`` (a new one the first time it is named)."""
        k = self.by_ref.get(ref)
        if k is None:
            dataset, snap = split_dataset_ref(ref)
            if "@" not in ref:
                snap = self.pins.get(dataset, snap)
            k = len(self.members)
            self.members.append(Member(ref, dataset, snap))
            self.by_ref[ref] = k
        return k

    def member(self, ino: int) -> Member | None:
        k = ino >> SHIFT
        return self.members[k] if 0 < k < len(self.members) else None

    def loaded(self, ino: int) -> bool:
        m = self.member(ino)
        return m is not None and m.table is not None

    @staticmethod
    def member_root(k: int) -> int:
        return k << SHIFT | ROOT

    # -- numbering ---------------------------------------------------------------------------
    def _local(self, ino: int) -> tuple[Member, int] | None:
        m = self.member(ino)
        return None if m is None else (m, ino & _LOCAL)

    def is_dir(self, ino: int) -> bool:
        if ino == ROOT:
            return True
        hit = self._local(ino)
        if hit is None:
            return False
        m, n = hit
        return n == ROOT if m.table is None else m.table.is_dir(n)

    def is_file(self, ino: int) -> bool:
        hit = self._local(ino)
        return hit is not None and hit[0].table is not None and hit[0].table.is_file(hit[1])

    def name(self, ino: int) -> str:
        hit = self._local(ino)
        if hit is None:
            return ""
        m, n = hit
        return m.ref if n == ROOT or m.table is None else m.table.name(n)

    @property
    def file_count(self) -> int:
        return sum(m.table.file_count for m in self.members[1:] if m and m.table)

    @property
    def total_bytes(self) -> int:
        return sum(m.table.total_bytes for m in self.members[1:] if m and m.table)

    @property
    def inode_count(self) -> int:
        return 1 + sum(m.table.inode_count if m.table else 1 for m in self.members[1:] if m)

    # -- attributes --------------------------------------------------------------------------
    def attr(self, ino: int) -> Attr:
        if ino == ROOT:
            return Attr(ROOT, statmod.S_IFDIR | 0o555, 0, self.created_ns, 1)
        hit = self._local(ino)
        if hit is None:
            raise KeyError(ino)
        m, n = hit
        if m.table is None:
            if n != ROOT:
                raise KeyError(ino)
            return Attr(ino, statmod.S_IFDIR | 0o555, 0, self.created_ns, 1)
        a = m.table.attr(n)
        return Attr(ino, a.mode, a.size, a.mtime_ns, a.nlink)

    # -- lookup and listing ------------------------------------------------------------------
    def lookup(self, parent: int, name: str) -> int | None:
        """The inode of ``name`` in folder ``parent``; a member folder's own contents need
        the member loaded (None until then). At the root, only listed datasets and
        ``DATASET@SNAPSHOT`` of a listed dataset are found."""
        if parent == ROOT:
            if name in (".", ".."):
                return ROOT
            try:
                dataset, _ = split_dataset_ref(name)
            except SpokeError:
                return None
            if dataset not in self.listed and name not in self.by_ref:
                return None
            return self.member_root(self.member_for(name))
        hit = self._local(parent)
        if hit is None or hit[0].table is None:
            return None
        m, n = hit
        if name == ".." and n == ROOT:
            return ROOT
        found = m.table.lookup(n, name)
        return None if found is None else (parent >> SHIFT) << SHIFT | found

    def children(self, ino: int) -> array:
        if ino == ROOT:
            return array("q", [self.member_root(self.by_ref[n]) for n in self.listed])
        hit = self._local(ino)
        if hit is None or hit[0].table is None:
            raise NotADirectoryError(ino)
        base = (ino >> SHIFT) << SHIFT
        return array("q", [base | c for c in hit[0].table.children(hit[1])])


Loader = Callable[[Member], Awaitable[tuple[InodeTable, Reader]]]
Lister = Callable[[], Awaitable[list[str]]]


class NamespaceFS(SnapshotFS):
    """The FUSE operations of a namespace mount: ``SnapshotFS`` over a ``NamespaceTable``,
    loading a member (through ``load``) the first time its folder is entered, and listing the
    datasets (through ``list_datasets``) when the listing is older than ``LIST_TTL``."""

    table: NamespaceTable  # type: ignore[assignment]

    def __init__(self, table: NamespaceTable, load: Loader, list_datasets: Lister,
                 perms: Perms | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        super().__init__(table, _NoReader(), perms)  # type: ignore[arg-type]
        self._load = load
        self._list = list_datasets
        self._clock = clock
        self._loading: dict[int, asyncio.Task[None]] = {}
        self._listing: asyncio.Task[None] | None = None

    async def refresh(self, force: bool = False) -> None:
        """Ask for the datasets again if the listing is older than ``LIST_TTL`` (one
        request however many callers ask at once). A failure keeps the last listing."""
        t = self.table
        if not force and t.listed_at is not None and self._clock() - t.listed_at < LIST_TTL:
            return
        if self._listing is None or self._listing.done():
            self._listing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._listing)

    async def _refresh(self) -> None:
        try:
            names = await self._list()
        except (ReadFailed, SpokeError) as exc:
            log.warning("listing the datasets failed, keeping the last listing: %s", exc)
            self.table.listed_at = self._clock()  # not again at once: the next TTL
            return
        added = set(names) - set(self.table.listed)
        self.table.set_listing(names, self._clock())
        if added:
            log.info("datasets listed: %s", ", ".join(sorted(added)))

    async def _ensure(self, ino: int) -> None:
        """Load the member that ``ino`` belongs to, once; FUSEError when it cannot be."""
        k = ino >> SHIFT
        m = self.table.member(ino)
        if m is None or m.table is not None:
            return
        task = self._loading.get(k)
        if task is None:
            task = self._loading[k] = asyncio.ensure_future(self._load_member(m))
        try:
            await asyncio.shield(task)
        except pyfuse3.FUSEError:
            if self._loading.get(k) is task:
                del self._loading[k]  # a failed load is tried again by the next request
            raise

    async def _load_member(self, m: Member) -> None:
        try:
            table, reader = await self._load(m)
        except (NotFound, ConfigError) as exc:
            log.error("dataset folder %r: %s", m.ref, exc)
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except (ReadFailed, SpokeError) as exc:
            log.error("dataset folder %r cannot be loaded, answering EIO: %s", m.ref, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        m.table, m.reader, m.snapshot = table, reader, table.snapshot
        log.info("dataset %s pinned to snapshot %s for this mount (%d files)", m.ref,
                 table.snapshot, table.file_count)

    # -- metadata ----------------------------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        self.counters.lookups += 1
        text = os.fsdecode(name)
        if parent_inode == ROOT:
            await self.refresh()
            ino = self.table.lookup(ROOT, text)
            if ino is None and self.table.listed_at is not None:
                await self.refresh(force=self._clock() - self.table.listed_at >= 1.0)
                ino = self.table.lookup(ROOT, text)
            if ino is None:
                # Negative, but only for a while: the dataset may be added at the hub.
                e = pyfuse3.EntryAttributes()
                e.st_ino = 0
                e.entry_timeout = LIST_TTL
                return e
            return self._entry(ino)
        await self._ensure(parent_inode)
        return await super().lookup(parent_inode, name, ctx)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode == ROOT:
            await self.refresh()
        else:
            await self._ensure(inode)
        return await super().opendir(inode, ctx)

    # -- data --------------------------------------------------------------------------------
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        m = self.table.member(fh)
        if m is None or m.table is None or m.reader is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return await self._read_file(m.table, m.reader, fh & _LOCAL, off, size,
                                     f" in {m.ref}")


class _NoReader:
    """``SnapshotFS`` wants one reader; a namespace reads through each member's own."""

    async def read(self, version: str, size: int, start: int, end: int) -> bytes:
        raise ReadFailed("a namespace reads through its members")  # pragma: no cover
