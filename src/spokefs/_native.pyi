"""spokefs's native core (native/py over native/core, built by maturin): the byte path.

One call per block read; buffers are passed in (the buffer protocol), never allocated per
chunk; the GIL is released around every read and every hash of 64 KiB or more. A read that
fails, ends early or does not match its digests is ``False``, never an exception; a call that
breaks the contract raises ValueError (chunk 0, ``lo`` off a chunk boundary), TypeError (a
read-only ``out``) or BufferError (a non-contiguous buffer).
"""

import sys

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__version__: str
DIGEST_LEN: int  # bytes of one chunk digest (xxh3-64): 8

def chunk_digests(data: Buffer, chunk: int) -> bytes:
    """The xxh3-64 of each ``chunk``-byte piece of ``data`` (the last may be short), 8 bytes
    each, big-endian (as ``xxhash.xxh3_64_digest``), concatenated; b"" for empty data."""

def read_checked(fd: int, offset: int, out: Buffer, lo: int, chunk: int, chunks: bytes) -> bool:
    """Fill ``out`` with bytes [lo, lo + len(out)) of a block, read with pread from ``offset``
    of the open file ``fd`` (the file offset of the block's byte ``lo``), and check every
    chunk they touch against ``chunks`` (the block's chunk digests, 8 bytes each). ``lo`` is
    a multiple of ``chunk``; the range ends on a chunk boundary or at the block's end. True
    when all match; False when the read fails, ends early or a chunk does not match (then
    ``out`` holds bytes not to be used)."""

def block_digest(data: Buffer) -> bytes:
    """The xxh3-128 of ``data``, 16 bytes big-endian (as ``xxhash.xxh3_128_digest``). Not used
    by ``spokefs.integrity``, which keeps python-xxhash: measured no faster (``spokefs bench
    native``); here for the benchmark and for Rust-side callers to come."""
