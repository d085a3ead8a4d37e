"""spokefs.open and the spokefs:// fsspec filesystem, against a real spoke."""

from __future__ import annotations

import io
import random
from pathlib import Path

import fsspec
import pytest
import urllib3

import spokefs
from spokefs.client.urls import parse_url
from spokefs.errors import BadRequest, ConfigError
from spokefs.mount.source import Target


def test_url_rules() -> None:
    """One grammar for every spokefs URL (open, fsspec, status, warm, purge, the mount):
    ``[http[s]|spokefs]://host:port/<dataset>[@<snapshot>][/<path>]``."""
    u = parse_url("spoke:8471/imagenet/train/x.jpg")
    assert (u.base, u.dataset, u.snapshot, u.path) == (
        "http://spoke:8471", "imagenet", "latest", "train/x.jpg")
    u = parse_url("spokefs://h:1/ds@3fa9c1d20b7e/a%20b/")
    assert (u.base, u.dataset, u.snapshot, u.path) == ("http://h:1", "ds", "3fa9c1d20b7e", "a b")
    assert parse_url("https://h/ds").base == "https://h"
    for bad in ("ftp://h/ds", "http://h", "http:///ds"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    for bad in ("http://h/ds/../x", "http://h/bad name/x", "http://h/ds@../x"):
        with pytest.raises(BadRequest):
            parse_url(bad)
    # The mount reads a dataset URL by the same rules.
    for url in ("http://h:1/ds", "h:1/ds@3fa9c1d20b7e", "https://h/ds/"):
        t, u = Target.parse(url), parse_url(url)
        assert (t.base, t.dataset, t.snapshot) == (u.base, u.dataset, u.snapshot)


def test_open_seek_read_readinto(spoke_server, dataset: Path) -> None:
    src = (dataset / "shards/shard-000.tar").read_bytes()
    rng = random.Random(3)
    with spokefs.open(f"{spoke_server.url}/ds/shards/shard-000.tar") as f:
        assert f.seekable() and f.readable()
        for _ in range(20):
            off = rng.randrange(len(src))
            n = rng.randrange(1, 3 << 20)
            f.seek(off)
            assert f.read(n) == src[off:off + n]
        f.seek(-10, io.SEEK_END)
        assert f.read() == src[-10:]
        assert f.read(5) == b""
        f.seek(0)
        buf = bytearray(1000)
        assert f.readinto(buf) == 1000 and bytes(buf) == src[:1000]
        assert f.tell() == 1000


def test_open_is_pinned_to_its_snapshot(spoke_server, hub_server, dataset: Path) -> None:
    path = dataset / "class2/img0006.jpg"
    old = path.read_bytes()
    f = spokefs.open(f"{spoke_server.url}/ds/class2/img0006.jpg", buffering=0)
    assert f.read(10) == old[:10]
    path.write_bytes(b"new" * 100)
    urllib3.request("POST", f"{hub_server.url}/v1/datasets/ds/snapshots")
    # The open file keeps its version: the rest comes from cache, never the new content.
    assert f.read() == old[10:]


def test_open_errors(spoke_server) -> None:
    with pytest.raises(spokefs.NotFound):
        spokefs.open(f"{spoke_server.url}/ds/no/such/file")
    with pytest.raises(IsADirectoryError):
        spokefs.open(f"{spoke_server.url}/ds/class1")
    with pytest.raises(ValueError, match="read-only"):
        spokefs.open(f"{spoke_server.url}/ds/class1/img0001.jpg", "wb")
    with pytest.raises(spokefs.ConfigError):
        spokefs.open("ftp://x/y")


def test_fsspec_filesystem(spoke_server, dataset: Path) -> None:
    host = spoke_server.url.split("://", 1)[1]
    fs = fsspec.filesystem("spokefs")
    names = fs.ls(f"spokefs://{host}/ds", detail=False)
    assert f"{host}/ds/class0" in names and f"{host}/ds/empty.txt" in names
    info = fs.info(f"spokefs://{host}/ds/class0/img0000.jpg")
    src = (dataset / "class0/img0000.jpg").read_bytes()
    assert info["size"] == len(src) and info["type"] == "file"
    assert fs.cat_file(f"spokefs://{host}/ds/class0/img0000.jpg", 5, 50) == src[5:50]
    with fsspec.open(f"spokefs://{host}/ds/shards/shard-001.tar", "rb") as f:
        assert f.read() == (dataset / "shards/shard-001.tar").read_bytes()
    assert fs.info(f"spokefs://{host}/ds/empty_dir")["type"] == "directory"
    with pytest.raises(FileNotFoundError):
        fs.info(f"spokefs://{host}/ds/nope")
    found = fs.find(f"spokefs://{host}/ds")
    assert len(found) == 23
