"""Property tests of the parsers that take client input: paths and names, Range headers,
control bodies and announced orders. For any input the only exceptions are the documented
4xx ones (BadRequest and its 413 subclasses, RangeNotSatisfiable), and what they accept
keeps its invariants."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from array import array
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spokefs.errors import BadRequest, RangeNotSatisfiable
from spokefs.manifest import Manifest
from spokefs.planner import Manifest as PlannerManifest
from spokefs.planner.order import MAX_ORDER_BLOCKS, OrderCursor, check_order
from spokefs.spoke.routes import Fields, _read_context, parse_json_body, parse_order
from spokefs.wire.paths import check_dataset_name, check_snapshot_id, clean_path, split_dataset_ref
from spokefs.wire.ranges import parse_range

SETTINGS = settings(deadline=None, max_examples=200,
                    suppress_health_check=[HealthCheck.too_slow])
BS = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# JSON as json.loads gives it back (NaN and infinities included: Python's parser takes them).
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 40)
           | st.floats() | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=25)

# A small snapshot: empty, sub-block, multi-block files (block size 1 MiB).
SIZES = [0, 10, BS, BS + 1, 5 * BS + 7, 300]
PATHS = ["a/empty", "a/small", "b/one", "b/two", "c/big", "c/last"]
MANIFEST = Manifest(dataset="ds", snapshot="0123456789ab", created=0.0, block_size=BS,
                    paths=PATHS, sizes=SIZES, modes=[0o644] * 6, mtimes=[0] * 6,
                    versions=[f"{i:032x}" for i in range(6)], dirs=["", "a", "b", "c"])
PLANNER_MANIFEST = PlannerManifest(PATHS, MANIFEST.versions, SIZES, BS)

offsets = st.integers(-3, 6 * BS) | st.integers() | st.sampled_from([0, 10, BS, 10**15])
lengths = st.integers(-3, 6 * BS) | st.integers() | st.sampled_from([1, BS, 10**15, 2**70])
range_entries = (st.tuples(offsets, lengths).map(list) | json_values)
order_docs = st.fixed_dictionaries({}, optional={
    "indexes": st.lists(st.integers(-1, 6), max_size=12) | json_values,
    "paths": st.lists(st.sampled_from([*PATHS, "/c/big/", "nope", ""]), max_size=8) | json_values,
    "prefix": st.sampled_from(["", "a", "b/", "c/big", "nope"]) | json_values,
    "ranges": st.lists(range_entries, max_size=12) | json_values,
    "epoch": st.integers(-1, 3) | json_values,
    "snapshot": st.sampled_from(["latest", "0123456789ab"]) | json_values,
})


# -- names and paths ---------------------------------------------------------------------------


@SETTINGS
@given(st.text() | st.text(alphabet="ab./\\\x00 \n", max_size=12))
def test_clean_path_is_clean_and_idempotent(path: str) -> None:
    try:
        out = clean_path(path)
    except BadRequest:
        return
    parts = out.split("/")
    assert out == "" or all(p not in ("", ".", "..") for p in parts)
    assert "\x00" not in out and "\\" not in out and not out.startswith("/")
    assert clean_path(out) == out


@SETTINGS
@given(json_values | st.text(alphabet="aZ9._-@/\n\x00", max_size=140))
def test_names_and_refs_accept_only_names(value: Any) -> None:
    for check in (check_dataset_name, check_snapshot_id):
        try:
            out = check(value)
        except BadRequest:
            continue
        assert out == value and _NAME.fullmatch(out)  # no "\n" sneaks past a "$"
    if isinstance(value, str):
        try:
            name, snap = split_dataset_ref(value)
        except BadRequest:
            return
        assert _NAME.fullmatch(name) and _NAME.fullmatch(snap)
        assert value in (name, f"{name}@", f"{name}@{snap}")  # "" is latest


# -- Range headers -----------------------------------------------------------------------------


@SETTINGS
@given(st.text(max_size=40) | st.from_regex(r"\A ?bytes ?= ?[0-9]{0,22}-[0-9]{0,22} ?\Z"),
       st.integers(0, 2**63 - 1) | st.integers(0, 100))
def test_parse_range_within_the_file_or_4xx(header: str, size: int) -> None:
    try:
        rng = parse_range(header, size)
    except (BadRequest, RangeNotSatisfiable):
        return
    assert rng is not None
    start, end = rng
    assert 0 <= start < end <= size


@SETTINGS
@given(st.integers(0, 10**6), st.integers(0, 10**6) | st.none(), st.integers(1, 10**6))
def test_parse_range_round_trip(first: int, last: int | None, size: int) -> None:
    if last is not None and last < first:
        first, last = last, first
    header = f"bytes={first}-{'' if last is None else last}"
    if first >= size:
        try:
            parse_range(header, size)
        except RangeNotSatisfiable as exc:
            assert exc.size == size
            return
        raise AssertionError(f"{header} of {size} bytes was satisfied")
    end = size if last is None else min(last + 1, size)
    assert parse_range(header, size) == (first, end)
    suffix = first + 1
    assert parse_range(f"bytes=-{suffix}", size) == (max(0, size - suffix), size)


# -- control bodies ----------------------------------------------------------------------------


@SETTINGS
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_body_is_an_object_or_400(raw: bytes) -> None:
    for body in (raw, gzip.compress(raw), gzip.compress(raw)[:-5], zlib.compress(raw),
                 gzip.compress(raw) * 2):
        try:
            fields = parse_json_body(body)
        except BadRequest:
            continue
        assert type(fields.doc) is dict
        if body != gzip.compress(raw) * 2:  # two JSON texts in a row are no JSON
            assert fields.doc == (json.loads(raw) if raw.strip() else {})


@SETTINGS
@given(json_values)
def test_fields_give_their_type_or_400(doc: Any) -> None:
    try:
        f = Fields(doc)
    except BadRequest:
        assert type(doc) is not dict
        return
    readers = (f.integer, f.flag, f.text, lambda k: f.items(k, int, "integers", 3), f.object)
    for key in doc:
        for read in readers:
            try:
                value = read(key)  # type: ignore[operator]
            except BadRequest as exc:
                assert key in str(exc) or "item" in str(exc) or "object" in str(exc)
                continue
            if doc[key] is None:
                continue
            assert type(value) in (int, bool, str, list, Fields)
            assert type(value) is not int or 0 <= value < 2**63
    try:
        ctx, (start, end) = _read_context(f)
    except BadRequest:
        return
    assert 0 <= start <= end and end - start <= 1 << 40
    assert ctx.path is None or type(ctx.path) is str
    assert ctx.size is None or type(ctx.size) is int


# -- orders ------------------------------------------------------------------------------------


@SETTINGS
@given(order_docs)
def test_order_body_parses_to_a_sound_order_or_4xx(doc: dict[str, Any]) -> None:
    try:
        epoch, files, ranges = parse_order(MANIFEST, Fields(doc))
    except BadRequest:
        return
    assert type(epoch) is int and epoch >= 0
    assert all(type(f) is int and 0 <= f < len(SIZES) for f in files)
    if ranges is not None:
        assert len(ranges) == len(files)
        for f, (offset, length) in zip(files, ranges, strict=True):
            assert offset >= 0 and length > 0 and offset + length <= max(SIZES[f], 1)
        assert check_order(SIZES, BS, files, ranges) == ranges  # clipping is idempotent
    # Built into a cursor: positions only name blocks the files have, bytes add up.
    cur = OrderCursor(PLANNER_MANIFEST, 8)
    new = cur.extend(files, ranges)
    nblocks = [PLANNER_MANIFEST.nblocks(i) for i in range(len(SIZES))]
    assert len(new) <= sum(nblocks[f] for f in files)
    assert all(0 <= b < nblocks[f] for f, b in zip(cur.files, cur.blocks, strict=True))
    assert list(cur.cum) == sorted(cur.cum) and len(cur.cum) == len(cur.files) + 1
    assert len(cur.consumed) == len(cur.files)


@SETTINGS
@given(st.lists(st.integers(-1, 6) | json_values, max_size=8),
       st.none() | st.lists(range_entries, max_size=8) | json_values)
def test_a_bad_order_leaves_the_cursor_as_it_was(files: list[Any], ranges: Any) -> None:
    cur = OrderCursor(PLANNER_MANIFEST, 8)
    cur.extend([1, 4], [(0, 10), (BS, 2 * BS)])
    before = (list(cur.files), list(cur.blocks), list(cur.cum), bytes(cur.consumed))
    try:
        cur.extend(files, ranges)
    except BadRequest:
        assert (list(cur.files), list(cur.blocks), list(cur.cum), bytes(cur.consumed)) == before
        return
    assert len(cur.files) == len(cur.blocks) == len(cur.consumed) == len(cur.cum) - 1
    assert all(type(f) is int and 0 <= f < len(SIZES) for f in files)


@SETTINGS
@given(st.lists(st.sampled_from(range(len(SIZES))), min_size=1, max_size=50),
       st.integers(1, 2**80))
def test_huge_lengths_are_clipped_to_the_file(files: list[int], length: int) -> None:
    ranges = [(0 if SIZES[f] == 0 else SIZES[f] // 2, length) for f in files]
    clipped = check_order(SIZES, BS, files, ranges)
    assert clipped is not None
    assert all(o + n <= max(SIZES[f], 1) for f, (o, n) in zip(files, clipped, strict=True))
    cur = OrderCursor(PLANNER_MANIFEST, 8)
    cur.extend(array("l", files), clipped)
    assert len(cur) <= sum(PLANNER_MANIFEST.nblocks(f) for f in files) <= MAX_ORDER_BLOCKS


@SETTINGS
@given(st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70))
def test_blocks_of_stays_inside_the_file(offset: int, length: int) -> None:
    assume(offset != 0 or length != 0)
    for i in range(len(SIZES)):
        span = PLANNER_MANIFEST.blocks_of(i, offset, length)
        assert len(span) <= PLANNER_MANIFEST.nblocks(i)
        assert all(0 <= b < PLANNER_MANIFEST.nblocks(i) for b in (*span[:1], *span[-1:]))


# -- error answers from a peer ------------------------------------------------------------------
error_bodies = (json_values | st.fixed_dictionaries({"error": json_values}) | st.fixed_dictionaries(
    {"error": st.fixed_dictionaries({}, optional={
        "code": st.sampled_from(["not_found", "rate_limited", "range_not_satisfiable",
                                 "upstream_unavailable", "integrity", "config", "nope"])
        | json_values,
        "message": json_values, "size": json_values, "retry_after": json_values,
        "cause": st.sampled_from(["connection refused", "timed out", ""]) | json_values})}))


@SETTINGS
@given(st.integers(400, 599), error_bodies | st.binary(max_size=64), st.booleans())
def test_any_error_answer_maps_to_one_exception(status: int, body: Any, final: bool) -> None:
    """Whatever a peer sends with an error status, the mapping gives one exception of the
    tree (never raises itself): Transient for a retryable 5xx unless final, else a
    SpokeError whose status is the answer's (or 500 for one the tree has no class for)."""
    from spokefs.errors import SpokeError, Transient
    from spokefs.wire.errors import error_for_status

    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    for sent in (raw, body if isinstance(body, dict) else None):
        err = error_for_status(status, sent, "fallback", final=final)
        if status >= 500 and status != 501 and not final:
            assert isinstance(err, Transient)
            continue
        assert isinstance(err, SpokeError) and str(err)
        assert err.status in (status, 500) or (status == 504 and err.status == 503)
        json.dumps(err.to_json())  # what a server would send on: always encodable
