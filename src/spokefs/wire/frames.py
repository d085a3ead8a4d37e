"""The body of a batch read: many whole blocks in one response, each framed with its digest.

Sans-I/O: bytes in, frames out. Used by the server to write a batch (``encode_header``) and by
the client to take one apart (``FrameReader``) without copying large payloads: the reader
says where the bytes of the frame being read belong (``buffer``), and the caller receives
straight into it.

    body  = frame*                    (as many frames as blocks asked for, in any order)
    frame = header payload
    header (40 bytes, big-endian):
        magic        4 bytes  b"SPKB"
        seq          u32      position of the block in the request's list
        status       u16      200, or the HTTP status of this block's error (404, 410, ...)
        flags        u16      0 (reserved)
        length       u32      payload bytes that follow
        object_size  u64      size of the whole file version (200 only; else 0)
        digest       16 bytes xxh3-128 of the payload (200 only; else zeros)
    payload: the block's bytes (200), or a JSON error body {"error": {...}} (other statuses)
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"SPKB"
HEADER = struct.Struct("!4sIHHIQ16s")
HEADER_SIZE = HEADER.size  # 40
NO_DIGEST = bytes(16)
# Bytes of a payload the reader keeps in a buffer of its own (an error body, a block nobody
# asked for): the length comes from the sender, so it is bounded before anything is made.
MAX_UNWANTED = 64 << 10


class FrameError(ValueError):
    """The body is not a sequence of frames: the stream is out of step and cannot be used."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    seq: int
    status: int
    length: int
    object_size: int
    digest: bytes


def encode_header(seq: int, status: int, length: int, object_size: int = 0,
                  digest: bytes = NO_DIGEST) -> bytes:
    return HEADER.pack(MAGIC, seq, status, 0, length, object_size, digest)


def decode_header(raw: bytes | bytearray | memoryview) -> FrameHeader:
    magic, seq, status, _flags, length, size, digest = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}: not a spokefs batch body")
    return FrameHeader(seq, status, length, size, digest)


class FrameReader:
    """Takes a batch body apart as it arrives.

    ``begin(header) -> memoryview | None`` is called when a header is complete and returns
    where the payload goes (exactly ``header.length`` bytes; None: into a buffer the reader
    makes, for error bodies and blocks nobody wants, at most ``MAX_UNWANTED`` bytes, else
    FrameError). ``end(header, payload)`` is called when the payload is complete. Bytes
    reach the reader either way:

    - ``feed(data)`` copies from a chunk the caller received elsewhere (small frames);
    - ``buffer()`` is the rest of the current payload's destination, for the caller to receive
      into directly; then ``advance(n)``.
    """

    def __init__(self, begin: Callable[[FrameHeader], memoryview | None],
                 end: Callable[[FrameHeader, memoryview], None]) -> None:
        self._begin = begin
        self._end = end
        self._head = bytearray(HEADER_SIZE)
        self._head_got = 0
        self._frame: FrameHeader | None = None
        self._dest: memoryview | None = None
        self._got = 0
        self.frames = 0  # completed
        self.last_length = 0  # of the last frame completed

    @property
    def between_frames(self) -> bool:
        """True when no frame is partly read: the body may end here."""
        return self._frame is None and self._head_got == 0

    def header_left(self) -> int:
        """Bytes still to come of the next frame's header (0 while reading a payload)."""
        return 0 if self._frame is not None else HEADER_SIZE - self._head_got

    def frame_length(self) -> int:
        """The payload length of the frame being read (0 while reading a header)."""
        return 0 if self._frame is None else self._frame.length

    def payload_left(self) -> int:
        """Bytes still to come of the current payload (0 while reading a header)."""
        return 0 if self._frame is None else self._frame.length - self._got

    def buffer(self) -> memoryview:
        """Where the next bytes of the current payload go (only while payload_left() > 0)."""
        assert self._frame is not None and self._dest is not None
        return self._dest[self._got:self._frame.length]

    def advance(self, n: int) -> None:
        """``n`` bytes were received into ``buffer()``."""
        self._got += n
        if self._frame is not None and self._got == self._frame.length:
            self._finish()

    def feed(self, data: memoryview) -> None:
        """Consume a chunk of the body (copied into headers and payload destinations)."""
        pos, n = 0, len(data)
        while pos < n:
            if self._frame is None:
                take = min(HEADER_SIZE - self._head_got, n - pos)
                self._head[self._head_got:self._head_got + take] = data[pos:pos + take]
                self._head_got += take
                pos += take
                if self._head_got == HEADER_SIZE:
                    self._start(decode_header(self._head))
                continue
            take = min(self._frame.length - self._got, n - pos)
            assert self._dest is not None
            self._dest[self._got:self._got + take] = data[pos:pos + take]
            pos += take
            self.advance(take)

    def _start(self, h: FrameHeader) -> None:
        self._head_got = 0
        self._frame = h
        self._got = 0
        dest = self._begin(h)
        if dest is None:
            if h.length > MAX_UNWANTED:
                raise FrameError(f"a {h.length}-byte frame (status {h.status}) where at most "
                                 f"{MAX_UNWANTED} were expected")
            dest = memoryview(bytearray(h.length))
        elif len(dest) != h.length:
            raise FrameError(f"destination of {len(dest)} bytes for a {h.length}-byte frame")
        self._dest = dest
        if h.length == 0:
            self._finish()

    def _finish(self) -> None:
        h, dest = self._frame, self._dest
        assert h is not None and dest is not None
        self._frame = self._dest = None
        self._got = 0
        self.frames += 1
        self.last_length = h.length
        self._end(h, dest)
