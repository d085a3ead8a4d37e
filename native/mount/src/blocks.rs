//! Block arithmetic (no I/O): which blocks and fetch units a read spans, which chunks of a
//! block a piece touches.
//!
//! A file version is stored as blocks of the dataset's block size `bs` (block `i` holds
//! bytes `[i * bs, (i + 1) * bs)`). Over HTTP the mount fetches in *units* of
//! `min(bs, 4 MiB)` aligned to the block: block `i` is cut into units starting at
//! `i * bs + k * unit`, the last one of a block (or of the file) shorter. Cached blocks are
//! checked in *chunks* (256 KiB by default) counted from the block's start.

use std::ops::Range;

/// Largest unit fetched over HTTP (a dataset with huge blocks would otherwise hold few of
/// them per stream).
pub const FETCH_UNIT: u64 = 4 * 1024 * 1024;

/// The fetch unit of a dataset with blocks of `bs` bytes.
pub fn unit_size(bs: u64) -> u64 {
    bs.clamp(1, FETCH_UNIT)
}

/// Indexes of the blocks that bytes `[start, end)` touch (empty for an empty range).
pub fn blocks_spanned(start: u64, end: u64, bs: u64) -> Range<u64> {
    if end <= start || bs == 0 {
        return 0..0;
    }
    start / bs..(end - 1) / bs + 1
}

/// The part of bytes `[start, end)` that lies in block `index`, in the block's own offsets
/// (`lo..hi`, empty if none).
pub fn piece(index: u64, start: u64, end: u64, bs: u64) -> Range<u64> {
    let b0 = index * bs;
    let lo = start.max(b0).min(b0 + bs) - b0;
    let hi = end.min(b0 + bs).max(b0) - b0;
    lo..hi.max(lo)
}

/// The fetch unit holding byte `off` of a file of `size` bytes: its file range (empty at
/// or past the end of the file).
pub fn unit_at(off: u64, bs: u64, size: u64) -> Range<u64> {
    if off >= size {
        return size..size;
    }
    let bs = bs.max(1);
    let unit = unit_size(bs);
    let b0 = off / bs * bs;
    let u0 = b0 + (off - b0) / unit * unit;
    let u1 = (u0 + unit).min(b0 + bs).min(size);
    u0..u1.max(u0)
}

/// The fetch units that bytes `[start, end)` of a file of `size` bytes touch, in order.
pub fn units_spanned(start: u64, end: u64, bs: u64, size: u64) -> Vec<Range<u64>> {
    let end = end.min(size);
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let u = unit_at(at, bs, size);
        if u.is_empty() {
            break;
        }
        at = u.end;
        out.push(u);
    }
    out
}

/// Up to `n` units that follow the unit ending at `after` (a streaming read's prefetch).
pub fn units_after(after: u64, n: usize, bs: u64, size: u64) -> Vec<Range<u64>> {
    let mut out = Vec::with_capacity(n);
    let mut at = after;
    while out.len() < n && at < size {
        let u = unit_at(at, bs, size);
        if u.is_empty() {
            break;
        }
        at = u.end;
        out.push(u);
    }
    out
}

/// Whether a piece `[lo, hi)` of a block of `size` bytes is whole chunks: it starts on a
/// chunk boundary and ends on one or at the block's end (then it is read and checked in
/// place, with no copy).
pub fn whole_chunks(lo: u64, hi: u64, size: u64, chunk: u64) -> bool {
    lo % chunk == 0 && (hi % chunk == 0 || hi == size)
}

/// The chunks (numbers) a piece `[lo, hi)` of a block touches.
pub fn chunks_touched(lo: u64, hi: u64, chunk: u64) -> Range<u64> {
    if hi <= lo {
        return lo / chunk..lo / chunk;
    }
    lo / chunk..(hi - 1) / chunk + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn blocks_of_a_read() {
        let bs = 4 * MIB;
        assert_eq!(blocks_spanned(0, 1, bs), 0..1);
        assert_eq!(blocks_spanned(0, bs, bs), 0..1);
        assert_eq!(blocks_spanned(0, bs + 1, bs), 0..2);
        assert_eq!(blocks_spanned(bs - 1, bs + 1, bs), 0..2);
        assert_eq!(blocks_spanned(9 * bs, 9 * bs + 5, bs), 9..10);
        assert_eq!(blocks_spanned(5, 5, bs), 0..0);
        assert_eq!(blocks_spanned(7, 5, bs), 0..0);
    }

    #[test]
    fn pieces_in_block_offsets() {
        let bs = 100;
        assert_eq!(piece(0, 30, 250, bs), 30..100);
        assert_eq!(piece(1, 30, 250, bs), 0..100);
        assert_eq!(piece(2, 30, 250, bs), 0..50);
        assert_eq!(piece(3, 30, 250, bs), 0..0);
        assert_eq!(piece(0, 130, 250, bs), 100..100); // empty: the read starts later
        // The pieces of every block add up to the read.
        for (s, e) in [(0, 1), (99, 101), (5, 1000), (300, 301)] {
            let total: u64 =
                blocks_spanned(s, e, bs).map(|i| piece(i, s, e, bs)).map(|r| r.end - r.start).sum();
            assert_eq!(total, e - s);
        }
    }

    #[test]
    fn units_are_aligned_to_the_block() {
        // 4 MiB blocks: a unit is a block.
        assert_eq!(unit_at(5 * MIB, 4 * MIB, 100 * MIB), 4 * MIB..8 * MIB);
        assert_eq!(unit_at(5 * MIB, 4 * MIB, 6 * MIB), 4 * MIB..6 * MIB); // the file's end
        // 6 MiB blocks: units of 4 MiB then 2 MiB in each block, never across a block.
        let bs = 6 * MIB;
        assert_eq!(unit_at(0, bs, 100 * MIB), 0..4 * MIB);
        assert_eq!(unit_at(4 * MIB, bs, 100 * MIB), 4 * MIB..6 * MIB);
        assert_eq!(unit_at(6 * MIB, bs, 100 * MIB), 6 * MIB..10 * MIB);
        assert_eq!(unit_at(11 * MIB, bs, 100 * MIB), 10 * MIB..12 * MIB);
        // Small blocks: a unit is a block.
        assert_eq!(unit_at(300, 256, 1000), 256..512);
        assert_eq!(unit_at(999, 256, 1000), 768..1000);
        assert_eq!(unit_at(1000, 256, 1000), 1000..1000);
    }

    #[test]
    fn units_of_a_read_and_what_follows() {
        let bs = 6 * MIB;
        let size = 13 * MIB;
        assert_eq!(
            units_spanned(3 * MIB, 7 * MIB, bs, size),
            [0..4 * MIB, 4 * MIB..6 * MIB, 6 * MIB..10 * MIB]
        );
        assert_eq!(units_spanned(12 * MIB, 20 * MIB, bs, size), vec![(12 * MIB)..(13 * MIB)]);
        assert!(units_spanned(13 * MIB, 14 * MIB, bs, size).is_empty());
        assert_eq!(units_after(6 * MIB, 2, bs, size), [6 * MIB..10 * MIB, 10 * MIB..12 * MIB]);
        assert_eq!(units_after(12 * MIB, 5, bs, size), vec![(12 * MIB)..(13 * MIB)]);
        assert!(units_after(13 * MIB, 2, bs, size).is_empty());
        // Units tile the file exactly.
        let all = units_spanned(0, size, bs, size);
        assert_eq!(all.first().unwrap().start, 0);
        assert_eq!(all.last().unwrap().end, size);
        assert!(all.windows(2).all(|w| w[0].end == w[1].start));
    }

    #[test]
    fn chunk_checks() {
        let c = 256 * 1024;
        assert!(whole_chunks(0, c, 4 * MIB, c));
        assert!(whole_chunks(c, 3 * c, 4 * MIB, c));
        assert!(whole_chunks(0, 1000, 1000, c)); // a small block, whole
        assert!(!whole_chunks(0, 999, 1000, c));
        assert!(!whole_chunks(4096, c, 4 * MIB, c));
        assert_eq!(chunks_touched(0, 1, c), 0..1);
        assert_eq!(chunks_touched(c - 1, c + 1, c), 0..2);
        assert_eq!(chunks_touched(c, 2 * c, c), 1..2);
        assert_eq!(chunks_touched(5, 5, c), 0..0);
    }
}
