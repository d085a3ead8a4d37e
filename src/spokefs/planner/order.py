"""An announced read order as a cursor over blocks: where the reader is, what lies ahead.

The order is stored compactly as parallel arrays over *positions* (one per block occurrence):
manifest file index, block index, and cumulative bytes, so a million-sample epoch costs a few
tens of MB and lookups are C-speed ``array.index`` scans inside a small window.

The reader's position is a low watermark: every position before it has been read. Reads may
arrive out of order (several DataLoader workers) as long as they land less than ``window``
positions past the farthest position read; a position the reads have passed by more than
``window`` counts as read (skipped), so the cursor cannot stall.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate

from spokefs.planner.manifest import Manifest
from spokefs.policy import BlockKey


class OrderKeys(Sequence[BlockKey]):
    """A read-only view of positions [start, stop) as block keys (for ``SetFuture``)."""

    def __init__(self, manifest: Manifest, files: array, blocks: array) -> None:
        self._m, self._files, self._blocks = manifest, files, blocks

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return (self._m.versions[self._files[i]], self._blocks[i])

    def __iter__(self) -> Iterator[BlockKey]:
        versions = self._m.versions
        for f, b in zip(self._files, self._blocks, strict=True):
            yield (versions[f], b)


class OrderCursor:
    """One job's announced order over one dataset."""

    def __init__(self, manifest: Manifest, window: int) -> None:
        self.manifest = manifest
        self.window = max(1, window)
        self.epoch = -1
        self.files = array("l")
        self.blocks = array("l")
        self.cum = array("q", [0])  # bytes before each position
        self.consumed = bytearray()
        self.pos = 0  # low watermark
        self.frontier = -1  # farthest position read
        self.issued = 0  # positions below this were pinned (and queued when not resident)
        self.dropped = 0  # positions compacted away: absolute position = dropped + index
        self.alive = True

    def __len__(self) -> int:
        return len(self.files)

    def extend(self, files: Sequence[int], ranges: Sequence[tuple[int, int]] | None) -> range:
        """Append entries (manifest indexes, optional (offset, length) each); returns the new
        positions. Consecutive entries in one block make one position."""
        m = self.manifest
        base = len(self.files)
        sizes, bs = m.sizes, m.block_size
        entry_sizes = list(map(sizes.__getitem__, files)) if ranges is None else []
        if ranges is None and max(entry_sizes, default=0) <= bs:
            # The common case (no file larger than a block) without a Python loop per entry.
            self.files.extend(array("l", files))
            self.blocks.extend(array("l", [0]) * len(entry_sizes))
            running = accumulate(entry_sizes, initial=self.cum[-1])
            next(running)  # the old total, already there
            self.cum.extend(running)
        else:
            last = (self.files[-1], self.blocks[-1]) if base else (-1, -1)
            total = self.cum[-1]
            for j, f in enumerate(files):
                span = m.blocks_of(f, *ranges[j]) if ranges is not None else range(m.nblocks(f))
                for b in span:
                    if (f, b) == last:
                        continue
                    last = (f, b)
                    self.files.append(f)
                    self.blocks.append(b)
                    total += m.block_bytes(f, b)
                    self.cum.append(total)
        self.consumed.extend(bytes(len(self.files) - base))
        return range(base, len(self.files))

    def keys(self, positions: range) -> OrderKeys:
        return OrderKeys(
            self.manifest, self.files[positions.start : positions.stop],
            self.blocks[positions.start : positions.stop],
        )  # fmt: skip

    def key(self, p: int) -> BlockKey:
        return (self.manifest.versions[self.files[p]], self.blocks[p])

    def size(self, p: int) -> int:
        return self.cum[p + 1] - self.cum[p]

    def locate(self, f: int, b: int) -> int | None:
        """The first unread position of block (f, b) inside the disorder window, or None."""
        stop = min(len(self.files), max(self.pos, self.frontier + 1) + self.window)
        start = self.pos
        files, blocks, consumed = self.files, self.blocks, self.consumed
        while start < stop:
            try:
                p = files.index(f, start, stop)
            except ValueError:
                return None
            if blocks[p] == b and not consumed[p]:
                return p
            start = p + 1
        return None

    def consume(self, p: int) -> list[int]:
        """Mark position ``p`` read; returns every position newly counted as read (``p`` and
        any the reader skipped), for the caller to unpin."""
        done = [p]
        self.consumed[p] = 1
        self.frontier = max(self.frontier, p)
        skip_to = self.frontier - self.window
        consumed = self.consumed
        while self.pos < len(consumed):
            if consumed[self.pos]:
                self.pos += 1
            elif self.pos < skip_to:
                consumed[self.pos] = 1
                done.append(self.pos)
                self.pos += 1
            else:
                break
        return done

    def lookahead_end(self, budget: int) -> int:
        """The first position past ``budget`` bytes ahead of the farthest read (so readers
        spread over the disorder window all have their budget ahead of them)."""
        start = min(len(self.files), max(self.pos, self.frontier + 1))
        return max(start, bisect_right(self.cum, self.cum[start] + budget) - 1)

    def unread_issued(self) -> list[int]:
        """Positions that were pinned and are not read yet (to release them)."""
        c = self.consumed
        return [p for p in range(self.pos, min(self.issued, len(c))) if not c[p]]

    def was_read(self, absolute: int) -> bool:
        """Whether the position ``absolute`` (counted from the first announcement) was read."""
        p = absolute - self.dropped
        return p < 0 or (p < len(self.consumed) and bool(self.consumed[p]))

    def compact(self) -> int:
        """Drop the read prefix once it is most of the arrays; returns how many went."""
        drop = self.pos
        if drop < 65536 or drop * 2 < len(self.files):
            return 0
        del self.files[:drop]
        del self.blocks[:drop]
        del self.consumed[:drop]
        base = self.cum[drop]
        self.cum = array("q", (c - base for c in self.cum[drop:]))
        self.pos -= drop
        self.frontier -= drop
        self.issued = max(0, self.issued - drop)
        self.dropped += drop
        return drop
