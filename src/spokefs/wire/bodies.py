"""Reading a request's JSON body: the one reader behind every route that takes one (the
spoke's control routes, batch reads, a replica's forwarded requests, the link emulator's
control port).

The body is read against a bound as it streams in, and JSON that comes gzip'd or zlib'd is
inflated against the same bound, so neither a large body nor a compression bomb grows the
server past it (413). What the JSON parses to is bounded too, before it is parsed: a body of
``[{},{},...]`` takes ~24 times its size as Python objects, so the parse's cost is estimated
from the body's separators (``parsed_cost``) and a body past ``MAX_PARSED`` is a 413. What is
not JSON is a 400 saying why; an empty body is ``{}``.
"""

from __future__ import annotations

import asyncio
import json
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from spokefs.errors import BadRequest, TooLarge

MAX_BODY = 64 << 20  # bytes of a control request's JSON, after any inflating
_MEMBERS = 64        # gzip members concatenated in one body (a client sends one)
_PIECE = 1 << 20     # bytes inflated per zlib call: no second copy of a large body
MAX_PARSED = 256 << 20  # bytes of Python objects one request's JSON may parse to (estimated)
# Bytes one JSON value costs at most once parsed, with its slot in its container (measured on
# CPython 3.11: an object holding a key and a value, 64; a list of two large ints, 51; unique
# short strings, 64); a string's characters are counted apart, by the body's length.
_PER_VALUE = 72
_OFF_LOOP = 256 << 10  # bodies this large are decoded off the event loop


async def read_body(request: web.Request, limit: int = MAX_BODY) -> bytearray:
    """The body, at most ``limit`` bytes (else TooLarge; BadRequest if it cannot be read).
    aiohttp inflates a ``Content-Encoding`` body as it streams in, a bounded piece at a time;
    reading it piece by piece here (not with ``request.read()``, bounded only by the app's
    ``client_max_size``, which it raises aiohttp's buffers to) stops a gzip bomb at the
    bound, whatever that setting is. (Nor with one ``content.read(n)``: that returns what has
    arrived so far, and a body in several pieces would be cut.)"""
    if (request.content_length or 0) > limit:
        raise TooLarge(f"a request body is at most {limit >> 20} MiB, not "
                       f"{request.content_length:,} bytes")
    body = bytearray()
    try:
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > limit:
                raise TooLarge(f"a request body is at most {limit >> 20} MiB "
                               "(after inflating)")
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # A Content-Encoding body that does not inflate (a broken transfer encoding too).
        raise BadRequest(f"request body cannot be read: {' '.join(str(exc).split())}"
                         ) from exc
    return body


def _inflate(raw: bytes | bytearray, wbits: int, limit: int = MAX_BODY) -> bytearray:
    """A compressed body aiohttp left as it came (gzip'd JSON sent without
    ``Content-Encoding``, or any when the server does not inflate bodies itself), inflated to
    at most ``limit`` bytes: zlib's ``max_length`` hands out a piece at a time, so a bomb
    costs ``limit`` bytes and the work to make them, not what it would expand to."""
    out = bytearray()
    data: bytes | bytearray = raw
    for _ in range(_MEMBERS):
        d = zlib.decompressobj(wbits=wbits)
        try:
            while not d.eof:
                piece = d.decompress(data, _PIECE)
                data = d.unconsumed_tail
                out += piece
                if len(out) > limit:
                    raise TooLarge(f"a request body is at most {limit >> 20} MiB "
                                   "(after inflating)")
                if not piece and not data:
                    break  # no input left and no output held back: it ends early
        except zlib.error as exc:
            raise BadRequest(f"request body is not valid gzip or zlib data: {exc}") from exc
        if not d.eof:
            raise BadRequest("request body is not valid gzip or zlib data: it ends early")
        data = d.unused_data
        if not data:
            return out
    raise BadRequest(f"request body has more than {_MEMBERS} compressed members")


def parsed_cost(raw: bytes | bytearray) -> int:
    """An upper estimate of the bytes ``json.loads(raw)`` makes: every value after a
    container's first follows a ``,``, every container opens with ``[`` or ``{``, and every
    member of an object follows a ``:``; four passes in C, no parse."""
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + raw.count(b":") + 1
    return _PER_VALUE * values + len(raw)


def decode_json(raw: bytes | bytearray, limit: int = MAX_BODY,
                max_parsed: int = MAX_PARSED) -> object:
    """A body (JSON, gzip'd or zlib'd JSON) as the JSON value it holds; {} when empty. The
    compressed forms are told by their first bytes, which JSON never starts with. TooLarge
    when it would parse to more than ``max_parsed`` bytes (``parsed_cost``)."""
    if raw[:2] == b"\x1f\x8b":
        raw = _inflate(raw, 31, limit)  # 16 + 15: a gzip header and trailer
    elif len(raw) >= 2 and raw[0] == 0x78 and (raw[0] << 8 | raw[1]) % 31 == 0:
        raw = _inflate(raw, 15, limit)  # a zlib header (Content-Encoding: deflate)
    if not raw.strip():
        return {}
    cost = parsed_cost(raw)
    if cost > max_parsed:
        raise TooLarge(f"a request's JSON may parse to at most {max_parsed >> 20} MiB; this "
                       f"one holds about {cost >> 20} MiB of values: send fewer entries")
    try:
        return json.loads(raw)
    except RecursionError as exc:  # nesting deeper than the parser's stack
        raise BadRequest("request body is not JSON: nested too deeply") from exc
    except ValueError as exc:  # also UnicodeDecodeError and too-long integers
        raise BadRequest(f"request body is not JSON: {exc}") from exc


async def json_body(request: web.Request, limit: int = MAX_BODY) -> object:
    """``decode_json(read_body(request))``: the JSON value a request's body holds. A large
    body is decoded in a thread: inflating one (up to ``limit``, ~0.1 s for a bomb) runs
    without the GIL there, so the event loop goes on answering reads meanwhile."""
    raw = await read_body(request, limit)
    if len(raw) >= _OFF_LOOP:
        return await asyncio.to_thread(decode_json, raw, limit)
    return decode_json(raw, limit)
