//! Chunk digests: an xxh3-64 of each `chunk`-byte piece of a block (the last piece may be
//! short), 8 bytes each, big-endian (the canonical form: what python-xxhash's
//! `xxh3_64_digest` gives), concatenated. A block of `n` bytes has `ceil(n / chunk)` of
//! them; an empty block has none.

use std::num::NonZeroUsize;

use crate::xxh3::{xxh3_64, xxh3_128};

/// Bytes of one chunk digest.
pub const DIGEST_LEN: usize = 8;

/// The digest of one chunk.
#[inline]
pub fn chunk_digest(data: &[u8]) -> [u8; DIGEST_LEN] {
    xxh3_64(data).to_be_bytes()
}

/// The xxh3-128 of a whole block, 16 bytes big-endian (as python-xxhash's
/// `xxh3_128_digest`, `spokefs.integrity.block_digest`).
#[inline]
pub fn block_digest(data: &[u8]) -> [u8; 16] {
    xxh3_128(data).to_be_bytes()
}

/// How many chunks (and digests) a block of `len` bytes has.
#[inline]
pub fn chunk_count(len: usize, chunk: NonZeroUsize) -> usize {
    len.div_ceil(chunk.get())
}

/// The digests of every chunk of `data`, concatenated.
pub fn chunk_digests(data: &[u8], chunk: NonZeroUsize) -> Vec<u8> {
    let mut out = vec![0; chunk_count(data.len(), chunk) * DIGEST_LEN];
    chunk_digests_into(data, chunk, &mut out);
    out
}

/// [`chunk_digests`] into `out`, which holds exactly `DIGEST_LEN` bytes per chunk.
///
/// # Panics
/// If `out` has another length (a caller's bug).
pub fn chunk_digests_into(data: &[u8], chunk: NonZeroUsize, out: &mut [u8]) {
    assert_eq!(out.len(), chunk_count(data.len(), chunk) * DIGEST_LEN, "digest buffer size");
    for (piece, slot) in data.chunks(chunk.get()).zip(out.chunks_exact_mut(DIGEST_LEN)) {
        slot.copy_from_slice(&chunk_digest(piece));
    }
}

/// Whether `data`, the bytes of a block from chunk number `first` on (so it starts on a
/// chunk boundary), matches the block's digests `want` chunk by chunk: `data`'s pieces of
/// `chunk` bytes (the last may be short: the end of the block, or of the range asked for)
/// against `want[8 * c..8 * c + 8]` for c = first, first + 1, .... A digest missing from
/// `want` is a mismatch. Empty `data` matches.
pub fn chunks_match(data: &[u8], first: usize, chunk: NonZeroUsize, want: &[u8]) -> bool {
    first_mismatch(data, first, chunk, want).is_none()
}

/// The number of the first chunk of `data` that does not match (see [`chunks_match`]).
pub(crate) fn first_mismatch(
    data: &[u8],
    first: usize,
    chunk: NonZeroUsize,
    want: &[u8],
) -> Option<usize> {
    for (i, piece) in data.chunks(chunk.get()).enumerate() {
        let c = first.saturating_add(i);
        let at = c.checked_mul(DIGEST_LEN);
        let expected = at.and_then(|at| want.get(at..at.checked_add(DIGEST_LEN)?));
        if expected != Some(&chunk_digest(piece)[..]) {
            return Some(c);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    /// The test data of the known values below: byte i is i * 31 mod 251.
    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    // Known xxh3-64 values, as python-xxhash 3.x (libxxhash 0.8) prints them.
    #[test]
    fn digests_match_known_xxh3_64_values() {
        assert_eq!(hex(&chunk_digest(b"")), "2d06800538d394c2");
        assert_eq!(hex(&chunk_digest(b"abc")), "78af5f94892f3950");
        assert_eq!(hex(&chunk_digest(b"spokefs")), "09d89f9cc24dccc3");
        assert_eq!(hex(&chunk_digest(&pattern(1000))), "404e1417800eb486");
    }

    #[test]
    fn block_digests_match_known_xxh3_128_values() {
        assert_eq!(hex(&block_digest(b"abc")), "06b05ab6733a618578af5f94892f3950");
    }

    /// Every length through the short paths and a few stripes and blocks of the long-input
    /// one (whose SIMD kernel is picked at run time) against xxhash-rust, an independent
    /// implementation; unaligned starts too.
    #[test]
    fn digests_match_xxhash_rust_at_every_length() {
        let data = pattern(70_000);
        let lengths = (0..=2100).chain([4095, 4096, 4097, 16_384, 65_535, 65_536, 70_000]);
        for n in lengths {
            let d = &data[..n];
            assert_eq!(chunk_digest(d), xxhash_rust::xxh3::xxh3_64(d).to_be_bytes(), "{n}");
            assert_eq!(block_digest(d), xxhash_rust::xxh3::xxh3_128(d).to_be_bytes(), "{n}");
        }
        for start in 1..64 {
            let d = &data[start..start + 5000];
            assert_eq!(chunk_digest(d), xxhash_rust::xxh3::xxh3_64(d).to_be_bytes(), "{start}");
        }
    }

    #[test]
    fn chunk_digests_concatenates_one_per_piece_last_short() {
        let d = chunk_digests(&pattern(1000), nz(256));
        assert_eq!(d.len(), 4 * DIGEST_LEN);
        assert_eq!(
            hex(&d),
            "92c44436e0d31dee\
             e00a753afe4516fb\
             341429f9d3a716a6\
             6fe4c4ec55ecd770"
        );
        assert_eq!(chunk_digests(&pattern(1024), nz(256)).len(), 4 * DIGEST_LEN);
        assert_eq!(chunk_digests(&pattern(1025), nz(256)).len(), 5 * DIGEST_LEN);
    }

    #[test]
    fn an_empty_block_has_no_digests() {
        assert!(chunk_digests(b"", nz(256)).is_empty());
        assert!(chunks_match(b"", 0, nz(256), b""));
    }

    #[test]
    fn chunks_match_from_any_chunk_number() {
        let data = pattern(1000);
        let want = chunk_digests(&data, nz(256));
        assert!(chunks_match(&data, 0, nz(256), &want));
        assert!(chunks_match(&data[256..768], 1, nz(256), &want));
        assert!(chunks_match(&data[768..], 3, nz(256), &want));
        assert!(!chunks_match(&data[256..768], 0, nz(256), &want)); // numbered wrong
        assert_eq!(first_mismatch(&data[256..768], 2, nz(256), &want), Some(2));
    }

    #[test]
    fn missing_digests_are_a_mismatch() {
        let data = pattern(1000);
        let want = chunk_digests(&data, nz(256));
        assert!(!chunks_match(&data, 0, nz(256), &want[..3 * DIGEST_LEN]));
        assert!(!chunks_match(&data, 0, nz(256), &want[..3 * DIGEST_LEN + 4]));
        assert!(!chunks_match(&data[..10], usize::MAX, nz(256), &want)); // no overflow
    }
}
