"""Sequential readahead inside a file, with a window that grows while the reader stays
sequential (doubling per block entered, like the kernel's) and is capped at a
bandwidth-delay product given in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

# A read that starts this close to where the stream's last read ended still counts as
# sequential: FUSE and DataLoader workers split and reorder reads a little.
_SLACK = 128 << 10


@dataclass(slots=True, eq=False)
class Stream:
    """One reader's pass over one file. ``alive`` turns False when the stream restarts, so
    prefetches it queued go stale."""

    next_offset: int
    last_block: int
    window: int
    alive: bool = True


class Readahead:
    """Tracks streams (by any hashable id) and says which bytes each should have ahead."""

    def __init__(
        self, block_size: int, min_bytes: int, max_bytes: int, max_streams: int = 4096
    ) -> None:
        self.block_size = block_size
        self.min_bytes = min(min_bytes, max_bytes)
        self.max_bytes = max_bytes
        self.max_streams = max_streams
        self._streams: OrderedDict[Hashable, Stream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def window(self, sid: Hashable) -> int:
        st = self._streams.get(sid)
        return st.window if st else 0

    def on_read(self, sid: Hashable, size: int, offset: int, length: int) -> tuple[Stream, int]:
        """Record a read; return its stream and the first block this read is the first to
        touch (a read that continues a stream does not touch its current block anew)."""
        end = min(size, offset + length)
        last_block = max(end - 1, offset) // self.block_size
        st = self._streams.get(sid)
        # A read at offset 0 always starts a new pass (a small file read again).
        if st is not None and offset > 0 and abs(offset - st.next_offset) <= max(length, _SLACK):
            fresh = st.last_block + 1
            if last_block > st.last_block:  # entered a new block sequentially: grow
                st.window = min(self.max_bytes, max(self.min_bytes, 2 * st.window))
                st.last_block = last_block
            st.next_offset = max(st.next_offset, end)
            self._streams.move_to_end(sid)
            return st, fresh
        if st is not None:
            st.alive = False  # a seek: what the old stream queued is no longer wanted
        # A read from the start of a file usually reads it whole: speculate one window.
        st = Stream(end, last_block, self.min_bytes if offset == 0 else 0)
        self._streams[sid] = st
        self._streams.move_to_end(sid)
        while len(self._streams) > self.max_streams:
            self._streams.popitem(last=False)[1].alive = False
        return st, offset // self.block_size

    def ahead(self, st: Stream, size: int) -> range:
        """Block indexes the stream should have ahead of where it is."""
        if st.window <= 0 or st.next_offset >= size:
            return range(0)
        end = min(size, st.next_offset + st.window)
        return range(st.next_offset // self.block_size, (end - 1) // self.block_size + 1)

    def forget(self, sid: Hashable) -> None:
        st = self._streams.pop(sid, None)
        if st is not None:
            st.alive = False
