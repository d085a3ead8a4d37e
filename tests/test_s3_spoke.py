"""A spoke straight on a bucket (``spokefs spoke serve --upstream s3://...``): real spoke
processes over moto in server mode, through the spoke's private bucket hub."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("boto3")
pytest.importorskip("obstore")
pytest.importorskip("moto")

import spokefs
from servers import ServerProcess
from spokefs.mount.process import MountProcess, fuse_unusable
from spokefs.procs import cli
from spokefs_bench.s3server import S3Server
from test_s3_origin import BS, get, hub_env, make_bucket, manifest, rnd

FUSE_REASON = fuse_unusable()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


def bucket_spoke(s3: S3Server, source: str, cache: Path, *extra: str) -> ServerProcess:
    return ServerProcess("spoke", "serve", "--upstream", source, "--cache-dir", str(cache),
                         "--cache-size", "1GiB", "--port", "0", "--no-fsync", "--block-size",
                         str(BS), *extra, env=hub_env(s3))


def private_hub_pid(spoke_pid: int) -> int:
    """The pid of the spoke's bucket hub (a child of the spoke's supervisor)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == spoke_pid and b"hub" in args and b"serve" in args:
            return int(entry.name)
    raise AssertionError(f"no bucket hub under pid {spoke_pid}")


def gone(pid: int, within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its parent
            return True
        time.sleep(0.1)
    return False


def test_reads_through_a_spoke_on_a_bucket(s3: S3Server, tmp_path: Path) -> None:
    objects = {"sets/imgs/a.bin": rnd(3 * BS + 777, 51), "sets/imgs/sub/b c.bin": rnd(5000, 52),
               "sets/imgs/ünï/x": b"unicode", "sets/imgs/empty": b""}
    make_bucket(s3, "spokebkt", objects)
    with bucket_spoke(s3, "s3://spokebkt/sets/imgs", tmp_path / "cache", "--name", "pics",
                      "--workers", "2", "--deadline", "10s") as sp:
        m = manifest(sp.url, "pics")
        assert m["paths"] == sorted(k.removeprefix("sets/imgs/") for k in objects)
        for path in m["paths"]:
            status, body, _ = get(f"{sp.url}/pics/{quote(path)}")
            assert (status, body) == (200, objects[f"sets/imgs/{path}"]), path
        data = objects["sets/imgs/a.bin"]
        for a, b in [(BS - 10, BS + 10), (2 * BS - 1, 2 * BS + 1), (5, len(data))]:
            status, body, _ = get(f"{sp.url}/pics/a.bin", {"Range": f"bytes={a}-{b - 1}"})
            assert status in (200, 206) and body == data[a:b], (a, b)
        with spokefs.open(f"{sp.url}/pics/a.bin") as f:
            f.seek(3 * BS - 3)
            assert f.read(10) == data[3 * BS - 3:3 * BS + 7]
        metrics = get(f"{sp.url}/metrics")[1].decode()
        assert not re.search(r'^spokefs_integrity_failures_total\{[^}]*\} [1-9]', metrics,
                             re.M)
        # The private hub: loopback, and only this spoke's token opens it.
        hub_dir = tmp_path / "cache" / "bucket-hub"
        for name in ("hub.tokens", "spoke.token"):
            assert stat.S_IMODE((hub_dir / name).stat().st_mode) == 0o600
        hub_url = next(line.split(" at ")[1].strip() for line in sp.lines
                       if "through its own bucket hub at" in line)
        assert get(f"{hub_url}/v1/datasets")[0] == 401
        pid = private_hub_pid(sp.pid)
    assert gone(pid), "the bucket hub outlived the spoke"


def test_bucket_options_only_with_s3(tmp_path: Path) -> None:
    r = subprocess.run(cli("spoke", "serve", "--upstream", "http://127.0.0.1:9", "--cache-dir",
                           str(tmp_path / "c"), "--cache-size", "1GiB", "--name", "x"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--name is for an s3:// upstream" in r.stderr


@pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")
def test_mount_through_a_spoke_on_a_bucket(s3: S3Server, tmp_path: Path) -> None:
    objects = {f"m/class{i % 2}/img{i}.jpg": rnd(10_000 + i, 60 + i) for i in range(6)}
    objects["m/shard.tar"] = rnd(2 * BS + 99, 70)
    make_bucket(s3, "mounted", objects)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with bucket_spoke(s3, "s3://mounted/m", tmp_path / "cache", "--workers", "1") as sp, \
            MountProcess(f"{sp.url}/m", mp, "--deadline", "10s"):
        seen = {}
        for root, _dirs, files in os.walk(mp):
            for f in files:
                p = Path(root) / f
                seen[f"m/{p.relative_to(mp)}"] = p.read_bytes()
        assert seen == objects
        with open(mp / "shard.tar", "rb") as f:  # a read across a block edge
            f.seek(BS - 5)
            assert f.read(10) == objects["m/shard.tar"][BS - 5:BS + 5]


def test_overwrite_under_pinned_snapshot_is_410(s3: S3Server, tmp_path: Path) -> None:
    old, new = rnd(3 * BS, 81), rnd(3 * BS, 82)
    c = make_bucket(s3, "spokeover", {"d/f.bin": old, "d/other": b"stays"})
    with bucket_spoke(s3, "s3://spokeover/d", tmp_path / "cache", "--workers", "1",
                      "--deadline", "5s", "--no-prefetch") as sp:
        snap = manifest(sp.url, "d")["snapshot"]
        assert get(f"{sp.url}/d@{snap}/f.bin", {"Range": f"bytes=0-{BS - 1}"})[1] == old[:BS]
        c.put_object(Bucket="spokeover", Key="d/f.bin", Body=new)
        status, body, _ = get(f"{sp.url}/d@{snap}/f.bin", {"Range": f"bytes={BS}-{BS + 99}"})
        assert status == 410 and b"version_gone" in body
        try:
            status, body, _ = get(f"{sp.url}/d@{snap}/f.bin")
        except (http.client.HTTPException, OSError):
            status, body = -1, b""  # a response cut after block 0: also no mixed bytes
        assert body != new and (status == 410 or new[BS:2 * BS] not in body)
        assert get(f"{sp.url}/d@{snap}/other")[1] == b"stays"
        # A snapshot asked of the spoke is made by its hub: a new listing.
        req = urllib.request.Request(f"{sp.url}/v1/datasets/d/snapshots", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            fresh = json.loads(r.read())
        assert fresh["new"] is True and fresh["id"] != snap
        assert get(f"{sp.url}/d@{fresh['id']}/f.bin")[1] == new
        assert get(f"{sp.url}/d/f.bin")[1] == new  # latest, once the spoke asks again


@pytest.mark.slow
def test_bucket_down_cached_reads_go_on(tmp_path: Path) -> None:
    cached, uncached = rnd(2 * BS + 7, 91), rnd(BS + 3, 92)
    deadline = 3.0
    cache = tmp_path / "cache"
    with S3Server() as down:
        make_bucket(down, "downbkt", {"d/cached": cached, "d/uncached": uncached})
        sp = bucket_spoke(down, "s3://downbkt/d", cache, "--workers", "1", "--deadline",
                          f"{deadline}s", "--latest-ttl", "1s")
        with sp:
            assert get(f"{sp.url}/d/cached")[1] == cached
            down.kill()
            time.sleep(1.2)  # past --latest-ttl: the spoke asks its hub again
            assert get(f"{sp.url}/d/cached")[1] == cached
            t0 = time.monotonic()
            status, body, _ = get(f"{sp.url}/d/uncached", timeout=60)
            took = time.monotonic() - t0
            assert status == 503 and b"upstream_unavailable" in body
            assert took < deadline + 10, took  # the deadline, plus a loaded machine's slack
            assert down.url.split("//")[1] not in body.decode()
        # Restarted while the bucket is still down: it knew the bucket, so it starts and
        # serves what it has cached; its hub is retried in the background.
        again = bucket_spoke(down, "s3://downbkt/d", cache, "--workers", "1", "--deadline",
                             f"{deadline}s")
        with again:
            t0 = time.monotonic()
            assert get(f"{again.url}/d/cached", timeout=60)[1] == cached
            assert time.monotonic() - t0 < deadline + 10
            status, body, _ = get(f"{again.url}/d/uncached", timeout=60)
            assert status == 503 and b"upstream_unavailable" in body
            assert "serving what is cached" in "".join(again.lines)


@pytest.mark.slow
def test_private_hub_killed_is_restarted(s3: S3Server, tmp_path: Path) -> None:
    objects = {f"k/f{i}": rnd(BS + i, 100 + i) for i in range(3)}
    make_bucket(s3, "killhub", objects)
    with bucket_spoke(s3, "s3://killhub/k", tmp_path / "cache", "--workers", "1",
                      "--deadline", "30s", "--no-prefetch") as sp:
        assert get(f"{sp.url}/k/f0")[1] == objects["k/f0"]
        pid = private_hub_pid(sp.pid)
        os.kill(pid, signal.SIGKILL)
        assert get(f"{sp.url}/k/f0")[1] == objects["k/f0"]  # cached: no hub needed
        assert get(f"{sp.url}/k/f1", timeout=60)[1] == objects["k/f1"]  # after its restart
        assert private_hub_pid(sp.pid) != pid
        assert "restarting it (restart 1)" in "".join(sp.lines)
        # kill -9 of the spoke: its hub goes with it (parent-death signal).
        pid = private_hub_pid(sp.pid)
        sp.kill()
        assert gone(pid), "the bucket hub outlived a killed spoke"


def test_warm_and_purge_on_a_bucket(s3: S3Server, tmp_path: Path) -> None:
    from spokefs.client.control import SpokeControl

    objects = {f"w/d{i % 2}/f{i}": rnd(BS // 2 + i, 200 + i) for i in range(6)}
    make_bucket(s3, "warmbkt", objects)

    def object_gets() -> int:
        return sum("GET /warmbkt/w/" in line for line in s3.lines)  # 206s are coloured

    with bucket_spoke(s3, "s3://warmbkt/w", tmp_path / "cache", "--workers", "1",
                      "--no-prefetch") as sp:
        SpokeControl(f"{sp.url}/w").warm(wait=True, progress=False, timeout=60)
        before = object_gets()
        assert before >= len(objects)  # the warm-up read every object from the bucket
        for key, body in objects.items():
            assert get(f"{sp.url}/{quote(key)}")[1] == body
        assert object_gets() == before  # all from the cache
        req = urllib.request.Request(f"{sp.url}/v1/purge", method="POST",
                                     data=json.dumps({"dataset": "w"}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["freed_bytes"] > 0
        assert get(f"{sp.url}/w/d0/f0")[1] == objects["w/d0/f0"]
        assert object_gets() > before  # purged: read from the bucket again
