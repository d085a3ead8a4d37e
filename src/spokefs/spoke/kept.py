"""Checkpoints kept near the compute: a commit written through this spoke goes into its block
cache when the hub publishes it, so a restart here (or on a replaced tier member, through the
handoff) restores at local speed instead of fetching back over the link what was just sent.

Two parts, one owner each:

- ``LastN`` (no I/O): which commits stay pinned. The last ``keep`` published commits of each
  dataset hold their blocks pinned, together at most ``share`` of the cache (a cache that can
  evict nothing serves every other read by passing it through); an older commit's blocks are
  unpinned and leave like any others. Fed with events (``published``), it answers what to pin
  and unpin.
- ``Keeper`` (I/O): reads each published file's local copy block by block (in a thread),
  checks every block against the digest made when the upload arrived whole (the digests
  whose version the hub published: a block that rotted on this disk since is not kept), and
  writes it into the store as a fetched block would be, a bounded batch at a time.

Keys are the cache's own, ``(version, block index)``: the hub publishes a file at the version
its writer declared, so the blocks are what every reader of that snapshot asks for.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from spokefs import integrity
from spokefs.cache.durable import DirectReader
from spokefs.cache.store import BlockStore
from spokefs.hub.uploads import Upload
from spokefs.policy import BlockKey

log = logging.getLogger(__name__)

BATCH = 32 << 20  # bytes read into memory before they are handed to the store


@dataclass
class Commit:
    dataset: str
    name: str
    blocks: dict[BlockKey, int] = field(default_factory=dict)  # key -> bytes

    @property
    def size(self) -> int:
        return sum(self.blocks.values())


class LastN:
    """The last ``keep`` commits of each dataset, pinned while they fit in ``limit`` bytes."""

    def __init__(self, keep: int, limit: int) -> None:
        self.keep = keep
        self.limit = limit
        self._last: dict[str, deque[Commit]] = {}
        self.pinned_bytes = 0

    def published(self, commit: Commit) -> tuple[list[BlockKey], list[BlockKey]]:
        """``commit`` is now the newest of its dataset: (keys to pin, keys to unpin)."""
        if self.keep <= 0:
            return [], []
        last = self._last.setdefault(commit.dataset, deque())
        if any(c.name == commit.name for c in last):
            return [], []  # told again (a restart's recovery): pinned already
        if commit.size > self.limit:
            log.warning("checkpoint %s of %s (%d bytes) is cached but not pinned: the pins "
                        "may hold at most %d bytes of the cache", commit.name, commit.dataset,
                        commit.size, self.limit)
            return [], []
        unpin: list[BlockKey] = []
        while len(last) >= self.keep:
            unpin.extend(self._drop(last.popleft()))
        # Other datasets' kept commits give way, the fullest's oldest first, until it fits.
        while self.pinned_bytes + commit.size > self.limit:
            ds = self._fullest()
            assert ds is not None  # what is pinned fits the limit, and so does the commit
            unpin.extend(self._drop(self._last[ds].popleft()))
        last.append(commit)
        self.pinned_bytes += commit.size
        return list(commit.blocks), unpin

    def _fullest(self) -> str | None:
        """The dataset with the most commits kept (a fair place to take room from)."""
        held = [(len(q), ds) for ds, q in self._last.items() if q]
        return max(held)[1] if held else None

    def _drop(self, commit: Commit) -> list[BlockKey]:
        self.pinned_bytes -= commit.size
        return list(commit.blocks)

    def kept(self, dataset: str) -> list[str]:
        return [c.name for c in self._last.get(dataset, ())]


class Keeper:
    """Published commits into the store, the last ones pinned (``LastN``)."""

    def __init__(self, store: BlockStore, keep: int, share: float) -> None:
        self.store = store
        self.last = LastN(keep, int(share * store.capacity))
        self.kept_bytes = 0     # bytes written into the cache from published commits
        self.refused_blocks = 0  # blocks whose local copy no longer matched its digest

    async def published(self, dataset: str, name: str, block_size: int,
                        ups: Iterable[Upload], part_of: dict[str, Path]) -> None:
        """The uploads of commit ``name``, published at the hub, into the cache (their
        parts: ``part_of[path]``), then the last commits pinned."""
        commit = Commit(dataset, name)
        for up in ups:
            if up.digests is None:
                continue
            n = integrity.block_count(up.size, block_size)
            digests = [up.digests[i * integrity.DIGEST_SIZE:(i + 1) * integrity.DIGEST_SIZE]
                       for i in range(n)]
            for i in range(n):
                lo, hi = integrity.block_span(i, up.size, block_size)
                commit.blocks[(up.version, i)] = hi - lo
            await self._write_file(dataset, up, part_of[up.path], block_size, digests)
        self._pin(commit)

    def restore(self, dataset: str, name: str, files: Iterable[tuple[str, int]],
                block_size: int) -> None:
        """A commit published before a restart (``done.jsonl``: its files' versions and
        sizes), pinned again as it was; its blocks are the cache's still, if not evicted."""
        commit = Commit(dataset, name)
        for version, size in files:
            for i in range(integrity.block_count(size, block_size)):
                lo, hi = integrity.block_span(i, size, block_size)
                commit.blocks[(version, i)] = hi - lo
        self._pin(commit)

    def _pin(self, commit: Commit) -> None:
        pin, unpin = self.last.published(commit)
        for key in pin:
            self.store.pin(key)
        for key in unpin:
            self.store.unpin(key)

    async def _write_file(self, dataset: str, up: Upload, part: Path, block_size: int,
                          digests: list[bytes]) -> None:
        try:
            f = await asyncio.to_thread(DirectReader, part, block_size)
        except OSError as exc:
            log.warning("checkpoint file %s of %s not kept in the cache: %s", up.path, dataset,
                        exc)
            return
        try:
            i = 0
            while i < len(digests):
                want = [j for j in range(i, min(len(digests), i + max(1, BATCH // block_size)))
                        if (up.version, j) not in self.store]
                i += max(1, BATCH // block_size)
                if want:
                    got = await asyncio.to_thread(_read_blocks, f, want, up.size, block_size,
                                                  digests)
                    await self._write_blocks(dataset, up, got, digests)
        finally:
            f.close()

    async def _write_blocks(self, dataset: str, up: Upload,
                            got: list[tuple[int, bytes | None]], digests: list[bytes]) -> None:
        """Blocks read and checked (``_read_blocks``) into the store; ``digests``: what each
        was checked against, so nothing is hashed twice."""
        loop = asyncio.get_running_loop()
        self.store.set_object_size(up.version, up.size)  # what a replica's reads bound by
        waits: list[tuple[asyncio.Future[bool], int]] = []
        for j, data in got:
            if data is None:
                self.refused_blocks += 1
                log.error("block %d of %s (%s) no longer matches the digest it had when "
                          "written: not kept (the hub's copy serves it)", j, up.path, dataset)
                continue
            res = self.store.reserve((up.version, j), len(data), dataset)
            if res is None:
                continue  # resident already, or no room: readers fetch it as any block
            done: asyncio.Future[bool] = loop.create_future()
            self.store.write(res, memoryview(data), digests[j],
                             lambda kept, d=done: d.done() or d.set_result(kept))
            waits.append((done, len(data)))
        kept = await asyncio.gather(*(w for w, _ in waits))
        self.kept_bytes += sum(n for ok, (_, n) in zip(kept, waits, strict=True) if ok)


def _read_blocks(f: DirectReader, which: list[int], size: int, block_size: int,
                 digests: list[bytes]) -> list[tuple[int, bytes | None]]:
    """(thread) Blocks ``which`` of the file ``f`` reads (past the page cache: the store
    keeps its own copy), each checked against its digest (None: it does not match)."""
    out: list[tuple[int, bytes | None]] = []
    for j in which:
        lo, hi = integrity.block_span(j, size, block_size)
        data = f.read(lo, hi - lo)
        out.append((j, data if len(data) == hi - lo
                    and integrity.block_digest(data) == digests[j] else None))
    return out
