//! Checked reads of cached blocks from segment files.
//!
//! A block lives at some offset of a segment file, with the xxh3-64 digests of its chunks
//! (`chunks`). A read is one positional read (`pread`, retried on `EINTR`, continued after
//! a short count) into a buffer the caller owns, then every chunk the read touches is
//! checked there against the block's digests: what was checked is exactly what the caller
//! gets, whatever happens to the file meanwhile. A region that was freed (a hole: zeros), a
//! file cut short, a torn or stray write, or bytes of another file behind a reused
//! descriptor all fail the check; the caller treats the block as missing or damaged and
//! never serves those bytes.

use std::fmt;
use std::fs::File;
use std::io;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use crate::chunks::first_mismatch;

/// A source of positional reads: a segment file. `read_at` has `pread`'s contract: it may
/// read fewer bytes than asked (0 at the end of the file) and may fail with `Interrupted`.
pub trait ReadAt {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }
}

impl<T: ReadAt + ?Sized> ReadAt for &T {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        (**self).read_at(buf, offset)
    }
}

/// Why a checked read gave no bytes.
#[derive(Debug)]
pub enum ReadError {
    /// The read failed (a closed descriptor, an I/O error).
    Io(io::Error),
    /// The file ended first (a segment cut short or deleted and replaced).
    Short { read: usize, want: usize },
    /// Chunk number `chunk` of the block does not match its digest (damaged, or stale: a
    /// freed region reads as zeros).
    Mismatch { chunk: usize },
    /// A caller's bug: the range does not start on a chunk boundary, or lies past the end
    /// of the block.
    BadRange { lo: usize, hi: usize },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "read failed: {e}"),
            ReadError::Short { read, want } => {
                write!(f, "short read: {read} of {want} bytes (file cut short)")
            }
            ReadError::Mismatch { chunk } => write!(f, "chunk {chunk} does not match its digest"),
            ReadError::BadRange { lo, hi } => write!(f, "bad range [{lo}, {hi}) for a block"),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl ReadError {
    /// Whether this says the bytes on disk are not the block's (stale or damaged), as
    /// opposed to a failed or short read or a bad call.
    pub fn is_mismatch(&self) -> bool {
        matches!(self, ReadError::Mismatch { .. })
    }
}

/// Fill `buf` from `offset`: positional reads until it is full or the file ends (a read of
/// 0), retried on `EINTR`. The count read: short only at the end of the file.
pub fn pread_full<R: ReadAt + ?Sized>(src: &R, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match src.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Read bytes `[lo, lo + out.len())` of a block into `out`, from `offset` (the file offset
/// of the block's byte `lo`), and check every chunk they touch against `want` (the block's
/// chunk digests). `lo` is a multiple of `chunk`; the range ends on a chunk boundary or at
/// the end of the block (else its last piece is not a whole chunk and fails its check). On
/// an error `out` holds whatever was read and must not be used.
pub fn read_checked<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    out: &mut [u8],
    lo: usize,
    chunk: NonZeroUsize,
    want: &[u8],
) -> Result<(), ReadError> {
    if lo % chunk.get() != 0 {
        return Err(ReadError::BadRange { lo, hi: lo.saturating_add(out.len()) });
    }
    if out.is_empty() {
        return Ok(());
    }
    let got = pread_full(src, out, offset).map_err(ReadError::Io)?;
    if got != out.len() {
        return Err(ReadError::Short { read: got, want: out.len() });
    }
    match first_mismatch(out, lo / chunk.get(), chunk, want) {
        None => Ok(()),
        Some(c) => Err(ReadError::Mismatch { chunk: c }),
    }
}

/// The chunk-aligned span of a block that a read of bytes `[lo, hi)` must read and check:
/// `lo` rounded down to a chunk boundary, `hi` rounded up to one or to the block's end
/// (`size`). None if `lo > hi` or `lo > size`. An empty range gives an empty span.
pub fn span(lo: usize, hi: usize, size: usize, chunk: NonZeroUsize) -> Option<Range<usize>> {
    if lo > hi || lo > size {
        return None;
    }
    if lo == hi {
        return Some(lo..lo);
    }
    let c = chunk.get();
    let a = lo - lo % c;
    let b = hi.checked_next_multiple_of(c).unwrap_or(usize::MAX).min(size);
    Some(a..b.max(a))
}

/// Checked bytes `[lo, hi)` of a block of `size` bytes at file offset `block_offset`, read
/// through `scratch` (whole chunks are read and checked there; at least `span(..).len()`
/// bytes): the slice of `scratch` that holds them. `hi` past the end of the block is cut to
/// it. An empty range reads nothing.
#[allow(clippy::too_many_arguments)]
pub fn read_span<'s, R: ReadAt + ?Sized>(
    src: &R,
    block_offset: u64,
    size: usize,
    lo: usize,
    hi: usize,
    chunk: NonZeroUsize,
    want: &[u8],
    scratch: &'s mut [u8],
) -> Result<&'s [u8], ReadError> {
    let bad = ReadError::BadRange { lo, hi };
    let s = span(lo, hi, size, chunk).ok_or(bad)?;
    if s.is_empty() {
        return Ok(&scratch[..0]);
    }
    let Some(buf) = scratch.get_mut(..s.len()) else {
        return Err(ReadError::BadRange { lo, hi });
    };
    read_checked(src, block_offset + s.start as u64, buf, s.start, chunk, want)?;
    Ok(&buf[lo - s.start..hi.min(s.end) - s.start])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunks::chunk_digests;
    use std::cell::Cell;
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CHUNK: usize = 4096;

    fn nz(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    fn block(n: usize, seed: usize) -> Vec<u8> {
        (0..n).map(|i| ((i * 131 + seed * 7 + i / 977) % 256) as u8).collect()
    }

    /// A file in the temporary folder, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn with(bytes: &[u8]) -> TempFile {
            static N: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "spokefs-core-{}-{}.seg",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            File::create(&path).unwrap().write_all(bytes).unwrap();
            TempFile(path)
        }

        fn open(&self) -> File {
            File::open(&self.0).unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A segment file holding `data` at `at`, after other bytes.
    fn segment(data: &[u8], at: usize) -> TempFile {
        let mut bytes = block(at, 99);
        bytes.extend_from_slice(data);
        bytes.extend_from_slice(&block(1000, 98));
        TempFile::with(&bytes)
    }

    #[test]
    fn a_whole_block_reads_back_checked() {
        let data = block(5 * CHUNK + 123, 1);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&data, 8192);
        let mut out = vec![0; data.len()];
        read_checked(&f.open(), 8192, &mut out, 0, nz(CHUNK), &want).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn a_flipped_byte_is_caught_in_every_chunk_position() {
        let data = block(4 * CHUNK + 100, 2); // 5 chunks, the last short
        let want = chunk_digests(&data, nz(CHUNK));
        let chunks = data.len().div_ceil(CHUNK);
        for c in 0..chunks {
            let end = ((c + 1) * CHUNK).min(data.len());
            for at in [c * CHUNK, c * CHUNK + 1, (c * CHUNK + end) / 2, end - 1] {
                let mut bad = data.clone();
                bad[at] ^= 0x01;
                let f = segment(&bad, 4096);
                let mut out = vec![0; data.len()];
                let err = read_checked(&f.open(), 4096, &mut out, 0, nz(CHUNK), &want);
                assert!(
                    matches!(err, Err(ReadError::Mismatch { chunk }) if chunk == c),
                    "byte {at}: {err:?}"
                );
                // A read of only the damaged chunk fails; one of any other chunk does not.
                for d in 0..chunks {
                    let (a, b) = (d * CHUNK, ((d + 1) * CHUNK).min(data.len()));
                    let mut out = vec![0; b - a];
                    let r = read_checked(&f.open(), 4096 + a as u64, &mut out, a, nz(CHUNK), &want);
                    assert_eq!(r.is_ok(), d != c, "chunk {d} with byte {at} flipped");
                }
            }
        }
    }

    #[test]
    fn a_freed_region_reads_as_zeros_and_fails() {
        let data = block(3 * CHUNK, 3);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&vec![0; data.len()], 0);
        let mut out = vec![0; data.len()];
        let err = read_checked(&f.open(), 0, &mut out, 0, nz(CHUNK), &want).unwrap_err();
        assert!(err.is_mismatch(), "{err}");
    }

    #[test]
    fn a_short_file_fails_and_says_so() {
        let data = block(3 * CHUNK, 4);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = TempFile::with(&data[..2 * CHUNK + 10]); // cut short
        let mut out = vec![0; data.len()];
        let err = read_checked(&f.open(), 0, &mut out, 0, nz(CHUNK), &want).unwrap_err();
        assert!(
            matches!(err, ReadError::Short { read, want } if read == 2 * CHUNK + 10 && want == 3 * CHUNK),
            "{err:?}"
        );
        // Past the end of the file altogether.
        let err = read_checked(&f.open(), 1 << 20, &mut out, 0, nz(CHUNK), &want).unwrap_err();
        assert!(matches!(err, ReadError::Short { read: 0, .. }), "{err:?}");
    }

    #[test]
    fn wrong_or_missing_digests_fail() {
        let data = block(2 * CHUNK, 5);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&data, 0);
        let mut out = vec![0; data.len()];
        let short = &want[..8];
        let err = read_checked(&f.open(), 0, &mut out, 0, nz(CHUNK), short).unwrap_err();
        assert!(matches!(err, ReadError::Mismatch { chunk: 1 }), "{err:?}");
        let other = chunk_digests(&block(2 * CHUNK, 6), nz(CHUNK));
        assert!(read_checked(&f.open(), 0, &mut out, 0, nz(CHUNK), &other).is_err());
    }

    #[test]
    fn an_unaligned_start_is_refused_not_misread() {
        let data = block(2 * CHUNK, 7);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&data, 0);
        let mut out = vec![0; CHUNK];
        let err = read_checked(&f.open(), 100, &mut out, 100, nz(CHUNK), &want).unwrap_err();
        assert!(matches!(err, ReadError::BadRange { lo: 100, .. }), "{err:?}");
    }

    #[test]
    fn an_empty_read_reads_nothing_and_passes() {
        let f = TempFile::with(b"");
        read_checked(&f.open(), 0, &mut [], 0, nz(CHUNK), b"").unwrap();
    }

    #[test]
    fn a_read_error_is_reported() {
        struct Failing;
        impl ReadAt for Failing {
            fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<usize> {
                Err(io::Error::from_raw_os_error(9)) // EBADF
            }
        }
        let err = read_checked(&Failing, 0, &mut [0; 10], 0, nz(CHUNK), &[0; 8]).unwrap_err();
        assert!(matches!(err, ReadError::Io(_)), "{err:?}");
    }

    #[test]
    fn interrupted_and_partial_reads_are_continued() {
        /// Gives at most 1000 bytes a call, and EINTR every other call.
        struct Dribble<'a>(&'a [u8], Cell<usize>);
        impl ReadAt for Dribble<'_> {
            fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
                self.1.set(self.1.get() + 1);
                if self.1.get() % 2 == 0 {
                    return Err(io::ErrorKind::Interrupted.into());
                }
                let at = (offset as usize).min(self.0.len());
                let n = buf.len().min(1000).min(self.0.len() - at);
                buf[..n].copy_from_slice(&self.0[at..at + n]);
                Ok(n)
            }
        }
        let data = block(3 * CHUNK + 5, 8);
        let want = chunk_digests(&data, nz(CHUNK));
        let src = Dribble(&data, Cell::new(0));
        let mut out = vec![0; data.len()];
        read_checked(&src, 0, &mut out, 0, nz(CHUNK), &want).unwrap();
        assert_eq!(out, data);
        assert!(src.1.get() > 20);
    }

    #[test]
    fn spans_round_out_to_chunks_and_stop_at_the_block_end() {
        let c = nz(CHUNK);
        assert_eq!(span(0, 10, 100_000, c), Some(0..CHUNK));
        assert_eq!(span(CHUNK, 2 * CHUNK, 100_000, c), Some(CHUNK..2 * CHUNK));
        assert_eq!(span(CHUNK - 1, CHUNK + 1, 100_000, c), Some(0..2 * CHUNK));
        assert_eq!(span(5, 5, 100_000, c), Some(5..5));
        assert_eq!(span(90_000, 100_000, 100_000, c), Some(86_016..100_000));
        assert_eq!(span(90_000, 200_000, 100_000, c), Some(86_016..100_000));
        assert_eq!(span(10, 5, 100_000, c), None);
        assert_eq!(span(100_001, 100_002, 100_000, c), None);
        assert_eq!(span(1, usize::MAX, usize::MAX, c), Some(0..usize::MAX));
    }

    #[test]
    fn unaligned_ranges_read_exactly_their_bytes_at_every_alignment() {
        let data = block(3 * CHUNK + 777, 9);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&data, 12_288);
        let file = f.open();
        let mut scratch = vec![0; data.len() + CHUNK];
        let edges = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5, 3 * CHUNK];
        let ends = edges.iter().copied().chain([data.len() - 1, data.len()]);
        for lo in edges {
            for hi in ends.clone().filter(|&hi| hi >= lo) {
                let got =
                    read_span(&file, 12_288, data.len(), lo, hi, nz(CHUNK), &want, &mut scratch)
                        .unwrap_or_else(|e| panic!("[{lo}, {hi}): {e}"));
                assert_eq!(got, &data[lo..hi], "[{lo}, {hi})");
            }
        }
        // A flipped byte fails every range that touches its chunk, and only those.
        let mut bad = data.clone();
        bad[2 * CHUNK + 10] ^= 0x80;
        let f = segment(&bad, 12_288);
        let file = f.open();
        for (lo, hi, ok) in [
            (0, 10, true),
            (2 * CHUNK + 11, 2 * CHUNK + 12, false),
            (CHUNK, 2 * CHUNK, true),
            (CHUNK + 5, 2 * CHUNK + 1, false),
            (3 * CHUNK + 1, data.len(), true),
        ] {
            let r = read_span(&file, 12_288, data.len(), lo, hi, nz(CHUNK), &want, &mut scratch);
            assert_eq!(r.is_ok(), ok, "[{lo}, {hi})");
        }
    }

    #[test]
    fn a_span_past_the_block_or_the_scratch_is_refused() {
        let data = block(CHUNK, 10);
        let want = chunk_digests(&data, nz(CHUNK));
        let f = segment(&data, 0);
        let mut small = vec![0; 100];
        let r = read_span(&f.open(), 0, data.len(), 0, 200, nz(CHUNK), &want, &mut small);
        assert!(matches!(r, Err(ReadError::BadRange { .. })));
        let mut scratch = vec![0; CHUNK];
        let r = read_span(
            &f.open(),
            0,
            data.len(),
            CHUNK + 1,
            CHUNK + 2,
            nz(CHUNK),
            &want,
            &mut scratch,
        );
        assert!(matches!(r, Err(ReadError::BadRange { .. })));
        // hi past the end is cut to it, as the Python reader does
        let got =
            read_span(&f.open(), 0, data.len(), 10, 2 * CHUNK, nz(CHUNK), &want, &mut scratch);
        assert_eq!(got.unwrap(), &data[10..]);
    }
}
