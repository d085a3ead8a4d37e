"""HTTP Range header maths (sans-I/O): one byte range per request, as RFC 9110 allows."""

from __future__ import annotations

from spokefs.errors import BadRequest, RangeNotSatisfiable


def ascii_digits(text: str, most: int = 20) -> bool:
    """Only ASCII digits, 1 to ``most`` of them. ``str.isdigit`` alone also takes '\u00b2'
    and other scripts' digits (what a latin-1 decode of a hostile header can give), which
    ``int`` then refuses or reads as other numbers."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Half-open [start, end) that ``header`` asks of a ``size``-byte file; None = whole file.

    Raises BadRequest for a malformed header or several ranges, RangeNotSatisfiable for a range
    that starts past the end (or any range of an empty file).
    """
    if header is None:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or not spec:
        raise BadRequest(f"malformed Range header {header!r}: expected 'bytes=START-END'")
    if "," in spec:
        raise BadRequest("multiple ranges in one request are not supported; send one per request")
    first, dash, last = spec.strip().partition("-")
    if not dash or not all(ascii_digits(x) or x == "" for x in (first, last)):
        raise BadRequest(f"malformed Range header {header!r}")
    if first == "":
        if last == "":
            raise BadRequest(f"malformed Range header {header!r}")
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range {header!r} of a {size}-byte file", size)
        return max(0, size - n), size
    start = int(first)
    end = size if last == "" else int(last) + 1
    if last != "" and end <= start:
        raise BadRequest(f"malformed Range header {header!r}: end before start")
    if start >= size:
        raise RangeNotSatisfiable(
            f"range starts at byte {start} but the file has {size} bytes", size)
    return start, min(end, size)
