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

class Mount:
    """The native mount engine (native/mount): one snapshot as a read-only FUSE mount,
    served by Rust threads (``spokefs.mount.native``). Errors are the project's
    ConfigError (settings, columns, unmount) with a message saying why."""

    def __init__(self, mountpoint: str, *, paths: list[str], sizes: list[int],
                 modes: list[int], mtimes_ns: list[int], versions: list[str],
                 dirs: list[str], block_size: int, dataset: str, snapshot: str,
                 base_url: str, token: str | None = None, deadline_s: float = 30.0,
                 options: list[str], uid: int = 0, gid: int = 0, created_ns: int = 0,
                 short_circuit: dict[str, object] | None = None, workers: int = 32,
                 connections: int = 32, file_uid: int | None = None,
                 file_gid: int | None = None, file_mode: int | None = None,
                 dir_mode: int | None = None, staging: str | None = None,
                 write_passthrough: bool = False) -> None: ...
    def take_writes(self, timeout_s: float) -> list[
            tuple[int, str, str, str | None, str | None, bool]] | None:
        """A writable mount's requests (``staging`` given): (id, "put", path, None, staged,
        False), (id, "rename", from, to, staged, uploaded), (id, "discard", path, None, None,
        True); None once closed. Each waits for ``answer_write``."""
    def answer_write(self, id: int, errno: int, committed: str | None = None) -> bool:
        """0 or an errno, and the folder ("dir/") committed with it."""
    def start(self) -> None:
        """Mount; returns once the kernel has initialised the session (GIL released)."""
    def wait(self, timeout_s: float) -> bool:
        """Up to ``timeout_s`` (sooner when a log line waits); True once unmounted."""
    def unmount(self) -> bool:
        """Detach lazily; False if it was gone already."""
    def counters(self) -> dict[str, int]: ...
    def metrics(self) -> tuple[list[float], list[tuple[str, list[int], float]], dict[str, int]]:
        """One reading for /metrics: the latency buckets' upper bounds in seconds (+Inf left
        out); per kind of request (lookup, getattr, open, read, readdir) its requests per
        bucket (not cumulative, the last +Inf) and their total seconds; the counters."""
    def take_logs(self) -> list[tuple[int, str]]:
        """(logging level, message) lines waiting for the owner."""
    def close(self) -> None:
        """After the mount is gone: the last reads reported."""
    @property
    def file_count(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
