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

The bytes of a connection are taken apart by ``wire.h1.ResponseParser`` (sans-I/O); the
protocol here hands out the parser's buffers (the caller's own for a body) and turns its
events into answers. Errors are mapped by ``spokefs.wire.errors``: a refused, reset or
silent connection, an answer that breaks the parser's rules (or is for another range) and
5xx are ``Transient`` (retry); 4xx become the ``SpokeError`` the upstream sent (final).
Plain ``http://`` and ``https://``.

A connection is only ever reused once its parser has seen a whole response and nothing more;
bytes that come when no response is expected abort it, and once aborted (a request given up:
cancelled, timed out, refused) the parser forgets where bodies go, so a late byte a transport
still delivers can only land in its scratch buffer, never in a caller's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from spokefs.errors import Failure, Transient
from spokefs.wire.auth import FROM_ENV, client_token
from spokefs.wire.errors import error_for_transport, raise_for_status
from spokefs.wire.frames import HEADER_SIZE, FrameHeader, FrameReader
from spokefs.wire.h1 import (
    DIRECT_MIN,
    MAX_ERROR_BODY,
    BodyBytes,
    Head,
    IntoBuffer,
    ResponseError,
    ResponseParser,
    Sink,
    SinkFor,
    check_range_answer,
)
from spokefs.wire.tls import client_context

__all__ = ["MAX_ERROR_BODY", "DataClient", "Head", "Sink", "raise_for_status"]


class _Frames:
    """A batch body, taken apart as it arrives."""

    def __init__(self, reader: FrameReader) -> None:
        self.reader = reader

    def direct(self) -> memoryview | None:
        if self.reader.payload_left() >= DIRECT_MIN:
            return self.reader.buffer()
        return None

    def advance(self, n: int) -> None:
        self.reader.advance(n)

    def feed(self, data: memoryview) -> None:
        self.reader.feed(data)

    def scratch_limit(self) -> int | None:
        """In a large frame (or after one), scratch takes only the rest of its payload and
        the next header: the next payload, likely as large, is then received in place
        rather than copied out of scratch (that copy cost the event loop ~15% of a fill of
        128 KiB blocks, py-spy). Among small frames, any amount: one receive takes many."""
        r = self.reader
        if max(r.frame_length(), r.last_length) < DIRECT_MIN:
            return None
        return r.payload_left() + (r.header_left() or HEADER_SIZE)


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection, one request at a time; its bytes go through a parser."""

    def __init__(self, client: DataClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self.received_any = False
        self.parser = ResponseParser()
        self._waiter: asyncio.Future[Head] | None = None
        self._progress: Callable[[int], None] | None = None
        self.last_received = 0.0

    # -- protocol callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser.close()
        self._fail(Transient(f"connection closed by upstream{f': {exc}' if exc else ''}",
                             Failure.CLOSED))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails a pending request

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.parser.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.received_any = True
        self.last_received = self.client.last_received = time.monotonic()
        if self.closed:  # a late delivery after abort: it landed in scratch; drop it
            return
        try:
            events = self.parser.received(nbytes)
        except Transient as exc:  # what a request's own check refused
            self._fail(exc)
            self.abort()
            return
        except ResponseError as exc:
            self._fail(Transient(str(exc), Failure.BAD_ANSWER))
            self.abort()
            return
        except ValueError as exc:  # the body's own format (FrameError)
            self._fail(Transient(f"upstream sent a bad body: {exc}", Failure.BAD_ANSWER))
            self.abort()
            return
        for ev in events:
            if type(ev) is BodyBytes:
                if self._progress is not None:
                    self._progress(ev.n)
                continue
            self.keep_alive = ev.keep_alive
            waiter, self._waiter = self._waiter, None
            self._progress = None
            if waiter is not None and not waiter.done():
                waiter.set_result(ev.head)

    # -- request state ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self._progress = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, request: bytes, sink_for: SinkFor,
              progress: Callable[[int], None] | None) -> asyncio.Future[Head]:
        assert self.transport is not None and self._waiter is None and self.parser.idle
        self._waiter = asyncio.get_running_loop().create_future()
        self.parser.expect(sink_for)
        self._progress = progress
        self.received_any = False
        self.transport.write(request)
        return self._waiter

    def abort(self) -> None:
        # abort, not close: stop reading at once, and forget where bodies go, so no late
        # byte lands in a buffer whose owner has moved on. A request still waiting here was
        # given up by its caller.
        self.closed = True
        self.parser.close()
        waiter, self._waiter = self._waiter, None
        self._progress = None
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if self.transport is not None:
            self.transport.abort()


@dataclass(frozen=True)
class Patience:
    """For a request whose server may stay silent while it works for it (a tier member
    fetching the blocks from its own upstream): ``ahead`` seconds before ``idle_timeout``
    runs out, ``alive()`` is asked (it answers within ``ahead``), and True (the server
    answers something else) lets the request wait another ``idle_timeout``, up to ``limit``
    seconds from its start; False fails it at once. A server that is gone is thus given up
    on no later than without patience."""

    alive: Callable[[], Awaitable[bool]]
    limit: float
    ahead: float
    # Asked at the same moment, first: True ends the request with ``Superseded`` (what it
    # waits for is now wanted another way: the caller asks again).
    superseded: Callable[[], bool] | None = None


class Superseded(Exception):
    """A patient request given up because ``Patience.superseded`` said so; the connection is
    dropped, the frames delivered before it stand."""


class DataClient:
    """Ranged GETs and batch reads over a pool of kept-alive connections to one upstream.

    ``idle_timeout``: a request whose connection brings no byte for this long fails
    (``Transient``): a stalled link must not hold a slot forever. With ``idle_any``, only
    while no connection of the pool brings a byte (a server that answers a batch once all of
    it is ready, and is answering other requests meanwhile, is busy, not gone: tier members).
    A batch read with ``patience`` (``Patience``) asks before it gives up. A request's
    ``progress(n)`` hears each piece of its body as it arrives (the spoke's link model counts
    them).
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
                        progress: Callable[[int], None] | None = None,
                        etag: str | None = None) -> tuple[int, Head]:
        """GET ``path`` bytes [start, start+len(buf)) into ``buf``; (count received, head).
        The count is less than len(buf) only at the end of the object. ``etag``: the
        version the answer must name (``ETag: "<version>"``, docs/protocol.md); an answer
        naming another is refused before a byte of it reaches ``buf``."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                   f"Range: bytes={start}-{start + len(buf) - 1}\r\n{extra}{self._auth}"
                   "Accept-Encoding: identity\r\n\r\n").encode()
        sinks: list[IntoBuffer] = []

        def sink_for(head: Head) -> Sink:
            check_range_answer(head, start, len(buf))
            if etag is not None and head.headers.get("etag") != f'"{etag}"':
                raise ResponseError(f"upstream answered ETag {head.headers.get('etag')!r} "
                                    f"for version {etag}")
            sinks.append(IntoBuffer(buf))
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
                          headers: dict[str, str] | None = None,
                          patience: Patience | None = None) -> int:
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

        head = await self._exchange(request, sink_for, path, progress, patience)
        if not 200 <= head.status < 300:
            raise_for_status(head.status, head.body, path)
        if not readers[0].between_frames:
            raise Transient("upstream's batch body ended inside a frame", Failure.CLOSED)
        return readers[0].frames

    # -- the pool ------------------------------------------------------------------------------
    async def _exchange(self, request: bytes, sink_for: SinkFor, what: str,
                        progress: Callable[[int], None] | None = None,
                        patience: Patience | None = None) -> Head:
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
                                            what, patience)
                except Transient:
                    self._discard(conn)
                    if reused and not conn.received_any:
                        continue
                    raise
                except BaseException:  # cancelled: the connection is mid-response
                    self._discard(conn)
                    raise
                if conn.keep_alive and not conn.closed and conn.parser.idle:
                    self._idle.append(conn)
                else:
                    self._discard(conn)
                return head
        raise AssertionError("unreachable")

    async def _wait(self, conn: _Connection, fut: asyncio.Future[Head], what: str,
                    patience: Patience | None = None) -> Head:
        """The response, unless the connection stays silent for ``idle_timeout`` (and, with
        ``patience``, its server does not answer when asked)."""
        began = conn.last_received = vouched = time.monotonic()
        while True:
            heard = max(conn.last_received, self.last_received) if self.idle_any \
                else conn.last_received
            left = max(heard, vouched) + self.idle_timeout - time.monotonic()
            if patience is not None and left <= patience.ahead:
                if patience.superseded is not None and patience.superseded():
                    conn.abort()
                    raise Superseded(what)
                if time.monotonic() - began < patience.limit and await patience.alive():
                    vouched = time.monotonic()
                    continue
                left = 0.0  # it does not answer (or was waited for long enough)
            if fut.done():  # it came while the server was asked
                return fut.result()
            if left <= 0:
                conn.abort()
                raise Transient(f"no byte from upstream for {self.idle_timeout:g}s ({what})",
                                Failure.NO_ANSWER)
            done, _ = await asyncio.wait(
                {fut}, timeout=left if patience is None else left - patience.ahead)
            if done:
                return fut.result()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._tls,
                    server_hostname=self.host if self._tls is not None else None)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else
                      str(exc) or type(exc).__name__)
            raise error_for_transport(exc, f"{self.host}:{self.port}",
                                      f"cannot connect to {self.host}:{self.port}: {reason}"
                                      ) from exc
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
