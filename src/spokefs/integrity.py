"""Block geometry and digests: how a file version is cut into blocks and how each is checked.

A file version is cut into fixed-size blocks (the dataset's ``block_size``; the last block is
short; an empty file has none). Each block has an xxh3-128 digest, computed by the hub when it
snapshots the file and sent with the block (in its batch-read frame, or as
``X-Spokefs-Block-Digest`` on a read of exactly one whole block). A spoke checks every block it
fetches from upstream against that digest before it serves or keeps it, and keeps the digest
beside the cached block. Reads from the cache are checked against finer digests the spoke
makes when the block arrives, an xxh3-64 of each 256 KiB chunk (``spokefs.cache.store``):
every read of a cached block checks the chunks it touches, on the reader's own copy of the
bytes (a spoke's read of 1 MiB or more: on a copy read in a thread, then sent with sendfile
from the same region, held meanwhile). The version id is a digest (blake2b-128) of the size,
the block size and the block digests, so equal content has one id and any change gives a new
one.

Because the version id comes from the manifest a spoke pinned, it is what every received
block is checked against (``spoke.commitments``): a sender cannot pass other bytes off with a
digest made to match them. xxh3 itself guards against accidents (bit rot, torn writes, a file
changed under the hub), not against an adversary able to make a block with a given xxh3-128;
TLS and authentication are the answer to that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import BinaryIO

import xxhash

DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
DIGEST_SIZE = 16


def block_digest(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def version_id(size: int, block_size: int, digests: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{size}:{block_size}:".encode())
    for d in digests:
        h.update(d)
    return h.hexdigest()


class BlockDigests:
    """``stream_digests`` for bytes that arrive in pieces of any size (an upload's body): fed
    in order, each block digested once it is whole, the last one at ``digests``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hash = xxhash.xxh3_128()
        self._in_block = 0
        self._done: list[bytes] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.block_size - self._in_block)
            self._hash.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self.block_size:
                self._done.append(self._hash.digest())
                self._hash.reset()
                self._in_block = 0

    def digests(self) -> list[bytes]:
        """Every block's digest so far, a short last block included (none for no bytes)."""
        return self._done + ([self._hash.digest()] if self._in_block else [])


def stream_digests(f: BinaryIO, block_size: int) -> tuple[int, list[bytes]]:
    """The bytes ``f`` holds from where it is to its end, cut into blocks: their count in
    bytes and each block's digest (an upload's check, on either side)."""
    size, digests = 0, []
    while data := f.read(block_size):
        # A raw file may answer short before its end; only a block of block_size or the
        # last one may be digested as one.
        while len(data) < block_size and (more := f.read(block_size - len(data))):
            data += more
        digests.append(block_digest(data))
        size += len(data)
    return size, digests


def block_count(size: int, block_size: int) -> int:
    return (size + block_size - 1) // block_size


def block_span(index: int, size: int, block_size: int) -> tuple[int, int]:
    """Half-open byte range [start, end) of block ``index`` in a file of ``size`` bytes."""
    start = index * block_size
    return start, min(size, start + block_size)


def blocks_in_range(start: int, end: int, block_size: int) -> range:
    """Indexes of the blocks that hold bytes [start, end) (end exclusive, end > start)."""
    return range(start // block_size, (end - 1) // block_size + 1)
