"""The data client's HTTP/1.1 response parser (``spokefs.wire.h1``), sans-I/O: responses back
to back on one kept-alive connection, split at every point, through both ways bytes reach
it (copied in with ``feed``, received in place with ``buffer``/``received``), and every rule
it enforces. The data client that drives it is tested against real servers in
tests/test_client.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spokefs.wire.h1 import (
    HEAD_MAX,
    MAX_ERROR_BODY,
    SCRATCH,
    BodyBytes,
    Complete,
    Head,
    IntoBuffer,
    OutOfStep,
    ResponseError,
    ResponseParser,
    check_range_answer,
)

SETTINGS = settings(deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Answer:
    status: int
    body: bytes
    extra: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False

    def encode(self) -> bytes:
        lines = [f"HTTP/1.1 {self.status} Whatever", f"Content-Length: {len(self.body)}",
                 *(f"{k}: {v}" for k, v in self.extra)]
        if self.close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


bodies = st.one_of(st.binary(max_size=300), st.integers(0, 3 * SCRATCH).map(
    lambda n: bytes(i % 251 for i in range(n))))
answers = st.builds(
    Answer, st.sampled_from([200, 206, 206, 404, 416, 503]), bodies,
    st.lists(st.tuples(st.sampled_from(["ETag", "X-A", "content-range", "Server"]),
                       st.text("abc 0123-/\"", max_size=20)), max_size=3),
    st.booleans())


class Receiver:
    """Expects ``answers`` in order, each 2xx body into a buffer of its own, and records the
    events."""

    def __init__(self, answers: list[Answer]) -> None:
        self.parser = ResponseParser()
        self.targets = [bytearray(len(a.body)) for a in answers]
        self.heads: list[Head] = []
        self.progress = 0
        self.keep_alive: list[bool] = []
        for i in range(len(answers)):
            self.parser.expect(lambda head, i=i: IntoBuffer(memoryview(self.targets[i])))

    def take(self, events: list[BodyBytes | Complete]) -> None:
        for ev in events:
            if isinstance(ev, BodyBytes):
                self.progress += ev.n
            else:
                self.heads.append(ev.head)
                self.keep_alive.append(ev.keep_alive)

    def check(self, answers: list[Answer]) -> None:
        assert len(self.heads) == len(answers)
        for a, head, target, alive in zip(answers, self.heads, self.targets, self.keep_alive,
                                          strict=True):
            assert head.status == a.status and head.length == len(a.body)
            if 200 <= a.status < 300:
                assert bytes(target) == a.body and head.body == b""
            else:
                assert head.body == a.body
            assert alive == (not a.close)
        assert self.progress == sum(len(a.body) for a in answers)
        assert self.parser.idle


def cuts(stream: bytes, points: list[int]) -> list[bytes]:
    at = sorted({p % (len(stream) + 1) for p in points} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(at)]


@SETTINGS
@given(st.lists(answers, min_size=1, max_size=4), st.lists(st.integers(0, 10**7), max_size=12))
def test_responses_back_to_back_survive_any_split_fed(answers: list[Answer],
                                                      points: list[int]) -> None:
    stream = b"".join(a.encode() for a in answers)
    r = Receiver(answers)
    for piece in cuts(stream, points):
        r.take(r.parser.feed(piece))
    r.check(answers)


@SETTINGS
@given(st.lists(answers, min_size=1, max_size=4), st.lists(st.integers(1, 10**6), min_size=1,
                                                           max_size=12))
def test_responses_back_to_back_survive_any_split_received_in_place(
        answers: list[Answer], sizes: list[int]) -> None:
    """As a BufferedProtocol receives: into whatever ``buffer()`` hands out, as much as the
    transport has (the sizes, cycled), never more than the buffer holds."""
    stream = memoryview(b"".join(a.encode() for a in answers))
    r = Receiver(answers)
    pos, i = 0, 0
    while pos < len(stream):
        buf = r.parser.buffer()
        n = min(len(buf), sizes[i % len(sizes)], len(stream) - pos)
        i += 1
        assert n > 0
        buf[:n] = stream[pos:pos + n]
        pos += n
        r.take(r.parser.received(n))
    r.check(answers)


def test_a_large_body_is_received_straight_into_the_callers_buffer() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB
    target = bytearray(len(body))
    parser = ResponseParser()
    parser.expect(lambda head: IntoBuffer(memoryview(target)))
    head = Answer(206, body, [("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")]
                  ).encode()[:-len(body)]
    stream = memoryview(head + body)
    buf = parser.buffer()
    buf[:len(head) + 10] = stream[:len(head) + 10]  # the head and a little of the body
    assert parser.received(len(head) + 10) == [BodyBytes(10)]
    pos, direct = len(head) + 10, 0
    while pos < len(stream):
        buf = parser.buffer()
        assert buf.obj is target  # the caller's own buffer: no copy
        direct += 1
        n = min(len(buf), 300_000)
        buf[:n] = stream[pos:pos + n]
        pos += n
        events = parser.received(n)
    assert isinstance(events[-1], Complete) and bytes(target) == body and direct == 4
    assert parser.idle and parser.buffer().obj is not target


# -- what is refused, at any split ------------------------------------------------------------
def _refused(stream: bytes, points: list[int], expected: int = 1,
             sink_for: object = None) -> ResponseError:
    parser = ResponseParser()
    for _ in range(expected):
        parser.expect(sink_for or (lambda head: IntoBuffer(memoryview(bytearray(head.length)))))
    with pytest.raises(ResponseError) as err:
        for piece in cuts(stream, points):
            parser.feed(piece)
    with pytest.raises(ResponseError, match="already failed"):  # broken for good
        parser.feed(b"HTTP/1.1 200 OK\r\n")
    assert parser.broken
    return err.value


splits = st.lists(st.integers(0, 10**6), max_size=6)


@SETTINGS
@given(splits)
def test_head_rules(points: list[int]) -> None:
    assert "chunked" in str(_refused(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", points))
    assert "no Content-Length" in str(_refused(b"HTTP/1.1 200 OK\r\nX: y\r\n\r\nhello", points))
    assert "no Content-Length" in str(_refused(
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", points))
    assert "bad status line" in str(_refused(b"SPKB\x00\x00\x00\x01garbage\r\n\r\n", points))
    assert "oversized response head" in str(_refused(
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * HEAD_MAX + b"\r\n\r\n", points))
    big = MAX_ERROR_BODY + 1
    assert f"more than the {MAX_ERROR_BODY}" in str(_refused(
        f"HTTP/1.1 500 Oops\r\nContent-Length: {big}\r\n\r\n{{".encode(), points))


@SETTINGS
@given(answers, st.binary(min_size=1, max_size=50), splits)
def test_bytes_nobody_asked_for_are_refused(answer: Answer, extra: bytes,
                                            points: list[int]) -> None:
    """After the last response expected (a body longer than its Content-Length, a response
    nobody asked for), the stream is out of step, however the bytes are split."""
    err = _refused(answer.encode() + extra, points)
    assert isinstance(err, OutOfStep)


def test_bytes_before_any_request_are_refused() -> None:
    parser = ResponseParser()
    with pytest.raises(OutOfStep):
        parser.received(len(parser.buffer()[:5]))


def _range_sink(start: int, length: int) -> Callable[[Head], IntoBuffer]:
    def sink_for(head: Head) -> IntoBuffer:
        check_range_answer(head, start, length)
        return IntoBuffer(memoryview(bytearray(length)))
    return sink_for


@SETTINGS
@given(splits)
def test_an_answer_for_other_bytes_is_refused_at_its_head(points: list[int]) -> None:
    """A range read takes only the bytes it asked for: a 206 for a range that starts
    elsewhere, a 200 (the whole object) for a read past 0, more bytes than asked."""
    other = Answer(206, b"x" * 10, [("Content-Range", "bytes 100-109/1000")]).encode()
    assert "for a read at 0" in str(_refused(other, points, sink_for=_range_sink(0, 10)))
    whole = Answer(200, b"x" * 10).encode()
    assert "ignored the Range" in str(_refused(whole, points, sink_for=_range_sink(5, 10)))
    more = Answer(206, b"x" * 11, [("Content-Range", "bytes 0-10/1000")]).encode()
    assert "11 bytes for a 10-byte range" in str(
        _refused(more, points, sink_for=_range_sink(0, 10)))
    # The right one passes, and a 200 is the whole object read from 0.
    for ok, start in ((Answer(206, b"y" * 10, [("Content-Range", "bytes 7-16/1000")]), 7),
                      (Answer(200, b"y" * 10), 0)):
        parser = ResponseParser()
        parser.expect(_range_sink(start, 10))
        events = [ev for piece in cuts(ok.encode(), points) for ev in parser.feed(piece)]
        assert isinstance(events[-1], Complete) and events[-1].head.status == ok.status


def test_a_closed_parser_never_hands_out_a_callers_buffer() -> None:
    """Once the connection is given up, a byte a transport still delivers (a late one, after
    abort) can only land in scratch: the parser no longer knows the caller's buffer."""
    target = bytearray(1 << 20)
    parser = ResponseParser()
    parser.expect(lambda head: IntoBuffer(memoryview(target)))
    parser.feed(Answer(206, b"", [("Content-Range", "bytes 0-1048575/2000000")]
                       ).encode().replace(b"Length: 0", b"Length: 1048576"))
    assert parser.buffer().obj is target  # mid-body: bytes go to the caller
    parser.close()
    late = parser.buffer()
    assert late.obj is not target
    late[:3] = b"bad"
    with pytest.raises(ResponseError):
        parser.received(3)
    assert target == bytearray(1 << 20)


def test_after_a_large_frame_the_next_is_received_straight_into_its_destination() -> None:
    """A batch body of 128 KiB frames, each read as a transport would (as much as the
    buffer handed out holds): after the first frame, scratch takes only the next header, so
    each payload lands in its destination without a copy out of scratch."""
    from spokefs.wire.frames import FrameReader, encode_header
    from spokefs.wire.http1 import _Frames

    n, size = 6, 128 * 1024
    payloads = [bytes([i]) * size for i in range(n)]
    body = b"".join(encode_header(i, 200, size) + p for i, p in enumerate(payloads))
    dests = [bytearray(size) for _ in range(n)]
    got: list[int] = []
    reader = FrameReader(lambda h: memoryview(dests[h.seq]), lambda h, _: got.append(h.seq))
    parser = ResponseParser()
    parser.expect(lambda head: _Frames(reader))
    stream = memoryview(Answer(200, body).encode())
    pos, in_place, receives = 0, 0, 0
    while pos < len(stream):
        buf = parser.buffer()
        k = min(len(buf), len(stream) - pos)
        buf[:k] = stream[pos:pos + k]
        pos += k
        receives += 1
        if any(buf.obj is d for d in dests):
            in_place += k
        parser.received(k)
    assert got == list(range(n)) and [bytes(d) for d in dests] == payloads
    # The first receive (the head's, into scratch) took the first frame and most of the
    # second (its rest came with the third header); every payload after is received in
    # place, each header before it on its own.
    assert in_place == (n - 2) * size and receives == 1 + 2 * (n - 2)
