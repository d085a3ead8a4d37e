//! `spokefs._native`: the Python seam over spokefs-core (`native/core`).
//!
//! One call per block read, never per chunk: Python passes a segment file's descriptor, a
//! buffer it owns (any writable object with the buffer protocol: bytearray, memoryview,
//! mmap) and the block's chunk digests; the read and every check run here with the GIL
//! released, so replica workers and mounts reading from several threads run in parallel.
//! Errors are mapped here, once: a failed, short or mismatching read is `False` (the Python
//! readers' "stale or damaged: treat as a miss"), a call that breaks the contract (chunk
//! size 0, a start off a chunk boundary, a read-only or non-contiguous buffer) raises
//! ValueError, TypeError or BufferError. Types: `src/spokefs/_native.pyi`.

mod mount;

use std::io;
use std::num::NonZeroUsize;
use std::os::fd::RawFd;
use std::slice;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use spokefs_core::{DIGEST_LEN, ReadAt, ReadError};

/// Hashing less than this keeps the GIL (as python-xxhash does): releasing and taking it back
/// costs about what the hash does (xxh3 does 64 KiB in about a microsecond), and under
/// contention taking it back can wait for another thread's switch interval. Reads always
/// release it (a pread can block on the disk).
const DETACH_MIN: usize = 64 * 1024;

/// A descriptor Python owns (a segment file's), read with `pread`; never closed here.
struct Fd(RawFd);

impl ReadAt for Fd {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the kernel writes at most `buf.len()` bytes at `buf.as_mut_ptr()`, which a
        // live `&mut [u8]` makes valid and exclusively ours. The descriptor is only an
        // integer to the kernel: if Python closed it meanwhile the call fails with EBADF, and
        // if the number was reused for another file we read that file's bytes, which then fail
        // their digest check; neither touches memory we do not own. We never close it.
        let n = unsafe { libc::pread(self.0, buf.as_mut_ptr().cast(), buf.len(), offset) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }
}

fn chunk_size(chunk: usize) -> PyResult<NonZeroUsize> {
    NonZeroUsize::new(chunk).ok_or_else(|| PyValueError::new_err("chunk size must be positive"))
}

/// `obj`'s buffer, held (exported) until dropped, checked to be C-contiguous.
fn contiguous(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PyUntypedBuffer> {
    let buf = PyUntypedBuffer::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err(format!("{what} must be a contiguous buffer")));
    }
    Ok(buf)
}

/// The bytes of a held contiguous buffer.
fn bytes_of(buf: &PyUntypedBuffer) -> &[u8] {
    let len = buf.len_bytes();
    if len == 0 {
        return &[];
    }
    // The seam's contract, kept by every caller (each passes buffers it owns; scratch buffers
    // are per thread): no other thread writes the buffer during the call.
    // SAFETY: `buf` is a held export of a C-contiguous buffer: `buf_ptr()` points at
    // `len_bytes()` initialised bytes that stay in place while it is held (an exporter may not
    // free or resize an exported buffer); the slice borrows `buf`, so cannot outlive it.
    unsafe { slice::from_raw_parts(buf.buf_ptr().cast::<u8>(), len) }
}

/// The bytes of a held contiguous buffer that is writable.
fn bytes_of_mut<'b>(buf: &'b mut PyUntypedBuffer, what: &str) -> PyResult<&'b mut [u8]> {
    if buf.readonly() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a writable buffer (a bytearray or a memoryview of one)"
        )));
    }
    let len = buf.len_bytes();
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: as in `bytes_of`, and the exporter said the memory is writable; the `&mut`
    // borrow of `buf` makes this the only slice made from it. Exclusive use during the call
    // is the seam's contract (see `bytes_of`): every caller reads into a buffer it owns.
    Ok(unsafe { slice::from_raw_parts_mut(buf.buf_ptr().cast::<u8>(), len) })
}

/// The xxh3-64 digest of each `chunk`-byte piece of `data` (the last may be short), 8 bytes
/// each, big-endian (as xxhash.xxh3_64_digest), concatenated; b"" for empty data.
#[pyfunction]
fn chunk_digests<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    chunk: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let chunk = chunk_size(chunk)?;
    let buf = contiguous(data, "data")?;
    let src = bytes_of(&buf);
    let digests = if src.len() < DETACH_MIN {
        spokefs_core::chunk_digests(src, chunk)
    } else {
        py.detach(|| spokefs_core::chunk_digests(src, chunk))
    };
    Ok(PyBytes::new(py, &digests))
}

/// Fill `out` with bytes [lo, lo + len(out)) of a block, read with pread from `offset` of
/// the open file `fd` (the file offset of the block's byte `lo`), and check every chunk they
/// touch against `chunks` (the block's chunk digests, 8 bytes each). `lo` must be a multiple
/// of `chunk`; the range ends on a chunk boundary or at the end of the block. True when all
/// match; False when the read fails, ends early (a file cut short) or any chunk does not
/// match (damaged, or stale: a freed region reads as zeros), and then `out`'s contents are
/// not to be used. The GIL is released for the read and the checks.
#[pyfunction]
fn read_checked(
    py: Python<'_>,
    fd: RawFd,
    offset: u64,
    out: &Bound<'_, PyAny>,
    lo: usize,
    chunk: usize,
    chunks: &[u8],
) -> PyResult<bool> {
    let chunk = chunk_size(chunk)?;
    let mut buf = contiguous(out, "out")?;
    let dst = bytes_of_mut(&mut buf, "out")?;
    match py.detach(|| spokefs_core::read_checked(&Fd(fd), offset, dst, lo, chunk, chunks)) {
        Ok(()) => Ok(true),
        Err(e @ ReadError::BadRange { .. }) => {
            Err(PyValueError::new_err(format!("{e} (chunk size {chunk})")))
        }
        Err(ReadError::Io(_) | ReadError::Short { .. } | ReadError::Mismatch { .. }) => Ok(false),
    }
}

/// The xxh3-128 of `data`, 16 bytes big-endian (as xxhash.xxh3_128_digest). spokefs.integrity
/// keeps python-xxhash (measured no faster: `spokefs bench native`).
#[pyfunction]
fn block_digest<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let buf = contiguous(data, "data")?;
    let src = bytes_of(&buf);
    let d = if src.len() < DETACH_MIN {
        spokefs_core::block_digest(src)
    } else {
        py.detach(|| spokefs_core::block_digest(src))
    };
    Ok(PyBytes::new(py, &d))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DIGEST_LEN", DIGEST_LEN)?;
    m.add_function(wrap_pyfunction!(chunk_digests, m)?)?;
    m.add_function(wrap_pyfunction!(read_checked, m)?)?;
    m.add_function(wrap_pyfunction!(block_digest, m)?)?;
    m.add_class::<mount::PyMount>()?;
    Ok(())
}
