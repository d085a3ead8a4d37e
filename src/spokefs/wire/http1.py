"""The data-path HTTP/1.1 client: response bodies land where their bytes belong.

A spoke filling its cache and a mount reading through a spoke both move most of their bytes
through this client, so it is built for that: a pool of kept-alive connections, each an
``asyncio.BufferedProtocol`` whose ``recv_into`` writes a large payload straight into its
destination (the caller's buffer), and small pieces (headers, 128 KiB blocks in a batch)
into one reused scratch buffer from which they are copied. No ``bytes`` are created or
joined per chunk; a fresh multi-MiB object costs a page fault per 4 KiB, a reused one none.

Two requests:

- ``read_into(path, start, buf)``: one ranged GET into ``buf``;
- ``read_blocks(path, body, begin, end)``: a batch read (docs/protocol.md, ``spokefs.wire.
  frames``): many blocks in one response, each delivered to ``end`` as it completes, so a
  response cut in the middle still leaves every whole frame delivered.

Errors are mapped at this boundary: a refused, reset or silent connection, a body cut short
and 5xx are ``Transient`` (retry); 4xx become the ``SpokeError`` the upstream sent (final).
Only plain ``http://`` is spoken here.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

from spokefs.errors import Transient, from_status
from spokefs.wire.auth import FROM_ENV, client_token
from spokefs.wire.frames import FrameError, FrameHeader, FrameReader
from spokefs.wire.ranges import ascii_digits
from spokefs.wire.tls import client_context, untrusted

_SCRATCH = 256 * 1024     # one recv of small pieces
_DIRECT_MIN = 64 * 1024   # a payload piece at least this large is received in place
_HEAD_MAX = 64 * 1024
MAX_ERROR_BODY = 1 << 20  # bytes of a non-2xx answer's body (JSON errors are a few hundred)


def raise_for_status(status: int, body: bytes, what: str) -> None:
    """Map an upstream error answer: 5xx (but 501) may be retried, the rest are final."""
    if status >= 500 and status != 501:
        raise Transient(f"upstream answered {status} for {what}")
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    raise from_status(status, doc, f"upstream answered {status} for {what}")


class Sink(Protocol):
    """Where a response body goes."""

    def direct(self) -> memoryview | None: ...   # a large destination to receive into
    def advance(self, n: int) -> None: ...         # n bytes were received into direct()
    def feed(self, data: memoryview) -> None: ...  # a piece received into scratch


class _IntoBuffer:
    """The body of a ranged GET, into the caller's buffer."""

    def __init__(self, target: memoryview) -> None:
        self.target = target
        self.got = 0

    def direct(self) -> memoryview | None:
        return self.target[self.got:]

    def advance(self, n: int) -> None:
        self.got += n

    def feed(self, data: memoryview) -> None:
        self.target[self.got:self.got + len(data)] = data
        self.got += len(data)


class _Collect:
    """A small body (an error, JSON) kept whole."""

    def __init__(self, length: int) -> None:
        self.data = bytearray(length)
        self.got = 0

    def direct(self) -> memoryview | None:
        return memoryview(self.data)[self.got:]

    def advance(self, n: int) -> None:
        self.got += n

    def feed(self, data: memoryview) -> None:
        self.data[self.got:self.got + len(data)] = data
        self.got += len(data)


class _Frames:
    """A batch body, taken apart as it arrives."""

    def __init__(self, reader: FrameReader) -> None:
        self.reader = reader

    def direct(self) -> memoryview | None:
        if self.reader.payload_left() >= _DIRECT_MIN:
            return self.reader.buffer()
        return None

    def advance(self, n: int) -> None:
        self.reader.advance(n)

    def feed(self, data: memoryview) -> None:
        self.reader.feed(data)


def _range_start(head: Head) -> int | None:
    """The first byte a 206 answer holds, from its ``Content-Range: bytes A-B/N``."""
    unit, _, rest = head.headers.get("content-range", "").partition(" ")
    first = rest.partition("-")[0]
    return int(first) if unit == "bytes" and ascii_digits(first, 20) else None


class Head:
    __slots__ = ("body", "headers", "length", "status")

    def __init__(self, status: int, headers: dict[str, str], length: int) -> None:
        self.status = status
        self.headers = headers  # names lower-cased
        self.length = length
        self.body = b""         # the whole body of a non-2xx answer


SinkFor = Callable[[Head], Sink]


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection, one request at a time."""

    def __init__(self, client: DataClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self.received_any = False
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._head_len = 0
        self._head: Head | None = None
        self._sink: Sink | None = None
        self._sink_for: SinkFor | None = None
        self._left = 0           # body bytes still to come
        self._direct = False     # the last buffer handed out was the sink's own
        self._waiter: asyncio.Future[Head] | None = None
        self._progress: Callable[[int], None] | None = None
        self.last_received = 0.0

    # -- protocol callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Transient(f"connection closed by upstream{f': {exc}' if exc else ''}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails a pending request

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            d = self._sink.direct()
            if d is not None and len(d) > 0:
                self._direct = True
                return d[:self._left] if len(d) > self._left else d
            self._direct = False
            return self._view[:min(_SCRATCH, self._left)]
        self._direct = False
        return self._view[self._head_len:]

    def buffer_updated(self, nbytes: int) -> None:
        self.received_any = True
        self.last_received = self.client.last_received = time.monotonic()
        if self._sink is not None:
            self._body_bytes(nbytes)
            return
        if self._waiter is None:  # bytes nobody asked for: the stream is out of step
            self.abort()
            return
        start = max(0, self._head_len - 3)
        self._head_len += nbytes
        end = self._scratch.find(b"\r\n\r\n", start, self._head_len)
        if end < 0:
            if self._head_len >= _HEAD_MAX:
                self._fail(Transient("upstream sent an oversized response head"))
                self.abort()
            return
        try:
            self._start_body(bytes(self._scratch[:end]))
            rest = self._head_len - end - 4
            self._head_len = 0
            if rest > self._left:  # more than the body: the stream is out of step
                self.keep_alive = False
                rest = self._left
            if rest:
                assert self._sink is not None
                self._sink.feed(self._view[end + 4:end + 4 + rest])
                self._after(rest)
            elif self._left == 0:
                self._done()
        except (Transient, FrameError, ValueError) as exc:
            self._fail(exc if isinstance(exc, Transient) else Transient(
                f"upstream sent a bad body: {exc}"))
            self.abort()

    def _body_bytes(self, n: int) -> None:
        assert self._sink is not None
        try:
            if self._direct:
                self._sink.advance(n)
            else:
                self._sink.feed(self._view[:n])
        except (FrameError, ValueError) as exc:
            self._fail(Transient(f"upstream sent a bad body: {exc}"))
            self.abort()
            return
        self._after(n)

    def _after(self, n: int) -> None:
        self._left -= n
        progress = self._progress
        if progress is not None:
            progress(n)
        if self._left == 0:
            self._done()

    # -- request state ------------------------------------------------------------------------
    def _start_body(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not ascii_digits(parts[1], 3):
            raise Transient(f"upstream sent a bad status line {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("connection", "").lower() == "close":
            self.keep_alive = False
        if headers.get("transfer-encoding", "identity").lower() != "identity":
            raise Transient("upstream sent a chunked body where a length was expected")
        length = headers.get("content-length")
        if length is None or not ascii_digits(length, 19):
            raise Transient("upstream response has no Content-Length")
        head = Head(int(parts[1]), headers, int(length))
        assert self._sink_for is not None
        self._head = head
        if not 200 <= head.status < 300 and head.length > MAX_ERROR_BODY:
            # The sender names the length: an error answer is never buffered at any size.
            raise Transient(f"upstream answered {head.status} with a body of {head.length} "
                            f"bytes, more than the {MAX_ERROR_BODY} an error answer may hold")
        self._sink = (self._sink_for(head) if 200 <= head.status < 300
                      else _Collect(head.length))
        self._left = head.length

    def _done(self) -> None:
        waiter, self._waiter = self._waiter, None
        head = self._head
        if head is not None and isinstance(self._sink, _Collect):
            head.body = bytes(self._sink.data)
        self._reset()
        if waiter is not None and not waiter.done():
            waiter.set_result(head)  # type: ignore[arg-type]

    def _reset(self) -> None:
        self._sink = self._sink_for = None
        self._progress = None
        self._head = None
        self._left = 0
        self._head_len = 0

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self._reset()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, request: bytes, sink_for: SinkFor,
              progress: Callable[[int], None] | None) -> asyncio.Future[Head]:
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._sink_for = sink_for
        self._progress = progress
        self._head_len = 0
        self.received_any = False
        self.transport.write(request)
        return self._waiter

    def abort(self) -> None:
        # abort, not close: stop reading at once, so no late byte lands in a buffer whose
        # owner has moved on. A request still waiting here was given up by its caller.
        self.closed = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.cancel()
        self._reset()
        if self.transport is not None:
            self.transport.abort()


class DataClient:
    """Ranged GETs and batch reads over a pool of kept-alive connections to one upstream.

    ``idle_timeout``: a request whose connection brings no byte for this long fails
    (``Transient``): a stalled link must not hold a slot forever. With ``idle_any``, only
    while no connection of the pool brings a byte (a server that answers a batch once all of
    it is ready, and is answering other requests meanwhile, is busy, not gone: tier members).
    A request's ``progress(n)`` hears each piece of its body as it arrives (the spoke's link
    model counts them).
    """

    def __init__(self, base_url: str, max_connections: int = 64,
                 idle_timeout: float = 60.0, connect_timeout: float = 10.0,
                 token: str | object | None = FROM_ENV, idle_any: bool = False) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"the data client needs an http(s):// URL, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self._tls = client_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        self._host_header = u.netloc
        tok = client_token() if token is FROM_ENV else token
        # Sent with every request (spokefs.wire.auth); never logged.
        self._auth = f"Authorization: Bearer {tok}\r\n" if tok else ""
        self.idle_timeout = idle_timeout
        self.idle_any = idle_any
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        # time.monotonic() of the last bytes from the upstream: tells a slow link (bytes keep
        # coming) from a dead one.
        self.last_received = time.monotonic()
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._all: set[_Connection] = set()

    # -- requests ------------------------------------------------------------------------------
    async def read_into(self, path: str, start: int, buf: memoryview,
                        headers: dict[str, str] | None = None,
                        progress: Callable[[int], None] | None = None) -> tuple[int, Head]:
        """GET ``path`` bytes [start, start+len(buf)) into ``buf``; (count received, head).
        The count is less than len(buf) only at the end of the object."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                   f"Range: bytes={start}-{start + len(buf) - 1}\r\n{extra}{self._auth}"
                   "Accept-Encoding: identity\r\n\r\n").encode()
        sinks: list[_IntoBuffer] = []

        def sink_for(head: Head) -> Sink:
            if head.status == 200 and start != 0:
                raise Transient("upstream ignored the Range header")
            if head.status == 206 and _range_start(head) != start:
                # Bytes of another range are other bytes: never taken as these.
                raise Transient(f"upstream answered {head.headers.get('content-range')!r} "
                                f"for a read at {start}")
            if head.length > len(buf):
                raise Transient(f"upstream sent {head.length} bytes for a {len(buf)}-byte "
                                "range")
            sinks.append(_IntoBuffer(buf))
            return sinks[-1]

        what = f"{path} [{start},{start + len(buf)})"
        head = await self._exchange(request, sink_for, what, progress)
        if not 200 <= head.status < 300:
            raise_for_status(head.status, head.body, what)
        return sinks[0].got, head

    async def read_blocks(self, path: str, body: bytes,
                          begin: Callable[[FrameHeader], memoryview | None],
                          end: Callable[[FrameHeader, memoryview], None],
                          progress: Callable[[int], None] | None = None,
                          headers: dict[str, str] | None = None) -> int:
        """POST a batch read; frames go to ``begin``/``end`` (see ``FrameReader``) as they
        arrive. Returns the number of frames. A cut stream raises ``Transient`` after every
        whole frame before the cut was delivered."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                   f"{extra}{self._auth}"
                   "Accept-Encoding: identity\r\n\r\n").encode() + body
        readers: list[FrameReader] = []

        def sink_for(head: Head) -> Sink:
            readers.append(FrameReader(begin, end))
            return _Frames(readers[0])

        head = await self._exchange(request, sink_for, path, progress)
        if not 200 <= head.status < 300:
            raise_for_status(head.status, head.body, path)
        if not readers[0].between_frames:
            raise Transient("upstream's batch body ended inside a frame")
        return readers[0].frames

    # -- the pool ------------------------------------------------------------------------------
    async def _exchange(self, request: bytes, sink_for: SinkFor, what: str,
                        progress: Callable[[int], None] | None = None) -> Head:
        if self._slots is None:  # made in the running loop
            self._slots = asyncio.Semaphore(self.max_connections)
        async with self._slots:
            # A kept-alive connection the upstream closed meanwhile fails before any byte
            # comes back: then try once more on a fresh one.
            for reused in (True, False):
                conn = self._take_idle() if reused else None
                if conn is None:
                    reused = False
                    conn = await self._connect()
                try:
                    head = await self._wait(conn, conn.begin(request, sink_for, progress),
                                            what)
                except Transient:
                    self._discard(conn)
                    if reused and not conn.received_any:
                        continue
                    raise
                except BaseException:  # cancelled: the connection is mid-response
                    self._discard(conn)
                    raise
                if conn.keep_alive and not conn.closed:
                    self._idle.append(conn)
                else:
                    self._discard(conn)
                return head
        raise AssertionError("unreachable")

    async def _wait(self, conn: _Connection, fut: asyncio.Future[Head], what: str) -> Head:
        """The response, unless the connection stays silent for ``idle_timeout``."""
        conn.last_received = time.monotonic()
        while True:
            heard = max(conn.last_received, self.last_received) if self.idle_any \
                else conn.last_received
            left = heard + self.idle_timeout - time.monotonic()
            if left <= 0:
                conn.abort()
                raise Transient(f"no byte from upstream for {self.idle_timeout:g}s ({what})")
            done, _ = await asyncio.wait({fut}, timeout=left)
            if done:
                return fut.result()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._tls,
                    server_hostname=self.host if self._tls is not None else None)
        except ssl.SSLCertVerificationError as exc:
            raise untrusted(f"{self.host}:{self.port}", exc) from exc
        except (OSError, TimeoutError) as exc:
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else
                      str(exc) or type(exc).__name__)
            raise Transient(f"cannot connect to {self.host}:{self.port}: {reason}") from exc
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)
        return None

    def _discard(self, conn: _Connection) -> None:
        conn.abort()
        self._all.discard(conn)

    async def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()
