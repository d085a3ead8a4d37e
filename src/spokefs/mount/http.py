"""A lean HTTP/1.1 range reader for the mount's data path: bytes land in the caller's buffer.

Why not ``UpstreamClient.read_range`` (which the mount still uses for metadata): aiohttp hands
a body over as a list of 64 KiB chunks joined into a fresh ``bytes``, and a fresh 4 MiB object
means a thousand page faults. Measured on loopback against a spoke, 4 MiB blocks cost the
client 5.0-6.7 ms of CPU each that way and 2.3 ms when ``recv`` writes straight into a reused
buffer (``asyncio.BufferedProtocol``) -- the mount's CPU is what limits a streaming read, so
that is the difference between ~0.3 and ~0.5 GB/s per stream here.

Errors are mapped like ``UpstreamClient``: connection failures, a body cut short and 5xx are
``Transient`` (retry); 4xx become the ``SpokeError`` the upstream sent (final).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from spokefs.wire.client import Transient, raise_for_status

_HEAD_MAX = 64 * 1024


class _Response:
    __slots__ = ("body", "status")

    def __init__(self, status: int, body: int | bytes) -> None:
        self.status = status
        self.body = body  # bytes received into the caller's buffer, or an error body


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection; at most one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self._scratch = bytearray(_HEAD_MAX)
        self._head = bytearray()
        self._target: memoryview | None = None    # where a 2xx body goes
        self._body: memoryview | None = None      # where the current body goes
        self._error: bytearray | None = None
        self._want = 0
        self._got = 0
        self._status = 0
        self._range_start = 0
        self._waiter: asyncio.Future[_Response] | None = None
        self.received_any = False

    # -- protocol callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Transient(f"connection closed by upstream{f': {exc}' if exc else ''}"))

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._body is not None:
            return self._body[self._got:self._want]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.received_any = True
        if self._body is not None:
            self._got += nbytes
            self._maybe_done()
            return
        if self._waiter is None:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        self._head += self._scratch[:nbytes]
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _HEAD_MAX:
                self._fail(Transient("upstream sent an oversized response head"))
                self.abort()
            return
        try:
            self._start_body(bytes(self._head[:end]))
        except Transient as exc:
            self._fail(exc)
            self.abort()
            return
        rest = self._head[end + 4:]
        self._head = bytearray()
        assert self._body is not None
        if len(rest) > self._want:  # more than the body: the stream is out of step
            self.keep_alive = False
        n = min(len(rest), self._want)
        self._body[:n] = rest[:n]
        self._got = n
        self._maybe_done()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails any pending request

    # -- request state --------------------------------------------------------------------------
    def _start_body(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise Transient(f"upstream sent a bad status line {lines[0][:80]!r}")
        self._status = int(parts[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                self.keep_alive = False
            elif name == "transfer-encoding" and value.strip().lower() != "identity":
                raise Transient("upstream sent a chunked body where a length was expected")
        if length is None:
            raise Transient("upstream response has no Content-Length")
        self._want = length
        ok = self._status == 206 or (self._status == 200 and self._range_start == 0)
        if ok:
            assert self._target is not None
            if length > len(self._target):
                raise Transient(f"upstream sent {length} bytes for a {len(self._target)}-byte "
                                "range")
            self._body = self._target
        else:
            self._error = bytearray(length)
            self._body = memoryview(self._error)

    def _maybe_done(self) -> None:
        if self._got < self._want or self._waiter is None:
            return
        body: int | bytes = self._got if self._error is None else bytes(self._error)
        waiter, self._waiter = self._waiter, None
        self._body = self._target = self._error = None
        if not waiter.done():
            waiter.set_result(_Response(self._status, body))

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self._body = self._target = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, request: bytes, start: int, target: memoryview) -> asyncio.Future[_Response]:
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._target = target
        self._range_start = start
        self._head = bytearray()
        self._error = None
        self._got = self._want = 0
        self.received_any = False
        self.transport.write(request)
        return self._waiter

    def abort(self) -> None:
        # abort, not close: stop reading at once, so no late byte lands in a buffer that its
        # owner has moved on from.
        self.closed = True
        self._body = self._target = None
        if self.transport is not None:
            self.transport.abort()


class RangeClient:
    """Ranged GETs over a pool of kept-alive connections, bodies read into given buffers."""

    def __init__(self, base_url: str, max_connections: int = 32) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"RangeClient needs an http:// URL, not {base_url!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._host_header = u.netloc
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._all: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as exc:
            raise Transient(f"cannot connect to {self.host}:{self.port}: "
                            f"{exc.strerror or exc}") from exc
        self._all.add(conn)
        return conn

    async def read_into(self, path: str, start: int, buf: memoryview) -> int:
        """GET ``path`` bytes [start, start+len(buf)) into ``buf``; the count received (less
        only at the end of the object)."""
        request = (f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                   f"Range: bytes={start}-{start + len(buf) - 1}\r\n"
                   "Accept-Encoding: identity\r\n\r\n").encode()
        async with self._slots:
            # A kept-alive connection the upstream closed meanwhile fails before any byte
            # comes back: then try once more on a fresh one.
            for reused in (True, False):
                conn = self._take_idle() if reused else None
                if conn is None:
                    reused = False
                    conn = await self._connect()
                try:
                    resp = await conn.begin(request, start, buf)
                except Transient:
                    conn.abort()
                    self._all.discard(conn)
                    if reused and not conn.received_any:
                        continue
                    raise
                except BaseException:  # cancelled (deadline): the connection is mid-response
                    conn.abort()
                    self._all.discard(conn)
                    raise
                if conn.keep_alive and not conn.closed:
                    self._idle.append(conn)
                else:
                    conn.abort()
                    self._all.discard(conn)
                break
        if isinstance(resp.body, int):
            return resp.body
        raise_for_status(resp.status, resp.body, f"{path} [{start},{start + len(buf)})")
        raise AssertionError("unreachable")

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)
        return None

    async def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()

