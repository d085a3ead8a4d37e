"""An announced read order as a cursor over blocks: where the reader is, what lies ahead.

The order is stored compactly as parallel arrays over *positions* (one per block occurrence):
manifest file index, block index, and cumulative bytes, so a million-sample epoch costs a few
tens of MB and lookups are C-speed ``array.index`` scans inside a small window.

The reader's position is a low watermark: every position before it has been read. Reads may
arrive out of order (several DataLoader workers) as long as they land less than ``window``
positions past the farthest position read; a position the reads have passed by more than
``window`` counts as read (skipped), so the cursor cannot stall.

An announcement comes from a client: ``check_order`` checks it whole (types, bounds, size)
before anything is built from it, so a bad entry is a 4xx and leaves no half-built order, and
the work it causes is bounded by the blocks its files have, not by the numbers it holds.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, compress

from spokefs.errors import BadRequest, TooLarge
from spokefs.integrity import block_count
from spokefs.planner.manifest import Manifest
from spokefs.policy import BlockKey

MAX_ORDER_ENTRIES = 4_000_000  # entries (files, or ranges of files) in one announcement
MAX_ORDER_BLOCKS = 16_000_000  # block positions one announcement may add (~25 bytes each)


class OrderTooLarge(TooLarge):
    """An announcement past ``MAX_ORDER_ENTRIES`` entries or ``MAX_ORDER_BLOCKS`` blocks."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_order(sizes: Sequence[int], block_size: int, files: Sequence[int],
                ranges: object = None) -> list[tuple[int, int]] | None:
    """Check an announced order before anything is built from it; returns its ranges clipped
    to their files (None: whole files).

    ``files`` are manifest indexes: ints in [0, len(sizes)). ``ranges`` is None or, as JSON
    gave it, one ``[offset, length]`` per entry: integers (not booleans, not floats) with
    0 <= offset < the file's size (0 for an empty file) and length > 0; a length past the end
    of the file is clipped to it (what it returns passes this check unchanged). Raises
    BadRequest naming the first bad entry, OrderTooLarge past ``MAX_ORDER_ENTRIES`` entries
    or ``MAX_ORDER_BLOCKS`` blocks.
    """
    n = len(files)
    if n > MAX_ORDER_ENTRIES:
        raise OrderTooLarge(f"an order has at most {MAX_ORDER_ENTRIES:,} entries, not {n:,}: "
                            "announce fewer (an epoch at a time)")
    # One pass in C over a million entries; the Python loop only finds the culprit.
    int_array = isinstance(files, array) and files.typecode in "bBhHiIlLqQ"
    if not int_array and not set(map(type, files)) <= {int}:
        bad = next(f for f in files if type(f) is not int)
        raise BadRequest(f"order entries must be manifest indexes (integers), not {_show(bad)}")
    if n and (min(files) < 0 or max(files) >= len(sizes)):
        bad = next(f for f in files if not 0 <= f < len(sizes))
        raise BadRequest(f"order entry {bad} is not a file of the manifest "
                         f"(indexes are in [0, {len(sizes)}))")
    entry_sizes = list(map(sizes.__getitem__, files))
    if ranges is None:  # whole files: the blocks they have (an empty file has none)
        blocks = n - entry_sizes.count(0) if max(entry_sizes, default=0) <= block_size else sum(
            block_count(size, block_size) for size in entry_sizes)
        _check_blocks(blocks)
        return None
    if not isinstance(ranges, list | tuple):
        raise BadRequest(f'"ranges" must be a list of [offset, length], not {_show(ranges)}')
    if len(ranges) != n:
        raise BadRequest(f'"ranges" must hold one [offset, length] per entry: {n} entries, '
                         f"{len(ranges)} ranges")
    out: list[tuple[int, int]] = []
    blocks = 0
    for j, (r, size) in enumerate(zip(ranges, entry_sizes, strict=True)):
        if (not isinstance(r, list | tuple) or len(r) != 2 or type(r[0]) is not int
                or type(r[1]) is not int):
            raise BadRequest(f"ranges[{j}] must be [offset, length] (two integers), "
                             f"not {_show(r)}")
        offset, length = r
        if not (0 <= offset < size or offset == size == 0) or length <= 0:
            raise BadRequest(f"ranges[{j}] = [{offset}, {length}] of a {size}-byte file: "
                             "needs 0 <= offset < size and length > 0")
        # A huge length is the rest of the file (an empty file's entry keeps length 1: it
        # touches nothing, and the clipped order passes this check again unchanged).
        length = min(length, max(1, size - offset))
        out.append((offset, length))
        if size:
            blocks += (offset + length - 1) // block_size - offset // block_size + 1
    _check_blocks(blocks)
    return out


def _check_blocks(blocks: int) -> None:
    if blocks > MAX_ORDER_BLOCKS:
        raise OrderTooLarge(f"an order covers at most {MAX_ORDER_BLOCKS:,} blocks, not "
                            f"{blocks:,}: announce fewer (an epoch at a time)")


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
        self.latest = 0  # index of the latest epoch's first position (earlier: the one before)
        self.alive = True

    def __len__(self) -> int:
        return len(self.files)

    def extend(self, files: Sequence[int], ranges: Sequence[tuple[int, int]] | None) -> range:
        """Append entries (manifest indexes, optional (offset, length) each); returns the new
        positions. Consecutive entries in one block make one position. The entries are
        checked whole first (``check_order``): a bad one raises and leaves the cursor as it
        was."""
        m = self.manifest
        ranges = check_order(m.sizes, m.block_size, files, ranges)
        base = len(self.files)
        sizes, bs = m.sizes, m.block_size
        entry_sizes = list(map(sizes.__getitem__, files)) if ranges is None else []
        if ranges is None and max(entry_sizes, default=0) <= bs:
            # The common case (no file larger than a block) without a Python loop per entry.
            if 0 in entry_sizes:  # an empty file has no block, so no position
                files = list(compress(files, entry_sizes))
                entry_sizes = list(filter(None, entry_sizes))
            new_files = array("l", files)
            new_blocks = array("l", [0]) * len(entry_sizes)
            running = accumulate(entry_sizes, initial=self.cum[-1])
            next(running)  # the old total, already there
            new_cum = array("q", running)
        else:
            new_files, new_blocks, new_cum = array("l"), array("l"), array("q")
            last = (self.files[-1], self.blocks[-1]) if base else (-1, -1)
            total = self.cum[-1]
            for j, f in enumerate(files):
                span = m.blocks_of(f, *ranges[j]) if ranges is not None else range(m.nblocks(f))
                for b in span:
                    if (f, b) == last:
                        continue
                    last = (f, b)
                    new_files.append(f)
                    new_blocks.append(b)
                    total += m.block_bytes(f, b)
                    new_cum.append(total)
        self.files.extend(new_files)
        self.blocks.extend(new_blocks)
        self.cum.extend(new_cum)
        self.consumed.extend(bytes(len(new_files)))
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
        return self._drop(drop)

    def drop_older_epochs(self) -> list[BlockKey]:
        """Forget the positions before the latest epoch, read or not (a new epoch replaces
        the one before the latest, so an order holds two epochs at most); returns the keys
        of those that were pinned and are not read, for the caller to unpin."""
        n = self.latest
        c = self.consumed
        unpin = [self.key(p) for p in range(self.pos, min(n, self.issued)) if not c[p]]
        self.pos = max(self.pos, n)
        self.frontier = max(self.frontier, n - 1)
        self._drop(n)
        return unpin

    def _drop(self, drop: int) -> int:
        del self.files[:drop]
        del self.blocks[:drop]
        del self.consumed[:drop]
        base = self.cum[drop]
        self.cum = array("q", (c - base for c in self.cum[drop:]))
        self.pos -= drop
        self.frontier -= drop
        self.issued = max(0, self.issued - drop)
        self.latest = max(0, self.latest - drop)
        self.dropped += drop
        return drop
