"""HTTP/1.1 responses taken apart as they arrive, for the data client (``wire.http1``).

Sans-I/O, like ``wire.frames``: bytes in, events out; no socket, no event loop, so every
rule is tested at every split of the byte stream (tests/test_h1.py). Bytes reach the parser
either way:

- ``feed(data)``: a chunk received elsewhere, copied where it belongs;
- ``buffer()`` then ``received(n)``: the caller receives straight into the buffer the parser
  hands out (``asyncio.BufferedProtocol``): a large body's bytes land in their destination
  (the sink's own buffer, e.g. the caller's), small pieces in the parser's scratch buffer.

Each request sent is announced first (``expect(sink_for)``, in order; the data client sends
one at a time). When its response's head is complete, ``sink_for(head)`` says where a 2xx
body goes (a ``Sink``), or raises to refuse the answer (a range answer for another range);
the body of any other status is kept whole, up to ``MAX_ERROR_BODY``. What is refused:

- a head over ``HEAD_MAX`` bytes, a status line that is not HTTP/1.x, a chunked body, no
  Content-Length (the data path needs to know where the body ends);
- a non-2xx answer claiming more than ``MAX_ERROR_BODY`` bytes (refused at its head);
- bytes nobody asked for: after the last response expected, the stream is out of step.

Every refusal is a ``ResponseError`` (a ValueError) and leaves the parser broken: the
connection must go. A sink's own error (``FrameError``, or what ``sink_for`` raises) passes
through, and breaks it too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from spokefs.wire.ranges import ascii_digits

SCRATCH = 256 * 1024      # one receive of small pieces (and of a head)
DIRECT_MIN = 64 * 1024    # a payload piece at least this large is received in place
HEAD_MAX = 64 * 1024
MAX_ERROR_BODY = 1 << 20  # bytes of a non-2xx answer's body (JSON errors are a few hundred)


class ResponseError(ValueError):
    """The byte stream is not the responses expected: the connection cannot be used."""


class OutOfStep(ResponseError):
    """Bytes nobody asked for (after every expected response, or past a body's end)."""


class Sink(Protocol):
    """Where a 2xx response body goes."""

    def direct(self) -> memoryview | None: ...   # a large destination to receive into
    def advance(self, n: int) -> None: ...         # n bytes were received into direct()
    def feed(self, data: memoryview) -> None: ...  # a piece received elsewhere
    def scratch_limit(self) -> int | None: ...     # most bytes for scratch now (None: any)


class Head:
    __slots__ = ("body", "headers", "length", "status")

    def __init__(self, status: int, headers: dict[str, str], length: int) -> None:
        self.status = status
        self.headers = headers  # names lower-cased; a repeated name keeps its last value
        self.length = length    # Content-Length
        self.body = b""         # the whole body of a non-2xx answer, once complete


SinkFor = Callable[[Head], Sink]


@dataclass(frozen=True, slots=True)
class BodyBytes:
    """``n`` bytes of the current response's body were delivered (progress)."""

    n: int


@dataclass(frozen=True, slots=True)
class Complete:
    """A response is complete; ``keep_alive``: the connection may carry the next request."""

    head: Head
    keep_alive: bool


Event = BodyBytes | Complete


class IntoBuffer:
    """A body into the caller's buffer (a ranged read)."""

    __slots__ = ("got", "target")

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

    def scratch_limit(self) -> int | None:
        return None


class _Collect(IntoBuffer):
    """A non-2xx body, kept whole (bounded by the head's check)."""

    def __init__(self, length: int) -> None:
        super().__init__(memoryview(bytearray(length)))


def range_start(head: Head) -> int | None:
    """The first byte a 206 answer holds, from its ``Content-Range: bytes A-B/N``."""
    unit, _, rest = head.headers.get("content-range", "").partition(" ")
    first = rest.partition("-")[0]
    return int(first) if unit == "bytes" and ascii_digits(first, 20) else None


def check_range_answer(head: Head, start: int, length: int) -> None:
    """Refuse (``ResponseError``) a 2xx answer to ``Range: bytes=start-(start+length-1)``
    that holds other bytes than those asked for: a 200 (the whole object) for a read that
    does not begin at 0, a 206 whose Content-Range begins elsewhere, more bytes than asked."""
    if head.status == 200 and start != 0:
        raise ResponseError("upstream ignored the Range header")
    if head.status == 206 and range_start(head) != start:
        # Bytes of another range are other bytes: never taken as these.
        raise ResponseError(f"upstream answered {head.headers.get('content-range')!r} "
                            f"for a read at {start}")
    if head.length > length:
        raise ResponseError(f"upstream sent {head.length} bytes for a {length}-byte range")


def parse_head(raw: bytes) -> tuple[Head, bool]:
    """A response head (without its final blank line); (head, keep_alive)."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not ascii_digits(parts[1], 3):
        raise ResponseError(f"upstream sent a bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "identity").lower() != "identity":
        raise ResponseError("upstream sent a chunked body where a length was expected")
    length = headers.get("content-length")
    if length is None or not ascii_digits(length, 19):
        raise ResponseError("upstream response has no Content-Length")
    head = Head(int(parts[1]), headers, int(length))
    if not 200 <= head.status < 300 and head.length > MAX_ERROR_BODY:
        # The sender names the length: an error answer is never buffered at any size.
        raise ResponseError(f"upstream answered {head.status} with a body of {head.length} "
                            f"bytes, more than the {MAX_ERROR_BODY} an error answer may hold")
    keep_alive = headers.get("connection", "").lower() != "close" and parts[0] != "HTTP/1.0"
    return head, keep_alive


class ResponseParser:
    """The responses of one connection, in the order their requests were sent."""

    def __init__(self) -> None:
        self._scratch = bytearray(SCRATCH)
        self._view = memoryview(self._scratch)
        self._expected: deque[SinkFor] = deque()
        self._head_len = 0            # head bytes gathered at the start of scratch
        self._head: Head | None = None
        self._sink: Sink | None = None
        self._keep_alive = True
        self._left = 0                # body bytes still to come
        self._direct = False          # the last buffer handed out was the sink's own
        self.broken = False

    @property
    def idle(self) -> bool:
        """No response expected or under way."""
        return not self._expected and self._sink is None

    def expect(self, sink_for: SinkFor) -> None:
        """A request was sent: its response comes after those expected before it."""
        self._check()
        self._expected.append(sink_for)

    def close(self) -> None:
        """The connection is given up: no sink is known from now on, so a byte that still
        arrives (a transport's late delivery) can only land in scratch, and is refused."""
        self.broken = True
        self._expected.clear()
        self._sink = self._head = None
        self._head_len = 0

    # -- receiving in place ---------------------------------------------------------------------
    def buffer(self) -> memoryview:
        """Where the next bytes should be received (then ``received(n)``): in a body, the
        sink's destination (never past the body's end) or scratch; else the rest of
        scratch, after the head gathered so far. Once broken, scratch only."""
        self._direct = False
        if self.broken:
            return self._view
        if self._sink is not None:
            d = self._sink.direct()
            if d is not None and len(d) > 0:
                self._direct = True
                return d[:self._left] if len(d) > self._left else d
            limit = self._sink.scratch_limit()
            return self._view[:min(SCRATCH, self._left, limit or SCRATCH)]
        return self._view[self._head_len:]

    def received(self, n: int) -> list[Event]:
        """``n`` bytes were received into the last ``buffer()``."""
        self._check()
        try:
            if self._sink is not None:
                if self._direct:
                    self._sink.advance(n)
                else:
                    self._sink.feed(self._view[:n])
                return self._body_done(n, [])
            start = self._head_len
            self._head_len += n
            return self._after_head_bytes(start, [])
        except BaseException:
            self.broken = True
            raise

    # -- receiving elsewhere ---------------------------------------------------------------------
    def feed(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes received elsewhere, copied where they belong."""
        self._check()
        events: list[Event] = []
        view = memoryview(data)
        try:
            while len(view):
                if self._sink is not None:
                    take = min(self._left, len(view))
                    self._sink.feed(view[:take])
                    view = view[take:]
                    self._body_done(take, events)
                    continue
                if not self._expected:
                    raise OutOfStep("upstream sent bytes nobody asked for")
                take = min(len(view), len(self._scratch) - self._head_len)
                start = self._head_len
                self._scratch[start:start + take] = view[:take]
                self._head_len += take
                view = view[take:]
                # What the head did not use went on into the body (or the next response).
                self._after_head_bytes(start, events)
        except BaseException:
            self.broken = True
            raise
        return events

    # -- the state machine -------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken:
            raise ResponseError("the response stream already failed")

    def _after_head_bytes(self, start: int, events: list[Event]) -> list[Event]:
        """Head bytes gathered in scratch up to ``_head_len``, new ones from ``start``."""
        if not self._expected:
            raise OutOfStep("upstream sent bytes nobody asked for")
        end = self._scratch.find(b"\r\n\r\n", max(0, start - 3), self._head_len)
        if end > HEAD_MAX or (end < 0 and self._head_len >= HEAD_MAX):
            raise ResponseError("upstream sent an oversized response head")
        if end < 0:
            return events
        head, keep_alive = parse_head(bytes(self._scratch[:end]))
        sink_for = self._expected.popleft()
        self._head, self._keep_alive, self._left = head, keep_alive, head.length
        self._sink = sink_for(head) if 200 <= head.status < 300 else _Collect(head.length)
        rest_at, rest_end = end + 4, self._head_len
        self._head_len = 0
        if self._left == 0:
            self._complete(events)
        elif rest_end > rest_at:
            take = min(self._left, rest_end - rest_at)
            self._sink.feed(self._view[rest_at:rest_at + take])
            rest_at += take
            self._body_done(take, events)
        if rest_end > rest_at:  # bytes past this response: the next one's (pipelined)
            rest = bytes(self._scratch[rest_at:rest_end])
            events.extend(self.feed(rest))
        return events

    def _body_done(self, n: int, events: list[Event]) -> list[Event]:
        self._left -= n
        events.append(BodyBytes(n))
        if self._left == 0:
            self._complete(events)
        return events

    def _complete(self, events: list[Event]) -> None:
        head = self._head
        assert head is not None
        if isinstance(self._sink, _Collect):
            head.body = bytes(self._sink.target)
        self._sink = self._head = None
        events.append(Complete(head, self._keep_alive))
