"""The checked reads of cached blocks (``cache.store.read_loc`` / ``read_loc_into``, native
since the Rust core) against the Python loops they replaced, kept here as the reference:
same bytes for every alignment, same None/False for damaged, stale (zeroed, freed), short and
unreadable regions, and the native seam's own contract (buffers, errors, the GIL)."""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from spokefs import _native
from spokefs.cache.segments import Segment, punch_hole
from spokefs.cache.shared import SharedCache
from spokefs.cache.store import chunk_digests, read_loc, read_loc_into

CHUNK = 4096
AT = 3 * 4096  # where the block starts in its segment file


# -- the reference: the Python loops as they were before the native core ---------------------

def ref_chunk_digests(data: bytes, chunk: int) -> bytes:
    d = xxhash.xxh3_64_digest
    return b"".join(d(data[i:i + chunk]) for i in range(0, len(data), chunk)) if data else b""


def ref_read_loc(loc: Loc, lo: int, hi: int, chunk: int) -> bytes | None:
    if hi <= lo:
        return b""
    a = lo - lo % chunk
    b = min(loc.size, hi + (-hi % chunk))
    buf = memoryview(bytearray(b - a))
    try:
        if loc.seg.read(loc.offset + a, buf) != b - a:
            return None
    except OSError:
        return None
    d, want = xxhash.xxh3_64_digest, loc.chunks
    for c in range(a // chunk, (b - 1) // chunk + 1):
        at = c * chunk - a
        if d(buf[at:at + chunk]) != want[8 * c:8 * c + 8]:
            return None
    return bytes(buf[lo - a:hi - a])


@dataclass
class Loc:
    """The fields ``read_loc`` uses (``cache.store.Loc``, ``cache.shared.SharedLoc``)."""

    seg: Segment
    offset: int
    size: int
    chunks: bytes


def data_of(size: int, seed: int = 1) -> bytes:
    return bytes((i * 131 + seed * 7 + i // 977) % 256 for i in range(size))


@pytest.fixture
def segfile(tmp_path: Path):
    """A segment file holding a block (3 chunks and a short one) after other bytes; the
    block's location, its bytes; the segment's descriptor is closed at the end."""
    made: list[Segment] = []

    def make(data: bytes, name: str = "00000001.seg") -> tuple[Loc, bytes]:
        path = tmp_path / name
        path.write_bytes(data_of(AT, 99) + data + data_of(5000, 98))
        seg = Segment(1, path, os.open(path, os.O_RDWR), AT + len(data) + 5000)
        made.append(seg)
        return Loc(seg, AT, len(data), ref_chunk_digests(data, CHUNK)), data

    yield make
    for seg in made:
        try:
            seg.close()
        except OSError:
            pass


BLOCK = 3 * CHUNK + 777
EDGES = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5, 3 * CHUNK, 3 * CHUNK + 1,
         BLOCK - 1, BLOCK]


# -- digests --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 777, 70_000, 300_000])
def test_chunk_digests_match_python_xxhash(size: int) -> None:
    data = data_of(size)
    for chunk in (4096, 65_536, 256 * 1024):
        want = ref_chunk_digests(data, chunk)
        assert chunk_digests(data, chunk) == want
        assert chunk_digests(bytearray(data), chunk) == want
        assert chunk_digests(memoryview(data), chunk) == want
    if size > 10:  # a view that starts anywhere
        assert chunk_digests(memoryview(bytearray(data))[3:], 4096) == ref_chunk_digests(
            data[3:], 4096)
        with mmap.mmap(-1, size + 100) as m:  # the fetcher's receive buffers
            m[7:7 + size] = data
            assert chunk_digests(memoryview(m)[7:7 + size], 4096) == ref_chunk_digests(
                data, 4096)


@pytest.mark.parametrize("size", [0, 1, 16, 17, 128, 129, 240, 241, 1024, 65_536, 300_001])
def test_the_native_block_digest_is_python_xxhash_xxh3_128(size: int) -> None:
    data = data_of(size)
    assert _native.block_digest(data) == xxhash.xxh3_128_digest(data)
    assert _native.block_digest(memoryview(bytearray(data))) == xxhash.xxh3_128_digest(data)


def test_chunk_digests_refuse_a_zero_chunk_and_non_buffers() -> None:
    with pytest.raises(ValueError, match="chunk size"):
        chunk_digests(b"abc", 0)
    with pytest.raises(TypeError):
        chunk_digests("abc", 4096)  # type: ignore[arg-type]
    with pytest.raises(BufferError, match="contiguous"):
        chunk_digests(memoryview(b"abcdef")[::2], 4096)


# -- same bytes as the reference, every alignment ---------------------------------------------

def test_every_lo_hi_alignment_reads_the_reference_bytes(segfile) -> None:
    loc, data = segfile(data_of(BLOCK))
    assert chunk_digests(data, CHUNK) == loc.chunks
    scratch = bytearray(BLOCK + 2 * CHUNK)
    small = bytearray(10)  # too small: a buffer of its own is used
    for lo in EDGES:
        for hi in EDGES:
            want = data[lo:hi]
            assert ref_read_loc(loc, lo, hi, CHUNK) == want
            for s in (None, scratch, small):
                got = read_loc(loc, lo, hi, CHUNK, s)  # type: ignore[arg-type]
                assert got is not None and bytes(got) == want, (lo, hi, s is None)
            if hi < lo:
                continue
            out = bytearray(hi - lo)
            assert read_loc_into(loc, lo, memoryview(out), CHUNK, scratch)  # type: ignore
            assert out == want, (lo, hi)
            out = bytearray(hi - lo)
            assert read_loc_into(loc, lo, memoryview(out), CHUNK)  # type: ignore[arg-type]
            assert out == want, (lo, hi)


def test_a_view_is_of_the_scratch_when_it_is_large_enough(segfile) -> None:
    loc, data = segfile(data_of(BLOCK))
    scratch = bytearray(BLOCK + 2 * CHUNK)
    got = read_loc(loc, CHUNK + 5, 2 * CHUNK + 9, CHUNK, scratch)  # type: ignore[arg-type]
    assert got is not None and got.obj is scratch
    assert bytes(got) == data[CHUNK + 5:2 * CHUNK + 9]
    assert scratch[:CHUNK] == data[CHUNK:2 * CHUNK]  # whole chunks were read into it


def test_a_range_past_the_block_end_is_cut_as_before(segfile) -> None:
    loc, data = segfile(data_of(BLOCK))
    for lo, hi in [(0, BLOCK + 100), (BLOCK - 5, BLOCK + 4096), (BLOCK, BLOCK + 1)]:
        got = read_loc(loc, lo, hi, CHUNK)  # type: ignore[arg-type]
        assert got is not None and bytes(got) == data[lo:hi] == ref_read_loc(loc, lo, hi, CHUNK)


# -- damaged, stale, short, unreadable: None / False, as the reference ------------------------

def test_a_flipped_byte_fails_every_read_touching_its_chunk_and_no_other(segfile) -> None:
    data = data_of(BLOCK)
    for c in range(4):
        for where in (c * CHUNK, min(BLOCK, (c + 1) * CHUNK) - 1):
            bad = bytearray(data)
            bad[where] ^= 0x40
            loc, _ = segfile(data, f"{c}-{where}.seg")
            os.pwrite(loc.seg.fd, bad[where:where + 1], AT + where)
            for lo in EDGES:
                for hi in EDGES:
                    if hi <= lo:
                        continue
                    touches = lo // CHUNK <= c <= (hi - 1) // CHUNK
                    got = read_loc(loc, lo, hi, CHUNK)  # type: ignore[arg-type]
                    ref = ref_read_loc(loc, lo, hi, CHUNK)
                    assert (got is None) == (ref is None) == touches, (c, where, lo, hi)
                    assert got is None or bytes(got) == data[lo:hi]
                    out = memoryview(bytearray(hi - lo))
                    assert read_loc_into(loc, lo, out, CHUNK) == (not touches)  # type: ignore
                    if not touches:
                        assert bytes(out) == data[lo:hi]


def test_a_stale_zeroed_region_is_none(segfile) -> None:
    loc, _ = segfile(data_of(BLOCK))
    os.pwrite(loc.seg.fd, bytes(BLOCK), AT)  # as an evicted block reads: zeros
    for lo, hi in [(0, BLOCK), (0, 1), (CHUNK, 2 * CHUNK), (BLOCK - 1, BLOCK)]:
        assert read_loc(loc, lo, hi, CHUNK) is None  # type: ignore[arg-type]
        assert ref_read_loc(loc, lo, hi, CHUNK) is None
        assert not read_loc_into(loc, lo, memoryview(bytearray(hi - lo)), CHUNK)  # type: ignore


def test_a_freed_region_is_none(segfile) -> None:
    loc, _ = segfile(data_of(BLOCK))
    try:
        punch_hole(loc.seg.fd, AT, BLOCK + (-BLOCK % 4096))  # what eviction does
    except OSError as exc:
        pytest.skip(f"no hole punching here: {exc}")
    assert read_loc(loc, 0, BLOCK, CHUNK) is None  # type: ignore[arg-type]
    assert not read_loc_into(loc, 0, memoryview(bytearray(BLOCK)), CHUNK)  # type: ignore


def test_a_file_cut_short_is_none(segfile) -> None:
    loc, data = segfile(data_of(BLOCK))
    os.ftruncate(loc.seg.fd, AT + 2 * CHUNK + 10)
    assert bytes(read_loc(loc, 0, CHUNK, CHUNK) or b"") == data[:CHUNK]  # before the cut
    for lo, hi in [(0, BLOCK), (2 * CHUNK, 2 * CHUNK + 5), (3 * CHUNK, BLOCK)]:
        assert read_loc(loc, lo, hi, CHUNK) is None  # type: ignore[arg-type]
        assert ref_read_loc(loc, lo, hi, CHUNK) is None
        assert not read_loc_into(loc, lo, memoryview(bytearray(hi - lo)), CHUNK)  # type: ignore


def test_a_closed_descriptor_is_none_not_an_error(segfile) -> None:
    loc, _ = segfile(data_of(BLOCK))
    loc.seg.close()  # the spoke deleted the segment; a reader still has the location
    try:
        assert read_loc(loc, 0, BLOCK, CHUNK) is None  # type: ignore[arg-type]
        assert ref_read_loc(loc, 0, BLOCK, CHUNK) is None
        assert not read_loc_into(loc, 0, memoryview(bytearray(BLOCK)), CHUNK)  # type: ignore
    finally:
        loc.seg.fd = -1  # closed: the fixture must not close the number again


def test_digests_too_short_for_the_block_are_none(segfile) -> None:
    loc, _ = segfile(data_of(BLOCK))
    loc.chunks = loc.chunks[:16]  # two of four
    assert read_loc(loc, 0, CHUNK, CHUNK) is not None  # type: ignore[arg-type]
    assert read_loc(loc, 0, BLOCK, CHUNK) is None  # type: ignore[arg-type]
    assert ref_read_loc(loc, 0, BLOCK, CHUNK) is None


def test_a_same_host_reader_gets_the_same_answers(tmp_path: Path) -> None:
    """cache.shared's reader (its own read-only descriptors) goes through the same code."""
    (tmp_path / "segments").mkdir()
    data = data_of(BLOCK)
    (tmp_path / "segments" / "00000007.seg").write_bytes(data_of(AT, 5) + data)
    cache = SharedCache(tmp_path, "id", chunk_size=CHUNK)
    entry = {"seg": 7, "offset": AT, "size": BLOCK, "digest": "00" * 16,
             "chunks": ref_chunk_digests(data, CHUNK).hex()}
    loc = cache.loc(entry)
    assert loc is not None
    assert bytes(cache.read(loc, 0, BLOCK) or b"") == data
    assert bytes(cache.read(loc, 10, CHUNK + 3) or b"") == data[10:CHUNK + 3]
    out = memoryview(bytearray(CHUNK))
    assert cache.read_into(loc, CHUNK, out) and bytes(out) == data[CHUNK:2 * CHUNK]
    os.truncate(tmp_path / "segments" / "00000007.seg", AT + 100)  # the spoke cut it
    assert cache.read(loc, 0, BLOCK) is None
    assert not cache.read_into(loc, CHUNK, out)
    os.close(loc.seg.fd)


# -- the seam itself -------------------------------------------------------------------------

def test_the_native_read_refuses_calls_that_break_its_contract(segfile) -> None:
    loc, data = segfile(data_of(BLOCK))
    fd, chunks = loc.seg.fd, loc.chunks
    with pytest.raises(TypeError, match="writable"):
        _native.read_checked(fd, AT, b"x" * CHUNK, 0, CHUNK, chunks)
    with pytest.raises(ValueError, match="chunk size"):
        _native.read_checked(fd, AT, bytearray(CHUNK), 0, 0, chunks)
    with pytest.raises(ValueError, match="bad range"):
        _native.read_checked(fd, AT + 5, bytearray(CHUNK), 5, CHUNK, chunks)
    with pytest.raises(BufferError, match="contiguous"):
        _native.read_checked(fd, AT, memoryview(bytearray(2 * CHUNK))[::2], 0, CHUNK, chunks)
    assert _native.read_checked(-1, AT, bytearray(CHUNK), 0, CHUNK, chunks) is False
    assert _native.read_checked(fd, AT, bytearray(), 0, CHUNK, chunks) is True
    out = bytearray(CHUNK)
    assert _native.read_checked(fd, AT, out, 0, CHUNK, chunks) is True and out == data[:CHUNK]
    with mmap.mmap(-1, 3 * CHUNK) as m:  # any writable buffer
        view = memoryview(m)[CHUNK:3 * CHUNK]
        assert _native.read_checked(fd, AT + CHUNK, view, CHUNK, CHUNK, chunks) is True
        assert bytes(view) == data[CHUNK:3 * CHUNK]
        view.release()


def _overlaps_other_thread(call: Callable[[], object]) -> bool:
    """Whether the main thread ran Python during the middle half of ``call`` in another
    thread. It can only if the call releases the GIL: a call that holds it leaves the main
    thread the moments before it starts and after it returns (a switch interval at most,
    made short here), never its middle. Tried a few times: a loaded machine may not
    schedule the main thread in time."""

    def worker(started: threading.Event, span: list[float]) -> None:
        started.set()
        t0 = time.perf_counter()
        call()
        span.extend((t0, time.perf_counter()))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        for _ in range(5):
            span: list[float] = []
            started = threading.Event()
            t = threading.Thread(target=worker, args=(started, span))
            stamps: list[float] = []
            t.start()
            started.wait()
            while t.is_alive():
                stamps.append(time.perf_counter())
            t.join()
            q = (span[1] - span[0]) / 4
            if any(span[0] + q < s < span[1] - q for s in stamps):
                return True
    finally:
        sys.setswitchinterval(interval)
    return False


def test_reads_and_large_hashes_run_without_the_gil(tmp_path: Path) -> None:
    size = 96 << 20
    zeros = bytes(size)
    chunk = 256 * 1024
    chunks = chunk_digests(zeros[:chunk], chunk) * (size // chunk)
    path = tmp_path / "sparse.seg"
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: reads as zeros, costs no disk
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(size)
    try:
        assert _native.read_checked(fd, 0, out, 0, chunk, chunks)
        assert _overlaps_other_thread(lambda: _native.read_checked(fd, 0, out, 0, chunk, chunks))
    finally:
        os.close(fd)
    assert _overlaps_other_thread(lambda: chunk_digests(zeros, chunk))
