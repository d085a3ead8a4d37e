from __future__ import annotations

import pytest

from spokefs.errors import BadRequest, ConfigError, RangeNotSatisfiable
from spokefs.integrity import block_span, blocks_in_range
from spokefs.units import parse_duration, parse_rate, parse_size
from spokefs.wire.paths import clean_path, split_dataset_ref
from spokefs.wire.ranges import parse_range


@pytest.mark.parametrize(("text", "value"), [
    ("4MiB", 4 * 2**20), ("1.5GB", 1_500_000_000), ("512", 512), ("2TiB", 2 * 2**40)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_rate_and_duration() -> None:
    assert parse_rate("400MB/s") == 400e6
    assert parse_rate("1Gbit/s") == 1e9 / 8
    assert parse_duration("60ms") == pytest.approx(0.06)
    assert parse_duration("2m") == 120


@pytest.mark.parametrize("bad", ["ten", "4XB", "", "-3MB"])
def test_bad_sizes_are_clear(bad: str) -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(bad)


@pytest.mark.parametrize(("header", "size", "want"), [
    (None, 10, None), ("bytes=0-4", 10, (0, 5)), ("bytes=5-", 10, (5, 10)),
    ("bytes=-3", 10, (7, 10)), ("bytes=8-100", 10, (8, 10)), ("bytes=-30", 10, (0, 10))])
def test_parse_range(header: str | None, size: int, want: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == want


@pytest.mark.parametrize("header", ["bytes=a-b", "items=0-1", "bytes=5-2", "bytes=0-1,4-5",
                                    "bytes=-", "bytes", "bytes=\u00b2-3",
                                    "bytes=0-\u0663", "bytes=1" + "0" * 30 + "-"])
def test_malformed_range(header: str) -> None:
    with pytest.raises(BadRequest):
        parse_range(header, 10)


@pytest.mark.parametrize(("header", "size"), [("bytes=10-", 10), ("bytes=0-", 0),
                                              ("bytes=-0", 10)])
def test_unsatisfiable_range(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


def test_block_geometry() -> None:
    assert list(blocks_in_range(0, 10, 4)) == [0, 1, 2]
    assert list(blocks_in_range(4, 8, 4)) == [1]
    assert list(blocks_in_range(3, 5, 4)) == [0, 1]
    assert block_span(2, 10, 4) == (8, 10)


@pytest.mark.parametrize("bad", ["../x", "a/../../etc", "a/./b", "/etc/passwd", "a\x00b",
                                 "a\\..\\b"])
def test_clean_path_rejects_escapes(bad: str) -> None:
    with pytest.raises(BadRequest):
        clean_path(bad)


def test_clean_path_and_refs() -> None:
    assert clean_path("a//b/") == "a/b"
    assert split_dataset_ref("imagenet@3fa9") == ("imagenet", "3fa9")
    assert split_dataset_ref("imagenet") == ("imagenet", "latest")
    with pytest.raises(BadRequest):
        split_dataset_ref("..")
